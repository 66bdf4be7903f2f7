"""Real sampled decoding beside the offline figures (eval.py, `eval.real_decode_prompts=N`).

For the first N eval prompts and each of eval.temperatures: chain speculative decoding with
rejection sampling (`dflash.decoding.sample_chain`, seeded by eval.seed + prompt index) for as
many tokens as the prompt's cached greedy completion, and its tau (1 + accepted drafts per
verify round, micro-averaged over rounds) as `decode_tau_t{T}`; next to it the offline expected
`tau_t{T}` on the same N prompts as `decode_offline_tau_t{T}`. At T=0 the two are equal (the
offline walk is exact for greedy decoding); at T>0 the offline figure takes the target's
distributions along the greedy completion, the real one along the sampled text.
"""

from __future__ import annotations

import math

import torch

from .decoding import Sampling, sample_chain
from .evaluation import EvalItem, evaluate
from .shape import Heads


@torch.no_grad()
def decode_report(target, drafter, items: list[EvalItem], n: int, ecfg) -> dict:
    items = items[:n]
    temps = [float(t) for t in ecfg.temperatures]
    out: dict = {"decode_prompts": len(items)}
    heads = Heads(target.embed_tokens, target.lm_head)
    _, offline = evaluate(
        drafter, heads, items, [], temperatures=temps, top_p=ecfg.top_p, top_k=ecfg.top_k
    )
    for t in temps:
        accepted, tokens = [], 0
        for i, it in enumerate(items):
            s = Sampling(t, ecfg.top_p, ecfg.top_k, seed=ecfg.seed + i)
            res = sample_chain(target, drafter, it.prompt_ids.tolist(), len(it.completion_ids), s)
            accepted += res.accepted
            tokens += len(res.tokens)
        tau = 1.0 + sum(accepted) / len(accepted) if accepted else math.nan
        out[f"decode_tau_t{t:g}"] = tau
        out[f"decode_offline_tau_t{t:g}"] = offline[f"tau_t{t:g}"]
        out[f"decode_rounds_t{t:g}"] = len(accepted)
    return out
