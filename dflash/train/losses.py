"""Losses: pure functions returning (weighted sum, weight sum).

The caller divides by the GLOBAL weight sum (over micro-batches and data-parallel ranks), so
gradient accumulation and data parallelism give the gradient of one big batch.
Legend: M labelled positions, H hidden, V vocab, B block size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


def head_logits(h_MH, w_VH, logit_transform=None, b_V=None):
    """fp32 logits through the frozen head (and its bias b_V, if any) in the head's own dtype:
    the hidden chunk is cast, never the [V, H] weight (a bf16 27B head is 2.5 GB; an fp32 copy
    per micro-batch is 5 GB)."""
    logits = h_MH.to(w_VH.dtype) @ w_VH.t()
    logits = (logits + b_V if b_V is not None else logits).float()
    return logit_transform(logits) if logit_transform is not None else logits


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
