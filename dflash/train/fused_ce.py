"""Fused lm_head + weighted hard cross entropy: the gradient is formed in the forward pass.

Legend: M labelled positions, H hidden, V vocab, c rows per chunk.

The lm_head is frozen, so the only gradient the loss sends back is d loss / d h = (softmax -
onehot) * w @ W. Computing it chunk by chunk while the [c, V] logits are at hand means the logits
are never stored, never recomputed (no activation checkpoint) and never copied to float32: one
lm_head matmul forward, one for the gradient, and one fused pass over the bf16 logits (log-sum-
exp, target logit, argmax, softmax gradient) instead of the cast / log_softmax / NLL / argmax /
backward passes of the plain path. Same value as loss.weighted_ce_sum (tested on CPU).

DFlash2 (`fused_ce_selection_sum`): the same pass also takes each row's top-K logits for the
selector (`tiled_topk` over the bf16 logits, the transform applied to the K values only). The
selector's term sends back K values per row, whose gradient w.r.t. h is K gathered rows of the
head; the plain path (`losses.ce_selection_sum`) keeps [c, V] float32 logits, recomputes them in
backward and scatters the K values' gradient into a dense [c, V] one.

`tiles=True` (`train.fused_head=tiles`) forms the CE stats tile by tile (`_ce_stats_tiled`):
one pass over each T-column tile gives its raw max, max, sum of exp and argmax, the rows combine
the [c, n] tile figures, and `tiled_topk` takes the raw tile maxima from that pass instead of
reading the logits once more for them.
"""

from __future__ import annotations

import functools

import torch

from ..drafter.topk import TILE, tiled_topk
from .losses import selection_sum


def _transformed(raw: torch.Tensor, mult: float, cap: float | None):
    """(x, d x / d raw): the drafter's logit transform (x mult, then cap * tanh(. / cap)) in
    float32."""
    x = raw.float() * mult
    if cap is None:
        return x, mult
    t = torch.tanh(x / cap)
    return t * cap, mult * (1 - t * t)


def _ce_stats(
    logits_cV: torch.Tensor,
    labels_c: torch.Tensor,
    weights_c: torch.Tensor,
    correct_weights_c: torch.Tensor,
    mult: float = 1.0,
    cap: float | None = None,
):
    """(weighted CE sum, weighted correct sum, d loss / d logits in the logits' dtype), with the
    drafter's logit transform (x mult, then cap * tanh(. / cap)) applied and differentiated."""
    x, dxdl = _transformed(logits_cV, mult, cap)
    lse = torch.logsumexp(x, dim=-1)
    tgt = x.gather(1, labels_c[:, None])[:, 0]
    loss = ((lse - tgt) * weights_c).sum()
    correct = ((x.argmax(-1) == labels_c).float() * correct_weights_c).sum()
    p = torch.exp(x - lse[:, None])
    onehot = torch.zeros_like(p).scatter_(1, labels_c[:, None], 1.0)
    grad = ((p - onehot) * weights_c[:, None] * dxdl).to(logits_cV.dtype)
    return loss, correct, grad


