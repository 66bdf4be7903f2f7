"""The training dataset: prompts answered by the target itself (greedy regeneration), cached on
disk in resumable shards keyed by everything that changes the samples.

Samples are token ids (prompt + response) with a loss mask on the response. Responses are the
target's own outputs, so the sequence's tokens and the target's greedy labels agree.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time

import torch
from tqdm.auto import tqdm

from ..common.loggers import progress_bars_off
from ..config import TARGET_EXECUTION_ONLY, DataConfig, TargetConfig
from ..target.load import concrete_settings
from .batch import Sample
from .files import drop_held_reads
from .shards import ResponseShards, atomic_torch_save, pack_samples, unpack_samples


# ----------------------------------------------------------------------------- regeneration
@torch.no_grad()
def generate_greedy(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    desc: str = "regenerate",
    seed: int = 0,
    partial_path: str | None = None,
    log=None,
    time_limit_s: float | None = None,
    static_kw: dict | None = None,
) -> list[list[int] | None]:
    """Batched generation with the target (left padding), one response per prompt.

    Resumable: after every batch the responses so far go to `partial_path` (atomically, with a
    key of the prompts and settings); a rerun with the same arguments continues from there and
    gives the same result as an uninterrupted run (fixed batch boundaries, per-batch seeds).

    time_limit_s: no new batch starts after that many seconds (of this call); the prompts not
    reached get None (a random subset of the batches is reached, see _regen_order).
    static_kw: options of the static decoder (regen.StaticGreedyDecoder: compact, compile)."""
    # Batches of similar lengths: left padding (and a static cache as long as the longest
    # prompt) cost little; the responses come back in the prompts' order.
    order = _regen_order(prompts, batch_size, seed)
    # a TokenTable (dflash.data.prompts) stays flat: rows become lists a batch at a time
    ordered = prompts.take(order) if hasattr(prompts, "take") else [prompts[j] for j in order]
    key = _regen_key(ordered, max_new_tokens, batch_size, temperature, seed)
    shards = ResponseShards(partial_path) if partial_path else None
    done = []
    if partial_path and os.path.isfile(partial_path):  # the older single-file format
        done = shards.adopt_legacy_file(key, log)
    elif shards:
        done = shards.load(key, log)
        if done and log:
            log(f"data: resuming regeneration at {len(done)} responses from {partial_path}")
    bar = tqdm(
        total=len(prompts),
        initial=len(done),
        desc=desc,
        unit="seq",
        leave=False,
        disable=progress_bars_off(),
    )
    t0, new_tokens = time.perf_counter(), 0
    eta = _Eta(desc, len(prompts), len(done), t0, log)
    for i in range(len(done), len(prompts), batch_size):
        now = time.perf_counter() if time_limit_s is not None or log is not None else 0.0
        eta.update(len(done), time_limit_s, now)  # the batches so far
        if time_limit_s is not None and now - t0 >= time_limit_s:
            if log:
                log(
                    f"{desc}: time limit of {time_limit_s / 60:.2f} min reached after {len(done)} "
                    f"of {len(prompts)} prompts (data.regen_time_limit_min)"
                )
            break
        batch = _generate_batch(
            target, ordered[i : i + batch_size], max_new_tokens, temperature, seed + i, static_kw
        )
        done += batch
        new_tokens += sum(len(r) for r in batch)
        bar.update(len(batch))
        if shards:  # one shard per batch, streamed: nothing already written is rewritten
            shards.append(key, i // batch_size, batch)
    bar.close()
    if log and new_tokens:
        dt = time.perf_counter() - t0
        log(
            f"{desc}: {new_tokens} new tokens in {dt:.1f} s ({new_tokens / dt:,.0f} tokens/s, "
            f"batch {batch_size}, {decoder_name(target, temperature)})"
        )
    out: list[list[int] | None] = [None] * len(prompts)
    for j, r in zip(order, done):
        out[j] = r
    return out


class _Eta:
    """Progress lines for the log (the bar reaches train.log only as its last state): after
    the first batch, with the time the rest will take at that rate, so that a first try with
    data sizes meant for a large target (data=jsonl: 800k prompts, 2048 tokens each) says how
    long it will be instead of looking hung; then one every few minutes."""

    EVERY_S = 300.0
    HINT = " (data.num_samples, data.response_len and data.regen_batch_size set the work)"

    def __init__(self, desc: str, total: int, done: int, t0: float, log):
        self.desc, self.total, self.start, self.t0, self.log = desc, total, done, t0, log
        self.last = None

    def update(self, done: int, time_limit_s: float | None, now: float) -> None:
        if self.log is None or done in (self.start, self.total):
            return
        if self.last is not None and now - self.last < self.EVERY_S:
            return
        self.last = now
        spent = now - self.t0
        left = spent / max(done - self.start, 1) * (self.total - done)
        capped = time_limit_s is not None and left > time_limit_s - spent
        if capped:
            left = max(time_limit_s - spent, 0.0)
        self.log(
            f"{self.desc}: {done} of {self.total} prompts in {_duration(spent)}; "
            + (
                f"stops in {_duration(left)} (data.regen_time_limit_min)"
                if capped
                else f"~{_duration(left)} to go at this rate"
            )
            + (self.HINT if self.desc == "regenerate" else "")
        )


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _regen_order(prompts: list[list[int]], batch_size: int, seed: int) -> list[int]:
    """Prompt indices in regeneration order: batches of prompts of similar length (sorted, then
    cut), the batches in a seeded random order, so a regeneration cut short by its time limit
    has a random subset of the prompts, not the shortest ones."""
    lens = prompts.lengths if hasattr(prompts, "lengths") else [len(p) for p in prompts]
    by_len = sorted(range(len(prompts)), key=lambda j: lens[j])
    full = len(by_len) // batch_size  # a short last batch stays last: batches are cut every
    batches = [by_len[i * batch_size : (i + 1) * batch_size] for i in range(full)]  # batch_size
    perm = torch.randperm(full, generator=torch.Generator().manual_seed(seed)).tolist()
    return [j for b in perm for j in batches[b]] + by_len[full * batch_size :]


def _static_path(target, temperature: float) -> bool:
    """Greedy on CUDA with an attention-only target: dflash.target.regen's graph-replayed decoder
    (same greedy tokens as `generate`)."""
    if temperature > 0 or target.device.type != "cuda":
        return False
    from ..target.regen import supports_static

    return supports_static(target.model)


def decoder_name(target, temperature: float) -> str:
    return "static cache + CUDA graph" if _static_path(target, temperature) else "HF generate"


def _generate_batch(
    target,
    chunk: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    static_kw: dict | None = None,
) -> list[list[int]]:
    tok = target.tokenizer
    pad = (
        tok.pad_token_id
        if tok is not None and tok.pad_token_id is not None
        else (tok.eos_token_id if tok is not None else target.mask_token_id)
    )
    eos = tok.eos_token_id if tok is not None else None
    from ..target.regen import hf_generate_batch, static_greedy_batch

    if _static_path(target, temperature):
        return static_greedy_batch(target, chunk, max_new_tokens, pad, eos, **(static_kw or {}))
    torch.manual_seed(seed)
    return hf_generate_batch(target, chunk, max_new_tokens, pad, eos, temperature)


def _regen_key(prompts, max_new_tokens, batch_size, temperature, seed) -> str:
    h = hashlib.sha256(json.dumps([max_new_tokens, batch_size, temperature, seed]).encode())
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()[:16]


def build_samples(
    prompts: list[list[int]], responses: list[list[int]], max_length: int, too_long: str
) -> tuple[list[Sample], dict]:
    """Single-turn samples (prompt + the target's response; loss on the response), as the
    regeneration makes them (dflash.data.rounds.dialogue_samples)."""
    from .prompts import TokenTable
    from .rounds import dialogue_samples
    from .turns import TurnPrompts

    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    spans = [[(len(p), len(p) + len(r))] if r else [] for p, r in zip(prompts, responses)]
    tp = TurnPrompts(TokenTable(prompts))
    return dialogue_samples(tp, seqs, spans, [True] * len(seqs), max_length, too_long)


# do not change what is regenerated (the static decoder's options: the same greedy tokens)
_NOT_IN_FINGERPRINT = ("cache_dir", "pack_to", "regen_compact", "regen_compile", "regen_fuse")
# keys of conversation rows: they change nothing for the random and built-in sources (whose
# caches therefore keep their names)
_ROW_KEYS = ("format", "turns", "mix", "hf_split", "max_turns", "answers")
# added since caches were first named: in the key only when not at these defaults (older caches
# keep their names)
_KEYED_WHEN_SET = {"max_turns": None, "answers": "regenerate"}


def keyed_settings(settings: dict, skip: tuple, when_set: dict) -> dict:
    """The settings that name a cache: all but those in skip, and those in when_set only when
    not at the default given there (a key added after caches were named keeps their names)."""
    return {
        k: v
        for k, v in settings.items()
        if k not in skip and not (k in when_set and v == when_set[k])
    }


def data_fingerprint(
    dcfg: DataConfig, tcfg: TargetConfig, extra: str = "", legacy: bool = False
) -> str:
    """The data cache's name: every setting that changes the regenerated samples. legacy: the
    name before 2026-12-07, when the target's execution-only settings keyed it too (a cache of
    that name is still read: `dataset_path`)."""
    skip = _NOT_IN_FINGERPRINT + (
        _ROW_KEYS if dcfg.source in ("selfgen", "stdlib", "humaneval") else ()
    )
    not_target = ("device",) + (() if legacy else TARGET_EXECUTION_ONLY)
    # dtype "auto" named float32 and bfloat16 caches alike until 2026-12-07 (the legacy name)
    target_settings = vars(tcfg) if legacy else concrete_settings(tcfg)
    key = json.dumps(
        {
            "data": keyed_settings(vars(dcfg), skip, _KEYED_WHEN_SET),
            "target": {k: v for k, v in target_settings.items() if k not in not_target},
            "extra": extra,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cache_name(dcfg: DataConfig, tcfg: TargetConfig, legacy: bool = False) -> str:
    """The data cache's file name (`data_fingerprint`)."""
    return f"train-{data_fingerprint(dcfg, tcfg, legacy=legacy)}.pt"


