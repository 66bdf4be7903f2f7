"""Regeneration turn by turn: round k asks the target for answer k of every conversation that has
a user turn k, each prompt being the conversation so far (the target's own earlier answers, the
glue, the new user turn). One sample per conversation: its tokens up to the end of the last
answer that fits in data.max_length, the loss mask True exactly on the target's answers.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..config import DataConfig, TargetConfig
from .batch import Sample
from .prompts import TokenTable, drop_long_prompts, random_prompts
from .turns import TurnPrompts, encode_turns


def run_turns(tp: TurnPrompts, generate, max_length: int, eos: int | None):
    """generate(prompts, k, convs) -> one answer per prompt (None: not reached in time); convs:
    the conversations the prompts belong to.
    Returns (seqs, spans, reached, stats): per conversation its tokens, the [start, stop) of
    each answer in them, and whether its first turn was reached."""
    C = len(tp)
    seqs: list = [None] * C
    spans: list[list[tuple[int, int]]] = [[] for _ in range(C)]
    reached = [False] * C
    stats = {"turns_cut_at_max_length": 0, "turns_not_reached_in_time": 0}
    active, prompts, k = list(range(C)), tp.first, 0
    while active:
        answers = generate(prompts, k, active)
        nxt, nxt_prompts = [], []
        for c, p, a in zip(active, prompts, answers):
            left = tp.num_turns(c) - k  # turns of c from this one on
            if a is None:
                stats["turns_not_reached_in_time"] += left if k else 0
                continue
            reached[c] = reached[c] or k == 0
            if not a:
                continue
            if k and len(p) + len(a) > max_length:  # cut at the turn boundary before it
                stats["turns_cut_at_max_length"] += left
                continue
            seqs[c] = list(p) + list(a)
            spans[c].append((len(p), len(seqs[c])))
            if left > 1:
                glue = tp.glue_of(c, k)
                if eos is not None and a[-1] == eos and glue[:1] == [eos]:
                    glue = glue[1:]  # the answer's own end of turn is the template's
                if len(seqs[c]) + len(glue) < max_length:
                    nxt.append(c)
                    nxt_prompts.append(seqs[c] + glue)
                else:
                    stats["turns_cut_at_max_length"] += left - 1
        active, prompts, k = nxt, nxt_prompts, k + 1
    stats["rounds"] = k
    return seqs, spans, reached, stats


def dialogue_samples(tp, seqs, spans, reached, max_length: int, too_long: str):
    """Samples of the reached conversations; sample ids count the reached ones (so single-turn
    data keeps the ids it always had). Only a first answer can overflow max_length (later ones
    end the conversation at the turn before): data.too_long truncates or drops it."""
    samples, stats = [], {"truncated": 0, "dropped": 0, "empty_response": 0}
    sid = -1
    for c in range(len(tp)):
        if not reached[c]:
            continue
        sid += 1
        if not spans[c]:
            stats["empty_response"] += 1
            continue
        ids = seqs[c]
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for s, e in spans[c]:
            mask[s:e] = True
        if len(ids) > max_length:
            if too_long == "drop":
                stats["dropped"] += 1
                continue
            stats["truncated"] += 1
            ids, mask = ids[:max_length], mask[:max_length]
            if not bool(mask.any()):
                stats["dropped"] += 1
                continue
        samples.append(Sample(sid, torch.tensor(ids, dtype=torch.long), mask, int(tp.sources[c])))
    if not samples:
        raise ValueError(
            f"the dataset is empty after filtering ({stats}); check data.paths, "
            "data.max_length and data.too_long"
        )
    return samples, stats


def turn_prompts(dcfg: DataConfig, tcfg: TargetConfig, target, log=print) -> TurnPrompts:
    """The prompts (and glue) of the training data: random ones (selfgen) or the source's
    conversations through the target's chat template."""
    if dcfg.source == "selfgen":
        prompts = random_prompts(
            dcfg.num_samples, dcfg.prompt_len, target.vocab_size, [target.mask_token_id], dcfg.seed
        )
        kept, num_long = drop_long_prompts(prompts, dcfg.max_length)
        return TurnPrompts(TokenTable(kept), stats={"prompt_too_long": num_long})
    if target.tokenizer is None:
        raise ValueError(
            f"data.source={dcfg.source} needs a target with a tokenizer (this target has none: "
            "set target.tokenizer=bytes for a target built from target.config, or use "
            "data.source=selfgen)"
        )
    from .mix import training_conversations

    convs, sources = training_conversations(dcfg, log)
    return encode_turns(
        convs,
        target.tokenizer,
        tcfg,
        dcfg.turns,
        dcfg.max_length,
        sources,
        dcfg.max_turns,
        dcfg.answers,
        dcfg.response_len,
    )


