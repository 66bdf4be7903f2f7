"""Losses: pure functions returning (weighted sum, weight sum).

The caller divides by the GLOBAL weight sum (over micro-batches and data-parallel ranks), so
gradient accumulation and data parallelism give the gradient of one big batch.
Legend: M labelled positions, H hidden, V vocab, B block size, n blocks, K = B-1 drafted
positions (or selector candidates in `ce_selection_sum`), A anchors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..drafter.model import head_logits

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size in DEFAULT_GAMMA:
        return DEFAULT_GAMMA[block_size]
    return max(1.0, 7.0 * (block_size - 1) / 15.0)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    g = default_gamma(block_size) if gamma is None else float(gamma)
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / g)


def prefix_position_weights(prefix_NA: torch.Tensor, block_size: int, gamma: float | None = None):
    """train.loss=variable_prefix: w_k = exp(-(k-l)/gamma) for block positions k >= l (the
    decay re-anchored at the visible prefix of length l), 0 before it. [N, A, B-1]."""
    g = default_gamma(block_size) if gamma is None else float(gamma)
    k = torch.arange(1, block_size, device=prefix_NA.device, dtype=torch.float32)
    ahead = k - prefix_NA[..., None].float()
    return torch.exp(-ahead.clamp(min=0) / g) * (ahead >= 0)


def dpace_weights(ce_nK: torch.Tensor, valid_nK: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [n, K] of each block's drafted positions (no gradient).

    With q_k = exp(-CE_k) the drafter's probability of the target's token at position k and
    s_k = (1 - alpha) q_k + alpha (smoothed; 1 where the position has no label), the expected
    accepted length surrogate is E = sum_t prod_{j<=t} s_j, and w_k = sum_{t>=k, t valid}
    prod_{j<=t} s_j = dE / d log s_k: each position weighs what the positions after it stand to
    gain from it. Definition: vLLM speculators, src/speculators/losses/utils.py
    (`dpace_loss_decay`); paper arXiv 2605.18810."""
    with torch.no_grad():
        valid = valid_nK.float()
        smooth = (1.0 - alpha) * torch.exp(-ce_nK.float()) + alpha
        smooth = torch.where(valid > 0, smooth, torch.ones_like(smooth))
        reach = torch.cumprod(smooth, dim=-1) * valid
        return reach.flip(-1).cumsum(-1).flip(-1) * valid


def _ce_chunk(h_MH, w_VH, labels_M, weights_M, logit_transform=None, b_V=None):
    logits = head_logits(h_MH, w_VH, logit_transform, b_V)
    ce = F.cross_entropy(logits, labels_M, reduction="none")
    correct = (logits.argmax(-1) == labels_M).float()
    return (ce * weights_M).sum(), (correct * weights_M).sum().detach()


def weighted_ce_sum(
    h_MH: torch.Tensor,
    lm_head_w_VH: torch.Tensor,
    labels_M: torch.Tensor,
    weights_M: torch.Tensor,
    *,
    chunk: int = 4096,
    logit_transform=None,
    lm_head_b_V: torch.Tensor | None = None,
):
    """Hard CE against the target's greedy tokens, weighted, summed. The [M, V] logits are built
    chunk by chunk under activation checkpointing, so peak memory is one chunk of logits.
    logit_transform: the drafter's (output multiplier, softcapping) on fp32 logits;
    lm_head_b_V: the head's bias (None: it has none).
    Returns (loss_sum, weighted_correct_sum). With M = 0 the sum is a zero that is still
    connected to h's graph, so backward (and a DDP all-reduce) runs like any other micro-batch."""
    loss = _graph_zero(h_MH)
    correct = torch.zeros((), dtype=torch.float32, device=h_MH.device)
    for i in range(0, h_MH.shape[0], chunk):
        args = (
            h_MH[i : i + chunk],
            lm_head_w_VH,
            labels_M[i : i + chunk],
            weights_M[i : i + chunk],
            logit_transform,
            lm_head_b_V,
        )
        if torch.is_grad_enabled() and h_MH.requires_grad:
            l, c = checkpoint(_ce_chunk, *args, use_reentrant=False)
        else:
            l, c = _ce_chunk(*args)
        loss = loss + l
        correct = correct + c
    return loss, correct


def _ce_hits_chunk(h_MH, w_VH, labels_M, logit_transform=None, b_V=None):
    logits = head_logits(h_MH, w_VH, logit_transform, b_V)
    ce = F.cross_entropy(logits, labels_M, reduction="none")
    return ce, (logits.argmax(-1) == labels_M).float().detach()


def ce_per_position(
    h_MH: torch.Tensor,
    lm_head_w_VH: torch.Tensor,
    labels_M: torch.Tensor,
    *,
    chunk: int = 4096,
    logit_transform=None,
    lm_head_b_V: torch.Tensor | None = None,
):
    """Per-position CE [M] on h's graph and whether the argmax hits the label [M] (no graph),
    from one checkpointed pass of the head per chunk: a loss whose weights depend on the CE of
    other chunks' positions (D-PACE's, per block) weighs these afterwards instead of building
    the [M, V] logits once for the weights and again for the loss. With M = 0 the CE is an
    empty tensor still connected to h's graph."""
    if h_MH.shape[0] == 0:
        return h_MH.new_zeros(0, dtype=torch.float32) + _graph_zero(h_MH), h_MH.new_zeros(0)
    ces, hits = [], []
    for i in range(0, h_MH.shape[0], chunk):
        args = (h_MH[i : i + chunk], lm_head_w_VH, labels_M[i : i + chunk])
        args += (logit_transform, lm_head_b_V)
        if torch.is_grad_enabled() and h_MH.requires_grad:
            ce, hit = checkpoint(_ce_hits_chunk, *args, use_reentrant=False)
        else:
            ce, hit = _ce_hits_chunk(*args)
        ces.append(ce)
        hits.append(hit)
    return torch.cat(ces), torch.cat(hits)


