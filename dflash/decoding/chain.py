"""Greedy AR decoding (the baseline) and chain speculative decoding (z-lab `dflash_generate`).

Legend: P prompt length, B block size, D = B-1 drafted positions, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..target.cache import (
    cache_kw,
    crop_attention,
    is_hybrid_cache,
    new_cache,
    restore_linear_state,
    snapshot_linear_state,
)
from .steps import DecodeResult, SpecLoop, arange_row, as_prompt, leading_matches, sync


@torch.no_grad()
def generate_ar(
    target,
    prompt_ids,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    *,
    pick: Callable | None = None,
    mode: str = "ar",
) -> DecodeResult:
    """Plain greedy decoding on the HF cache, one token per forward. pick(logits [V]) -> the
    next token instead of the argmax (`sample_ar`: a draw from the warped distribution)."""
    model, dev = target.model, target.device
    pick = pick if pick is not None else (lambda logits_V: int(logits_V.argmax()))
    ids = as_prompt(target, prompt_ids)
    P = ids.shape[1]
    sync(dev)
    t0 = time.perf_counter()
    cache = new_cache(model)
    kw = cache_kw(model)
    logits = model(
        input_ids=ids,
        position_ids=arange_row(0, P, dev),
        use_cache=True,
        logits_to_keep=1,
        **{kw: cache},
    ).logits
    tok = pick(logits[0, -1])
    sync(dev)
    t_pre = time.perf_counter() - t0
    out = [tok]
    while len(out) < max_new_tokens and tok != eos_token_id:
        pos = P + len(out) - 1
        logits = model(
            input_ids=torch.tensor([[tok]], device=dev),
            position_ids=arange_row(pos, 1, dev),
            use_cache=True,
            **{kw: cache},
        ).logits
        tok = pick(logits[0, -1])
        out.append(tok)
    sync(dev)
    res = DecodeResult(mode, out[:max_new_tokens], wall_s=time.perf_counter() - t0, prefill_s=t_pre)
    res.verify_tokens = max(0, len(res.tokens) - 1)
    return res


class ExactRollback:
    """Rolls the target cache back to bonus + accepted drafts after a verify forward of B tokens.

    Attention layers are cropped. Linear-attention (Gated-DeltaNet) layers cannot be cropped, so
    their states are snapshotted before the verify forward and, on a partial acceptance,
    restored and advanced by re-running the kept tokens (one extra forward of `keep` tokens)."""

    def begin(self, cache) -> None:
        self.hybrid = is_hybrid_cache(cache)

    def before_verify(self, cache):
        return snapshot_linear_state(cache) if self.hybrid else None

    def rollback(self, cache, snap, B: int, keep: int, rerun: Callable[[], None]) -> int:
        """Returns the number of extra target tokens run."""
        if keep >= B:
            return 0
        if not self.hybrid:
            crop_attention(cache, B - keep)
            return 0
        restore_linear_state(cache, snap)
        crop_attention(cache, B)
        rerun()
        return keep


def roll_back(rollback, run, cache, snap, block, start: int, keep: int) -> int:
    """After the verify forward of `block` ([1, B] from position `start`): the cache back to its
    first `keep` tokens (bonus + accepted drafts). Returns the target tokens run again."""

    def rerun():
        pos = arange_row(start, keep, block.device)
        run(block[:, :keep], pos, cache, want_aux=False, last_only=True)

    return rollback.rollback(cache, snap, block.shape[1], keep, rerun)


@torch.no_grad()
def generate_chain(
    target,
    drafter,
    prompt_ids,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    rollback: ExactRollback | None = None,
    draft_fn: Callable | None = None,
) -> DecodeResult:
    """Chain speculative decoding; output identical to greedy.

    rollback: how the target cache returns to the accepted length (default `ExactRollback`).
    draft_fn(drafter_state, start, bonus) -> logits [D, V]: override for tests (drafts their
    argmax); by default the drafter's own rule drafts (`DrafterState.draft`).
    """
    rollback = rollback if rollback is not None else ExactRollback()
    loop = SpecLoop(target, drafter, prompt_ids, max_new_tokens, eos_token_id)
    run, cache, dev, B = loop.run, loop.cache, loop.dev, drafter.spec.block_size
    rollback.begin(cache)
    loop.prefill("chain", int)
    while loop.going:
        bonus, start = loop.bonus, loop.start
        if draft_fn is None:  # the drafter's own rule (DFlash2: the selector's path)
            draft = loop.ds.draft(start, bonus)[0].to(dev)  # [D]
        else:
            draft = draft_fn(loop.ds, start, bonus).argmax(-1).to(dev)
        block = torch.cat([torch.tensor([bonus], device=dev), draft])[None]
        snap = rollback.before_verify(cache)
        greedy, aux = run(block, arange_row(start, B, dev), cache)
        loop.res.verify_tokens += B
        tgt = greedy[0]  # [B]
        acc = min(leading_matches(draft, tgt[:-1]), loop.cap)
        keep = acc + 1  # bonus + accepted drafts
        loop.res.verify_tokens += roll_back(rollback, run, cache, snap, block, start, keep)
        loop.res.drafts.append(draft.tolist())
        loop.commit(draft[:acc].tolist() + [int(tgt[acc])], aux[0, :keep])
    return loop.result()
