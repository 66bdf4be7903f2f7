"""Fused lm_head + weighted hard cross entropy: the gradient is formed in the forward pass.

Legend: M labelled positions, H hidden, V vocab, c rows per chunk.

The lm_head is frozen, so the only gradient the loss sends back is d loss / d h = (softmax -
onehot) * w @ W. Computing it chunk by chunk while the [c, V] logits are at hand means the logits
are never stored, never recomputed (no activation checkpoint) and never copied to float32: one
lm_head matmul forward, one for the gradient, and one fused pass over the bf16 logits (log-sum-
exp, target logit, argmax, softmax gradient) instead of the cast / log_softmax / NLL / argmax /
backward passes of the plain path. Same value as loss.weighted_ce_sum (tested on CPU).
"""

from __future__ import annotations

import functools

import torch


def _ce_stats(
    logits_cV: torch.Tensor,
    labels_c: torch.Tensor,
    weights_c: torch.Tensor,
    mult: float = 1.0,
    cap: float | None = None,
):
    """(weighted CE sum, weighted correct sum, d loss / d logits in the logits' dtype), with the
    drafter's logit transform (x mult, then cap * tanh(. / cap)) applied and differentiated."""
    x = logits_cV.float() * mult
    dxdl = mult
    if cap is not None:
        t = torch.tanh(x / cap)
        x, dxdl = t * cap, mult * (1 - t * t)
    lse = torch.logsumexp(x, dim=-1)
    tgt = x.gather(1, labels_c[:, None])[:, 0]
    loss = ((lse - tgt) * weights_c).sum()
    correct = ((x.argmax(-1) == labels_c).float() * weights_c).sum()
    p = torch.exp(x - lse[:, None])
    onehot = torch.zeros_like(p).scatter_(1, labels_c[:, None], 1.0)
    grad = ((p - onehot) * weights_c[:, None] * dxdl).to(logits_cV.dtype)
    return loss, correct, grad


def chunk_bounds(M: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of the chunks over M rows, none of them 1 row long when M >= 2: the compiled
    stats specialize a 1-row chunk and would recompile mid-run (seconds) the first time one turns
    up, when M % chunk == 1. The last chunk then takes one row from the one before."""
    bounds = [(i, min(i + chunk, M)) for i in range(0, M, chunk)]
    if len(bounds) >= 2 and bounds[-1][1] - bounds[-1][0] == 1 and chunk >= 3:
        (a, _), (_, e) = bounds[-2], bounds[-1]
        bounds[-2:] = [(a, e - 2), (e - 2, e)]
    return bounds


@functools.cache
def _compiled_stats():
    return torch.compile(_ce_stats, dynamic=True)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_MH, w_VH, b_V, labels_M, weights_M, chunk: int, dtype, mult, cap):
        stats = _compiled_stats() if h_MH.is_cuda else _ce_stats
        need_grad = ctx.needs_input_grad[0]
        single = h_MH.shape[0] == 1
        if single:  # one row: a zero-weight copy as a second keeps the compiled shape general
            h_MH, labels_M = torch.cat([h_MH, h_MH]), torch.cat([labels_M, labels_M])
            weights_M = torch.cat([weights_M, torch.zeros_like(weights_M)])
        grad_h = torch.empty_like(h_MH) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=h_MH.device)
        correct = torch.zeros((), dtype=torch.float32, device=h_MH.device)
        w = w_VH.to(dtype)  # a no-op for a bf16 lm_head under bf16 compute
        b = b_V.to(dtype) if b_V is not None else None
        with torch.autocast(h_MH.device.type, enabled=False):
            for i, j in chunk_bounds(h_MH.shape[0], chunk):
                logits = h_MH[i:j].to(dtype) @ w.t()
                if b is not None:
                    logits = logits + b
                l, c, g = stats(logits, labels_M[i:j], weights_M[i:j].float(), mult, cap)
                loss += l
                correct += c
                if need_grad:
                    grad_h[i:j] = g @ w
        if need_grad and single:
            grad_h = grad_h[:1]
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), None, None, None, None, None, None, None, None


def fused_weighted_ce_sum(
    h_MH: torch.Tensor,
    lm_head_w_VH: torch.Tensor,
    labels_M: torch.Tensor,
    weights_M: torch.Tensor,
    *,
    chunk: int = 4096,
    dtype: torch.dtype | None = None,
    output_multiplier: float = 1.0,
    softcap: float | None = None,
    lm_head_b_V: torch.Tensor | None = None,
):
    """(loss_sum, weighted_correct_sum) as loss.weighted_ce_sum with the drafter's
    logit_transform (output_multiplier, final_logit_softcapping) and the head's bias, the
    matmuls in `dtype` (default: the lm_head's). The frozen lm_head gets no gradient."""
    dtype = dtype or lm_head_w_VH.dtype
    cap = float(softcap) if softcap else None
    return _FusedLinearCE.apply(
        h_MH,
        lm_head_w_VH.detach(),
        lm_head_b_V.detach() if lm_head_b_V is not None else None,
        labels_M,
        weights_M,
        chunk,
        dtype,
        float(output_multiplier),
        cap,
    )