def _ce_stats_tiled(
    logits_cV: torch.Tensor,
    labels_c: torch.Tensor,
    weights_c: torch.Tensor,
    correct_weights_c: torch.Tensor,
    mult: float = 1.0,
    cap: float | None = None,
    tile: int | None = None,
):
    """`_ce_stats` (V a multiple of `tile`) with the row reductions done tile by tile, plus the
    raw logits' tile maxima [c, n] for `tiled_topk`. One reduction over each tile's T values gives
    its raw max, max m, sum of exp(x - m) and argmax; the row's log-sum-exp is M + log sum_t s_t
    exp(m_t - M) with M = max_t m_t, its argmax the first tile holding M (then the first column
    in it, as torch.argmax's first maximum). The gradient is formed over the flat [c, V] logits.
    Compiled, `tile` stays the default, this module's TILE (a constant: a traced tile width
    would turn every index of the flat pass into a division)."""
    tile = tile or TILE
    c, V = logits_cV.shape
    raw_max = logits_cV.view(c, V // tile, tile).amax(-1)
    x, dxdl = _transformed(logits_cV, mult, cap)
    x3 = x.view(c, V // tile, tile)
    m, _ = _transformed(raw_max, mult, cap)  # [c, n]: the transform is increasing
    # a tile of -inf only (a masked block of padded vocabulary) adds nothing: shifted by 0, not
    # by its own -inf (-inf - -inf is NaN), its sum of exp is 0
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x3 - shift[..., None]).sum(-1)
    col = x3.argmax(-1)
    top = m.amax(-1)  # [c]
    lse = top + torch.log((s * torch.exp(shift - top[:, None])).sum(-1))
    best = m.argmax(-1)
    arg = best * tile + col.gather(1, best[:, None])[:, 0]
    tgt = x.gather(1, labels_c[:, None])[:, 0]
    loss = ((lse - tgt) * weights_c).sum()
    correct = ((arg == labels_c).float() * correct_weights_c).sum()
    onehot = torch.arange(V, device=x.device) == labels_c[:, None]
    grad = ((torch.exp(x - lse[:, None]) - onehot.float()) * weights_c[:, None] * dxdl).to(
        logits_cV.dtype
    )
    return loss, correct, grad, raw_max


def _top_k(
    logits_cV: torch.Tensor,
    k: int,
    mult: float,
    cap: float | None,
    tile_max: torch.Tensor | None = None,
):
    """The top-k of the transformed logits: (values [c, k] fp32, token ids [c, k], d value /
    d logit [c, k]). The transform is increasing, so the raw logits' top-k are its top-k.
    `tile_max`: the raw logits' tile maxima, where the CE stats formed them."""
    v, idx = tiled_topk(logits_cV, k, tile=TILE, tile_max=tile_max)
    x, slope = _transformed(v, mult, cap)
    return x, idx, torch.full_like(x, mult) if cap is None else slope


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
def _compiled(stats):
    return torch.compile(stats, dynamic=True)


def uses_tiles(V: int, k: int, tiles: bool) -> bool:
    """Whether the fused head forms its CE stats tile by tile: asked for (`tiles`), DFlash2's
    top-k wanted (k > 0: the tile maxima are what the tiles buy) and a vocabulary `tiled_topk`
    cuts into tiles."""
    return tiles and k > 0 and V % TILE == 0 and V // TILE >= 4 * k


class _FusedLinearCE(torch.autograd.Function):
    """(loss, correct) and, with top_k > 0, each row's top-k transformed logits (differentiable)
    and their token ids: DFlash2's selector reads them from the same [c, V] logits."""

    @staticmethod
    def forward(
        ctx, h_MH, w_VH, b_V, labels_M, weights_M, correct_w_M, chunk, dtype, mult, cap, k, tiles
    ):
        stats = _ce_stats_tiled if uses_tiles(w_VH.shape[0], k, tiles) else _ce_stats
        stats = _compiled(stats) if h_MH.is_cuda else stats  # eager on CPU
        need_grad = ctx.needs_input_grad[0]
        single = h_MH.shape[0] == 1
        if single:  # one row: a zero-weight copy as a second keeps the compiled shape general
            h_MH, labels_M = torch.cat([h_MH, h_MH]), torch.cat([labels_M, labels_M])
            weights_M = torch.cat([weights_M, torch.zeros_like(weights_M)])
            correct_w_M = torch.cat([correct_w_M, torch.zeros_like(correct_w_M)])
        grad_h = torch.empty_like(h_MH) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=h_MH.device)
        correct = torch.zeros((), dtype=torch.float32, device=h_MH.device)
        w = w_VH.to(dtype)  # a no-op for a bf16 lm_head under bf16 compute
        b = b_V.to(dtype) if b_V is not None else None
        n = h_MH.shape[0]
        top = torch.empty(n, k, device=h_MH.device)
        slope = torch.empty(n, k, device=h_MH.device)
        cand = torch.empty(n, k, dtype=torch.long, device=h_MH.device)
        with torch.autocast(h_MH.device.type, enabled=False):
            for i, j in chunk_bounds(n, chunk):
                logits = h_MH[i:j].to(dtype) @ w.t()
                if b is not None:
                    logits = logits + b
                l, c, g, *tile_max = stats(
                    logits,
                    labels_M[i:j],
                    weights_M[i:j].float(),
                    correct_w_M[i:j].float(),
                    mult,
                    cap,
                )
                loss += l
                correct += c
                if need_grad:
                    grad_h[i:j] = g @ w
                if k:
                    tm = tile_max[0] if tile_max else None
                    top[i:j], cand[i:j], slope[i:j] = _top_k(logits, k, mult, cap, tm)
        if single:
            grad_h = grad_h[:1] if need_grad else None
            top, cand, slope = top[:1].clone(), cand[:1].clone(), slope[:1].clone()
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.save_for_backward(grad_h, w if k else None, cand, slope)
        ctx.mark_non_differentiable(correct, cand)
        return loss, correct, top, cand

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct, grad_top, _grad_cand):
        grad_h, w, cand, slope = ctx.saved_tensors
        grad = grad_h * grad_loss.to(grad_h.dtype)
        if w is not None and grad_top is not None:
            # d top[m, j] / d h[m] = slope[m, j] * W[cand[m, j]]: k rows of the head per position
            g = (grad_top.float() * slope).to(ctx.dtype)
            for i, j in chunk_bounds(grad.shape[0], ctx.chunk):
                rows = w.index_select(0, cand[i:j].reshape(-1)).view(j - i, -1, w.shape[1])
                grad[i:j] += (g[i:j, None, :] @ rows)[:, 0].to(grad.dtype)
        return (grad,) + (None,) * 11


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
    loss, correct, _, _ = _FusedLinearCE.apply(
        h_MH,
        lm_head_w_VH.detach(),
        lm_head_b_V.detach() if lm_head_b_V is not None else None,
        labels_M,
        weights_M,
        weights_M,
        chunk,
        dtype,
        float(output_multiplier),
        cap,
        0,
        False,
    )
    return loss, correct


