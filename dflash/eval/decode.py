"""Real decoding beside the offline figures (eval.py, `eval.real_decode_prompts=N`).

Greedy (`dflash.eval.speed`): AR, chain and DDTree (`eval.decode_tree_budgets`) on the first
N eval prompts: tokens/s, speedup over AR, real vs offline tau, outputs identical to AR.

Sampled: for the first N eval prompts and each of eval.temperatures > 0, chain speculative
decoding with rejection sampling (`dflash.decoding.sample_chain`, seeded by eval.seed + prompt
index) for as many tokens as the prompt's cached greedy completion, and its tau (1 + accepted
drafts per verify round, micro-averaged over rounds) as `decode_tau_t{T}`; next to it the
offline `tau_t{T}` (upper estimate) and `tau_t{T}_lower` (lower bound) on the same N prompts as
`decode_offline_tau_t{T}` and `decode_offline_tau_t{T}_lower`. At T=0 sampled
decoding is greedy chain decoding (tests/test_sampled_decoding.py), so `decode_tau_t0` is the
greedy chain's `decode_tau_chain` (not decoded twice), equal to the offline tau (the offline walk
is exact for greedy decoding); at T>0 the offline figure takes the target's distributions along
the greedy completion, the real one along the sampled text.
"""

from __future__ import annotations

import math

import torch

from ..decoding import Sampling, sample_chain
from ..target.shape import Heads
from .greedy import EvalItem
from .offline import evaluate
from .speed import greedy_report


@torch.no_grad()
def decode_report(target, drafter, items: list[EvalItem], n: int, ecfg, log=print) -> dict:
    items = items[:n]
    temps = [float(t) for t in ecfg.temperatures]
    budgets = [int(b) for b in ecfg.decode_tree_budgets]
    out: dict = {"decode_prompts": len(items)}
    heads = Heads(target.embed_tokens, target.lm_head)
    _, offline = evaluate(
        drafter, heads, items, budgets, temperatures=temps, top_p=ecfg.top_p, top_k=ecfg.top_k
    )
    out.update(greedy_report(target, drafter, items, budgets, offline, log=log))
    for t in temps:
        if t == 0:
            out["decode_tau_t0"] = out["decode_tau_chain"]
            out["decode_rounds_t0"] = out["decode_rounds_chain"]
            out["decode_offline_tau_t0"] = offline["tau_t0"]
            continue
        accepted, tokens = [], 0
        for i, it in enumerate(items):
            s = Sampling(t, ecfg.top_p, ecfg.top_k, seed=ecfg.seed + i)
            res = sample_chain(target, drafter, it.prompt_ids.tolist(), len(it.completion_ids), s)
            accepted += res.accepted
            tokens += len(res.tokens)
        tau = 1.0 + sum(accepted) / len(accepted) if accepted else math.nan
        out[f"decode_tau_t{t:g}"] = tau
        out[f"decode_offline_tau_t{t:g}"] = offline[f"tau_t{t:g}"]  # upper estimate
        out[f"decode_offline_tau_t{t:g}_lower"] = offline[f"tau_t{t:g}_lower"]
        out[f"decode_rounds_t{t:g}"] = len(accepted)
    return out
