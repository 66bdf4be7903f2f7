"""Sampled decoding (temperature, top-p, top-k) as the reference's generation samples: the AR
baseline and chain speculative decoding with rejection sampling on the drafted block.

Target and drafter logits go through the same `dflash.decoding.rejection.warp`. Each round the D draft
tokens are sampled from the drafter's warped q_1..q_D (all D from one drafter pass, as DFlash
drafts; a DFlash2 drafter samples its selector's path, q_i being the row each step was drawn
from), the block [bonus, drafts] is verified in one target forward giving p_0..p_D, and
`rejection_sample_block` accepts a leading run of drafts and emits the next token (resampled
from max(p - q, 0) at the first rejection, else the bonus from p_D). Every emitted token is then
distributed as plain sampling from the target would give it. One `torch.Generator` seeded by
`Sampling.seed` drives every draw, so a decode is reproducible.

At temperature 0 every distribution is the one-hot argmax: drafts are the drafter's argmax, a
draft is accepted iff it equals the target's argmax, the next token is the target's argmax, so
the output and the per-round acceptances are those of `generate_ar` / `generate_chain`
(tested). Cache rollback, the end-of-generation cap and `DecodeResult` are the chain's.

Legend: P prompt length, B block size, D = B-1 drafted positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .chain import ExactRollback, generate_ar, roll_back
from .rejection import rejection_sample_block, warp
from .steps import DecodeResult, SpecLoop, arange_row


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.temperature, self.top_p, self.top_k)

    def generator(self, device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)

    @property
    def tag(self) -> str:
        return f"t{self.temperature:g}"


def _draw(probs_V: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs_V, 1, generator=gen))


@torch.no_grad()
def sample_ar(
    target, prompt_ids, max_new_tokens: int, sampling: Sampling, eos_token_id: int | None = None
) -> DecodeResult:
    """Plain sampling from the target on the HF cache, one token per forward."""
    gen = sampling.generator(target.device)
    return generate_ar(
        target,
        prompt_ids,
        max_new_tokens,
        eos_token_id,
        pick=lambda logits_V: _draw(sampling.probs(logits_V), gen),
        mode=f"ar_{sampling.tag}",
    )


@torch.no_grad()
def sample_chain(
    target,
    drafter,
    prompt_ids,
    max_new_tokens: int,
    sampling: Sampling,
    *,
    eos_token_id: int | None = None,
    rollback: ExactRollback | None = None,
    draft_fn: Callable | None = None,
) -> DecodeResult:
    """Chain speculative decoding with rejection sampling; output distributed as `sample_ar`.

    By default the drafter's own rule drafts (`DrafterState.draft`: DFlash samples each
    position's warped q; DFlash2 samples the selector's path, q = its rows). draft_fn(drafter_state,
    start, bonus) -> logits [D, V], or (logits, tokens [D]) for a drafter that draws its own
    tokens (tests: a sequential oracle whose q is the target's p)."""
    rollback = rollback if rollback is not None else ExactRollback()
    gen = sampling.generator(target.device)
    loop = SpecLoop(target, drafter, prompt_ids, max_new_tokens, eos_token_id)
    run, cache, dev, B = loop.run, loop.cache, loop.dev, drafter.spec.block_size
    rollback.begin(cache)
    loop.prefill(
        f"chain_{sampling.tag}", lambda head: _draw(sampling.probs(head), gen), logits=True
    )
    while loop.going:
        bonus, start = loop.bonus, loop.start
        if draft_fn is None:  # the drafter's own rule and its proposal q
            draft, q = loop.ds.draft(start, bonus, sampling, gen)
            draft, q = draft.to(dev), q.to(dev)
        elif isinstance(drafted := draft_fn(loop.ds, start, bonus), tuple):
            q, draft = sampling.probs(drafted[0].to(dev)), drafted[1].to(dev)
        else:
            q = sampling.probs(drafted.to(dev))  # [D, V]
            draft = torch.multinomial(q, 1, generator=gen)[:, 0]
        block = torch.cat([torch.tensor([bonus], device=dev), draft])[None]
        snap = rollback.before_verify(cache)
        logits, aux = run(block, arange_row(start, B, dev), cache, logits=True)
        loop.res.verify_tokens += B
        acc, nxt = rejection_sample_block(sampling.probs(logits[0]), q, draft, gen)
        if acc > loop.cap:  # the last round: accepted drafts past the budget are not needed
            acc, nxt = loop.cap, int(draft[loop.cap])
        keep = acc + 1  # bonus + accepted drafts
        loop.res.verify_tokens += roll_back(rollback, run, cache, snap, block, start, keep)
        loop.res.drafts.append(draft.tolist())
        loop.commit(draft[:acc].tolist() + [nxt], aux[0, :keep])
    return loop.result()