def dataset_path(
    dcfg: DataConfig, tcfg: TargetConfig, cache_dir: str, log=None, also: tuple[str, ...] = ()
) -> str:
    """The data cache of these settings in cache_dir. Where there is none under the current name,
    the first begun of: the name before 2026-12-07 (`data_fingerprint(legacy=True)`), then the
    file names in `also` (a resumed run's own cache, made under kernels it has since changed:
    dflash.train.build.own_data_file). So a resumed run keeps its data."""
    path = os.path.join(cache_dir, cache_name(dcfg, tcfg))
    if _begun(path):
        return path
    old = os.path.join(cache_dir, cache_name(dcfg, tcfg, legacy=True))
    if _begun(old):
        if log:
            log(f"data: the cache under its earlier name {old} (same settings)")
        return old
    for own in (os.path.join(cache_dir, name) for name in also):
        if os.path.exists(own):  # complete: the run trained on it
            if log:
                log(
                    f"data: the run's own cache {own} (this resume changed the target's kernels, "
                    "which name the cache; the run goes on with the data it trained on)"
                )
            return own
    return path


def _begun(path: str) -> bool:
    """A data cache written or being written (a regeneration's .partial files) at path."""
    return os.path.exists(path) or bool(glob.glob(glob.escape(path) + ".*partial"))