def _ce_topk_chunk(h_MH, w_VH, labels_M, weights_M, correct_weights_M, candidates, transform, b_V):
    logits = head_logits(h_MH, w_VH, transform, b_V)
    ce = F.cross_entropy(logits, labels_M, reduction="none")
    correct = ((logits.argmax(-1) == labels_M).float() * correct_weights_M).sum().detach()
    unary, cand = candidates(logits)  # the selector's own top-K rule, as decoding drafts
    return (ce * weights_M).sum(), correct, unary, cand


def ce_selection_sum(
    h_MH: torch.Tensor,
    lm_head_w_VH: torch.Tensor,
    labels_M: torch.Tensor,
    weights_M: torch.Tensor,
    prev_M: torch.Tensor,
    selector,
    *,
    selection_weight: float,
    chunk: int = 4096,
    logit_transform=None,
    lm_head_b_V: torch.Tensor | None = None,
    correct_weights_M: torch.Tensor | None = None,
):
    """DFlash2's objective: the block CE of `weighted_ce_sum` plus selection_weight x the
    selector's CE among each position's top-K candidates, from one [chunk, V] logits per chunk.

    The selection term at a labelled position: scores = selector(h, top-K logits, candidates,
    prev) with prev the token before the position on the path that the chain would still be
    verifying there (the anchor, or the target's greedy token of the previous position: a
    position counts at T=0 only when every earlier drafted token matched it, so this teacher
    forcing is exact), and the loss is -log softmax(scores)[target's token]. It is the negative
    log likelihood of the reference's sampled proposal at T=1 and trains its T=0 argmax alike.
    Where the target's token is not among the candidates the selector cannot draft it: the
    position adds no selection term (the block CE is what brings the token into the top-K).
    Gradients reach the selector, the drafter (through h and the top-K logits) and nothing else.
    Same weights as the block CE, so the caller divides both by one global weight sum.
    Returns (loss_sum, weighted_correct_sum) as `weighted_ce_sum`."""
    loss = _graph_zero(h_MH)
    correct = torch.zeros((), dtype=torch.float32, device=h_MH.device)
    cw_M = weights_M if correct_weights_M is None else correct_weights_M
    # M = 0 still runs one empty chunk: the selector's weights then get (zero) gradients too,
    # so data-parallel peers reduce the same parameters
    for i in range(0, max(h_MH.shape[0], 1), chunk):
        sl = slice(i, i + chunk)
        args = (h_MH[sl], lm_head_w_VH, labels_M[sl], weights_M[sl], cw_M[sl])
        args += (selector.candidates,)
        if torch.is_grad_enabled() and h_MH.requires_grad:
            ce, c, unary, cand = checkpoint(
                _ce_topk_chunk, *args, logit_transform, lm_head_b_V, use_reentrant=False
            )
        else:
            ce, c, unary, cand = _ce_topk_chunk(*args, logit_transform, lm_head_b_V)
        sel = selection_sum(
            selector, h_MH[sl], unary, cand, labels_M[sl], prev_M[sl], weights_M[sl]
        )
        loss = loss + ce + selection_weight * sel
        correct = correct + c
    return loss, correct


def selection_sum(selector, h_MH, unary_MK, cand_MK, labels_M, prev_M, weights_M):
    """The selector's weighted CE among each position's top-K candidates (`ce_selection_sum`
    says what it teaches): -log softmax(scores)[the target's token], 0 where that token is not a
    candidate. unary_MK / cand_MK: the top-K (transformed) logits and their token ids."""
    scores = selector(h_MH, unary_MK, cand_MK, prev_M).float()
    hit = cand_MK == labels_M[:, None]
    sel = F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")
    return (sel * hit.any(-1) * weights_M).sum()


def _graph_zero(h: torch.Tensor) -> torch.Tensor:
    return h.sum().float() * 0.0 if h.requires_grad else h.new_zeros((), dtype=torch.float32)


def soft_kl_sum(
    h_MH: torch.Tensor,
    lm_head_w_VH: torch.Tensor,
    target_h_MH: torch.Tensor,
    weights_M: torch.Tensor,
    *,
    chunk: int = 4096,
    logit_transform=None,
    lm_head_b_V: torch.Tensor | None = None,
):
    """KL(target || drafter) weighted sum; only reachable with train.allow_soft_loss=true.
    Target logits come from the clean final hidden state through the same frozen lm_head
    (the drafter's logit transform applies to the drafter's side only)."""
    loss = _graph_zero(h_MH)
    for i in range(0, h_MH.shape[0], chunk):

        def f(h, th, w):
            lp = F.log_softmax(head_logits(h, lm_head_w_VH, logit_transform, lm_head_b_V), -1)
            tp = F.log_softmax(head_logits(th, lm_head_w_VH, None, lm_head_b_V), -1)
            return (F.kl_div(lp, tp, log_target=True, reduction="none").sum(-1) * w).sum()

        args = (h_MH[i : i + chunk], target_h_MH[i : i + chunk], weights_M[i : i + chunk])
        loss = loss + (
            checkpoint(f, *args, use_reentrant=False) if h_MH.requires_grad else f(*args)
        )
    return loss


def cosine_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, cosine to min_ratio at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    return cosine_decay((step - warmup) / max(1, total - warmup), min_ratio)


def cosine_decay(progress: float, min_ratio: float) -> float:
    """1 at progress 0, cosine down to min_ratio at progress >= 1."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