def partial_path(path: str, k: int) -> str:
    """Where round k's responses stream to (round 0: the single-turn path of old)."""
    return f"{path}.partial" if k == 0 else f"{path}.turn{k}.partial"


def regenerate_turns(dcfg: DataConfig, target, tp: TurnPrompts, path: str, generate_greedy, log):
    """All rounds through `generate_greedy` (resumable per round): the samples, the figures for
    the log, and the rounds' partial paths (removed once the samples are saved)."""
    limit = None if dcfg.regen_time_limit_min is None else 60 * dcfg.regen_time_limit_min
    t0 = time.monotonic()  # the whole regeneration's clock (each round also keeps its own)
    given = tp.given_mask()

    def generate(prompts, k, convs):
        """The rows' own answers where data.answers=given found them, the target's for the rest."""
        out = [tp.answer_of(c, k) if given[c] else None for c in convs]
        mine = [j for j, c in enumerate(convs) if not given[c]]
        if not mine:
            return out
        if len(mine) < len(convs):
            take = getattr(prompts, "take", None)  # a TokenTable stays flat
            prompts = take(mine) if take else [prompts[j] for j in mine]
        for j, a in zip(mine, regenerate(prompts, k)):
            out[j] = a
        return out

    def regenerate(prompts, k):
        left = None if limit is None else max(limit - (time.monotonic() - t0), 0.0)
        return generate_greedy(
            target,
            prompts,
            dcfg.response_len,
            dcfg.regen_batch_size,
            dcfg.regen_temperature,
            desc="regenerate" if k == 0 else f"regenerate turn {k + 1}",
            partial_path=partial_path(path, k),
            seed=dcfg.seed,
            log=log,
            time_limit_s=left,
            static_kw={
                "compact": dcfg.regen_compact,
                "compile": dcfg.regen_compile,
                "fuse": dcfg.regen_fuse,
            },
        )

    tok = target.tokenizer
    eos = tok.eos_token_id if tok is not None else None
    seqs, spans, reached, turn_stats = run_turns(tp, generate, dcfg.max_length, eos)
    rounds = turn_stats.pop("rounds")
    samples, stats = dialogue_samples(tp, seqs, spans, reached, dcfg.max_length, dcfg.too_long)
    stats["prompt_too_long"] = tp.stats.get("prompt_too_long", 0)
    if n_given := int((given & np.array(reached, dtype=bool)).sum()):
        stats["given_answers"] = n_given  # conversations answered by their rows (data.answers)
    if not all(reached):
        stats["not_reached_in_time"] = reached.count(False)
    if tp.stats.get("turns", len(tp)) > len(tp):  # conversations with several user turns
        stats["answers"] = sum(len(s) for s in spans)
        stats.update({k: v for k, v in turn_stats.items() if v})
        for key in ("turns_past_max_length", "turns_past_max_turns", "turns_without_given_answer"):
            if tp.stats.get(key):
                stats[key] = tp.stats[key]
    return samples, stats, [partial_path(path, k) for k in range(max(rounds, 1))]
