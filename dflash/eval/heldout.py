"""Which conversations a named eval set (eval.sets) holds, and the rule that keeps them out of
training: a conversation is the same as a training one when it has the same id or the same
content (a hash of its turns). Needs no model: train.py checks it before anything loads."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from ..config import FILE_SOURCES, EvalSetConfig, RunConfig
from ..data.conversations import Conversation
from ..data.files import iter_conversations, read_conversations
from ..data.mix import mix_quotas, source_config


def conversation_keys(convs) -> set[str]:
    """Ids (where rows have them) and content hashes of conversations."""
    return {k for c in convs for k in ((f"id:{c.cid}",) if c.cid else ()) + (f"hash:{c.key}",)}


def is_known(c: Conversation, keys: set[str]) -> bool:
    return (c.cid is not None and f"id:{c.cid}" in keys) or f"hash:{c.key}" in keys


def training_sources(cfg: RunConfig, kinds=FILE_SOURCES) -> list:
    """The data configs of training's sources of these kinds (data.source, or data.mix's, each
    with its share of data.num_samples: a mix that runs short only reads less)."""
    d = cfg.data
    if d.source == "mix":
        quotas = mix_quotas([m.weight for m in d.mix], d.num_samples)
        return [source_config(d, m, q) for m, q in zip(d.mix, quotas) if m.source in kinds and q]
    return [d] if d.source in kinds else []


def training_keys(cfg: RunConfig, kinds=FILE_SOURCES) -> set[str]:
    """Keys of every conversation training may read from its sources of these kinds."""
    keys: set[str] = set()
    for d in training_sources(cfg, kinds):
        keys |= conversation_keys(read_conversations(d, lambda *_: None))
    return keys


def _kinds(source: str) -> tuple:
    """Training sources an eval set's rows could come from: files for a file, else its own."""
    return FILE_SOURCES if source in FILE_SOURCES else (source,)


def set_data(cfg: RunConfig, es: EvalSetConfig, num: int):
    """The eval set's source as a data config (training's conventions: prompt field, turns)."""
    return replace(
        cfg.data,
        source=es.source,
        paths=list(es.paths),
        format=es.format,
        num_samples=num,
        seed=cfg.eval.seed,
        mix=[],
    )


def set_conversations(cfg: RunConfig, es: EvalSetConfig, log=print) -> list[Conversation]:
    """The set's conversations: its first (or, rows=last, last) rows; heldout: of the rows that
    are no training conversation. rows=last also skips a row that repeats an earlier row of the
    file (by id or content): training reads the file from its start, so a repeat near the end
    may be a training row for one run and not for another; without repeats the last rows are one
    set for every run whose training stops before them."""
    num = es.num_prompts or cfg.eval.num_prompts
    if es.rows == "first" and not es.heldout:
        return read_conversations(set_data(cfg, es, num), log)[:num]
    seen = training_keys(cfg, _kinds(es.source)) if es.heldout else set()
    last = es.rows == "last"
    kept, earlier = deque(maxlen=num if last else None), set()
    for c in iter_conversations(set_data(cfg, es, 2**62), log):
        repeat = last and is_known(c, earlier)
        if last:
            earlier |= conversation_keys([c])
        if not repeat and not is_known(c, seen):
            kept.append(c)
            if not last and len(kept) == num:
                break
    if not kept:
        raise ValueError(
            f"eval.sets[{es.name}]: no held-out conversations left in {list(es.paths)}: training "
            "reads every one of them; lower data.num_samples or give the set other files"
        )
    return list(kept)


def check_eval_sets(cfg: RunConfig) -> None:
    """Refuse, in one line, a named eval set (not heldout) with a conversation that training
    also reads; the held-out slices are disjoint by construction."""
    if cfg.eval.enabled and cfg.data.source == "mix" and not (cfg.eval.sets or cfg.eval.source):
        raise ValueError(
            "data.source=mix: name the eval prompts with eval.sets (e.g. a held-out slice of one "
            "source: {name: chat, source: jsonl, paths: [...], heldout: true}) or eval.source"
        )
    explicit = [s for s in cfg.eval.sets if s.source in FILE_SOURCES and not s.heldout]
    if not cfg.eval.enabled or not explicit or not training_sources(cfg):
        return
    seen = training_keys(cfg)
    for es in explicit:
        convs = set_conversations(cfg, es, lambda *_: None)
        both = sum(is_known(c, seen) for c in convs)
        if both:
            raise ValueError(
                f"eval.sets[{es.name}]: {both} of {len(convs)} conversations of {list(es.paths)} "
                "are also training conversations (same id or content); set heldout: true on "
                "the set for the rows training does not use, or point it at held-out files"
            )