def fused_ce_selection_sum(
    h_MH: torch.Tensor,
    lm_head_w_VH: torch.Tensor,
    labels_M: torch.Tensor,
    weights_M: torch.Tensor,
    prev_M: torch.Tensor,
    selector,
    *,
    selection_weight: float,
    chunk: int = 4096,
    dtype: torch.dtype | None = None,
    output_multiplier: float = 1.0,
    softcap: float | None = None,
    lm_head_b_V: torch.Tensor | None = None,
    correct_weights_M: torch.Tensor | None = None,
    tiles: bool = False,
):
    """DFlash2's objective as `losses.ce_selection_sum` (same value and gradients), from the
    fused head: each chunk's logits give the CE's gradient and the selector's top-K candidates in
    one pass, and are neither stored, recomputed nor copied to float32. The selector then scores
    all M positions at once; its term's gradient reaches h through the K head rows of each
    position's candidates. `tiles`: the CE stats tile by tile, handing `tiled_topk` its tile
    maxima (`_ce_stats_tiled`). Returns (loss_sum, weighted_correct_sum)."""
    dtype = dtype or lm_head_w_VH.dtype
    cap = float(softcap) if softcap else None
    loss, correct, top, cand = _FusedLinearCE.apply(
        h_MH,
        lm_head_w_VH.detach(),
        lm_head_b_V.detach() if lm_head_b_V is not None else None,
        labels_M,
        weights_M,
        weights_M if correct_weights_M is None else correct_weights_M,
        chunk,
        dtype,
        float(output_multiplier),
        cap,
        min(selector.top_k, lm_head_w_VH.shape[0]),
        tiles,
    )
    sel = selection_sum(selector, h_MH, top, cand, labels_M, prev_M, weights_M)
    return loss + selection_weight * sel, correct