def load_or_build_dataset(
    dcfg: DataConfig, tcfg: TargetConfig, target, cache_dir: str, log=print, also=()
) -> list[Sample]:
    """Prompts -> the target's own responses -> samples; cached by a fingerprint of the configs
    (also: more cache names to read, `dataset_path`)."""
    from .corpora import check_training_sources

    check_training_sources(dcfg)
    path = dataset_path(dcfg, tcfg, cache_dir, log, also)
    try:
        if os.path.exists(path):
            samples = load_samples(path)
            log(f"data: {len(samples)} samples from cache {path}")
            _log_mix(samples, dcfg, log)
            return samples
        return regenerate_dataset(dcfg, tcfg, target, path, log)
    finally:
        drop_held_reads()  # a cached dataset never takes preflight's read


def regenerate_dataset(
    dcfg: DataConfig, tcfg: TargetConfig, target, path: str, log=print
) -> list[Sample]:
    """Regenerate responses with the target and write the samples to `path` (resumable through
    `path + '.partial'`; the later turns of conversations through `path + '.turnK.partial'`)."""
    from .corpora import check_training_sources
    from .rounds import regenerate_turns, turn_prompts

    check_training_sources(dcfg)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    t0 = time.perf_counter()
    tp = turn_prompts(dcfg, tcfg, target, log)
    t_prompts = time.perf_counter() - t0
    if not len(tp):
        raise ValueError(
            f"the dataset is empty: every prompt has >= data.max_length={dcfg.max_length} "
            "tokens; raise data.max_length or use shorter prompts"
        )
    turns = tp.stats.get("turns", len(tp))
    given = int(tp.given_mask().sum())
    if given:
        log(
            f"data: {given} of {len(tp)} conversations answered by their rows' own assistant "
            "turns (data.answers=given: taken as the target's greedy answers; "
            "train/greedy_agreement measures how many of their tokens are)"
        )
    if given < len(tp):
        log(
            f"data: regenerating {len(tp) - given} responses (source {dcfg.source}, up to "
            f"{dcfg.response_len} tokens each, chat_template={tcfg.chat_template}, "
            f"enable_thinking={tcfg.enable_thinking}; prompts built and tokenized in "
            f"{t_prompts:.1f} s)"
            + (
                f"; {turns} user turns answered in order (data.turns=all)"
                if turns > len(tp)
                else ""
            )
        )
    samples, stats, partials = regenerate_turns(dcfg, target, tp, path, generate_greedy, log)
    how = "regenerated by the target" if not given else "(the rows' answers or the target's)"
    log(f"data: {len(samples)} samples {how} ({_fmt_stats(stats)})")
    _log_mix(samples, dcfg, log)
    # The drafter's mask token should never be text: a real tokenizer's mask/reserved token
    # never is, but a random target can emit any id.
    n_mask = sum(bool((s.input_ids == target.mask_token_id).any()) for s in samples)
    if n_mask:
        log(
            f"data: {n_mask} samples contain the drafter's mask token id {target.mask_token_id} "
            "in their text (expected from a random target; with a real target, pick a "
            "target.mask_token_id that never occurs in text)"
        )
    atomic_torch_save(pack_samples(samples), path)
    for partial in partials:
        ResponseShards(partial).remove()
    return samples


def _log_mix(samples: list[Sample], dcfg: DataConfig, log) -> None:
    if dcfg.mix:
        from .mix import mix_line, mix_report

        log(mix_line(mix_report(samples, dcfg)))


def _fmt_stats(stats: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.items())


def load_samples(path: str) -> list[Sample]:
    try:
        return unpack_samples(torch.load(path))
    except Exception as e:  # truncated zip, pickle garbage, wrong contents: torch raises many
        raise ValueError(
            f"the data cache {path} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:120]}"
            "); delete it and start again: the target regenerates it"
        ) from None
