"""Real greedy speculative decoding beside the offline figures (eval.py,
`eval.real_decode_prompts=N`): speed and exactness on the first N eval prompts.

Each method decodes every prompt for as many tokens as its cached greedy completion:
`generate_ar` (the baseline), `generate_chain` and `generate_tree` at each of
`eval.decode_tree_budgets`. Each method is warmed up once (a short decode of the first prompt,
so that lazy kernel binding, allocator growth and autotuning are not timed), then timed over
all N prompts as one span (device synchronized before and after; prefill included).

Summary keys (flat, numbers only), m in {chain, tree@b}:
  decode_new_tokens            tokens asked for (sum of the cached completion lengths)
  decode_tokens_per_s_{ar,m}   generated tokens / wall seconds over the N prompts
  decode_speedup_{m}           tokens/s over AR's
  decode_tau_{m}               1 + accepted drafts per verify round, micro-averaged over rounds
  decode_offline_tau_{m}       the offline walk's tau (chain) / tau@b (tree) on the same prompts
  decode_rounds_{m}            verify rounds
  decode_identical_{m}         prompts whose output is token-identical to AR's
  decode_ar_matches_cache      prompts where AR reproduces the cached greedy completion

At float32 the real and offline figures are equal and every output is AR's. In bf16 a near-tie
of the target's top-2 logits can flip one token between a B-token verify (or a masked tree
forward) and AR's one-token forwards; from there the texts part. Every such prompt is logged
with its first differing position, and counted out of decode_identical_*; the offline walk
follows the cached completion, so its tau can then differ from the real one.
"""

from __future__ import annotations

import math
import re
import time

import torch

from ..decoding import generate_ar, generate_chain, generate_tree
from ..decoding.steps import sync

WARMUP_TOKENS = 8
SPEED_KEY = re.compile(
    r"decode_((tokens_per_s|speedup|tau|offline_tau|rounds|identical)_(ar|chain|tree@\d+)"
    r"|new_tokens|ar_matches_cache)$"
)


def first_diff(a: list, b: list) -> int | None:
    """First position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _methods(target, drafter, budgets) -> dict:
    out = {
        "ar": lambda p, n: generate_ar(target, p, n),
        "chain": lambda p, n: generate_chain(target, drafter, p, n),
    }
    for b in budgets:
        out[f"tree@{b}"] = lambda p, n, b=b: generate_tree(target, drafter, p, n, b)
    return out


@torch.no_grad()
def greedy_report(target, drafter, items, budgets, offline: dict, log=print) -> dict:
    """Decode `items` (already the first N) greedily with every method; see the module
    docstring for the keys. offline: `evaluate`'s summary on the same items (tau, tau@b)."""
    if not items:
        return {}
    dev = target.device
    jobs = [(it.prompt_ids.tolist(), len(it.completion_ids)) for it in items]
    out: dict = {"decode_new_tokens": sum(n for _, n in jobs)}
    results, tps = {}, {}
    for name, fn in _methods(target, drafter, [int(b) for b in budgets]).items():
        fn(jobs[0][0], min(WARMUP_TOKENS, jobs[0][1]))  # warm-up, not timed
        sync(dev)
        t0 = time.perf_counter()
        results[name] = [fn(p, n) for p, n in jobs]
        sync(dev)
        wall = time.perf_counter() - t0
        tps[name] = sum(len(r.tokens) for r in results[name]) / wall
        out[f"decode_tokens_per_s_{name}"] = tps[name]
    ar = [r.tokens for r in results["ar"]]
    same = 0
    for i, (it, toks) in enumerate(zip(items, ar)):
        pos = first_diff(toks, it.completion_ids.tolist())
        same += pos is None
        if pos is not None:
            log(f"decode: prompt {i}: AR differs from the cached greedy completion at token {pos}")
    out["decode_ar_matches_cache"] = same
    for name, res in results.items():
        if name == "ar":
            continue
        accepted = [a for r in res for a in r.accepted]
        out[f"decode_speedup_{name}"] = tps[name] / tps["ar"]
        out[f"decode_tau_{name}"] = 1.0 + sum(accepted) / len(accepted) if accepted else math.nan
        key = "tau" if name == "chain" else "tau@" + name.split("@")[1]
        out[f"decode_offline_tau_{name}"] = offline.get(key, math.nan)
        out[f"decode_rounds_{name}"] = len(accepted)
        same = 0
        for i, (r, want) in enumerate(zip(res, ar)):
            pos = first_diff(r.tokens, want)
            same += pos is None
            if pos is not None:
                got = r.tokens[pos] if pos < len(r.tokens) else "end"
                ref = want[pos] if pos < len(want) else "end"
                log(
                    f"decode: prompt {i}: {name} differs from AR at token {pos} of {len(want)} "
                    f"({got} vs AR {ref}; a near-tie in bf16, or a decoding bug at float32)"
                )
        out[f"decode_identical_{name}"] = same
    return out


def is_speed_key(key: str) -> bool:
    return SPEED_KEY.match(key) is not None


def speed_table(summary: dict):
    """The greedy figures as one rich table (None without them)."""
    if "decode_tokens_per_s_ar" not in summary:
        return None
    from rich.table import Table

    n = summary.get("decode_prompts", "?")
    names = ["ar"] + [
        k.removeprefix("decode_tokens_per_s_")
        for k in summary
        if k.startswith("decode_tokens_per_s_") and not k.endswith("_ar")
    ]
    t = Table(
        title=f"real greedy decoding, first {n} prompts, "
        f"{summary.get('decode_new_tokens', '?')} new tokens",
        caption=f"AR == cached greedy completion on {summary.get('decode_ar_matches_cache')}/{n}",
    )
    for col in ("method", "tok/s", "vs AR", "tau", "offline tau", "rounds", "== AR"):
        t.add_column(col, justify="left" if col == "method" else "right")

    def f(key, fmt="{:.2f}"):
        v = summary.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    for m in names:
        ident = summary.get(f"decode_identical_{m}")
        t.add_row(
            m,
            f(f"decode_tokens_per_s_{m}", "{:.1f}"),
            "1.00x" if m == "ar" else f(f"decode_speedup_{m}", "{:.2f}x"),
            f(f"decode_tau_{m}", "{:.3f}"),
            f(f"decode_offline_tau_{m}", "{:.3f}"),
            f(f"decode_rounds_{m}", "{}"),
            "-" if ident is None else f"{ident}/{n}",
        )
    return t
