"""What `train.loss` and `drafter.variant` make of a prepared micro-batch: the block objective
(its visible prefixes and position weights, fixed before the forward so that the global
denominator is known in advance), the loss on the drafter's hidden states, and DFlash2's
selection term.

Legend: N rows, A anchors, B block size, K = B-1 drafted positions, M labelled positions,
H hidden, V vocab.

Every objective is a weighted sum over labelled positions that the trainer divides by the
global sum (micro-batches x data-parallel ranks) of the *denominator* weights `weights_NAK`, so
gradient accumulation and data parallelism give the gradient of one big batch, whatever the
loss:

- hard_ce: CE against the target's greedy token, w_k = exp(-(k-1)/gamma); denominator = w.
- variable_prefix (D2SD, arXiv 2606.04446; NeMo AutoModel's `loss_type="variable_prefix"`):
  per block a visible prefix length l ~ P(l) ~ train.prefix_base^l over
  train.prefix_min..B-1; positions 1..l-1 hold the row's real tokens instead of the mask, only
  positions k >= l are labelled, w_k = exp(-(k-l)/gamma) (the decay re-anchored at the
  boundary); denominator = w. With prefix_min = 1 the reference's own block [anchor, MASK...]
  is the most likely draw; NeMo's lower bound is 2 (train.prefix_min=2), which never trains the
  block the reference decodes. Decoding is unchanged (the reference's).
- dpace (D-PACE, vLLM speculators `src/speculators/losses/utils.py::dpace_loss_decay`, arXiv
  2605.18810): CE weighted per block by `dflash.train.losses.dpace_weights` of the drafter's own
  (detached) CE, computed in a first pass without a graph; denominator = the number of labels
  (speculators divides by the valid-token count too), accuracy per label.
- soft_kl: KL(target || drafter) with hard_ce's weights (train.allow_soft_loss).

drafter.variant=dflash2 adds `train.selector_loss_weight` x the selector's CE among the top-K
candidates (`dflash.train.losses.ce_selection_sum`, which says what it teaches and why its
teacher forcing is exact), with the objective's weights. On CUDA, hard_ce and variable_prefix,
and DFlash2's selection under any of its losses, take the fused lm_head + CE
(`dflash.train.fused_ce`); the rest the chunked, checkpointed CE.
"""

from __future__ import annotations

import torch

from ..config import TrainConfig
from ..drafter.blocks import sample_prefix_lengths, show_prefix
from .fused_ce import fused_ce_selection_sum, fused_weighted_ce_sum
from .losses import (
    ce_per_position,
    ce_selection_sum,
    dpace_weights,
    position_weights,
    prefix_position_weights,
    soft_kl_sum,
    weighted_ce_sum,
)


class Objective:
    def __init__(self, cfg: TrainConfig, drafter, device: torch.device, dtype: torch.dtype):
        self.cfg, self.drafter, self.device, self.dtype = cfg, drafter, device, dtype
        self.spec = drafter.spec
        self.weights_k = position_weights(self.spec.block_size, cfg.gamma).to(device)
        self.selector = getattr(drafter, "candidate_selector", None)  # DFlash2
        # hard_ce / variable_prefix (and DFlash2's selection, every loss) through the fused head
        # (train.fused_head; auto: on CUDA, where its CE stats are one compiled kernel; on the
        # CPU they run eagerly, slower than the plain path)
        self.fused = cfg.fused_head in ("fused", "tiles") or (
            cfg.fused_head == "auto" and device.type == "cuda"
        )
        self.tiles = cfg.fused_head == "tiles"  # DFlash2's stats tile by tile (fused_ce)
        if self.selector is not None and cfg.loss == "soft_kl":
            raise ValueError(
                "train.loss=soft_kl with drafter.variant=dflash2: the selector's loss needs hard "
                "labels; use train.loss=hard_ce, variable_prefix or dpace"
            )

    # ------------------------------------------------------------------ before the forward
    def prefix_lengths(self, seeds_N: list[int], shape) -> torch.Tensor | None:
        """Host [N, A] visible prefix lengths (variable_prefix), else None."""
        if self.cfg.loss != "variable_prefix":
            return None
        c, B = self.cfg, self.spec.block_size
        return sample_prefix_lengths(seeds_N, shape, B, c.prefix_base, c.prefix_min)

    def past_prefix(self, prefix_NA: torch.Tensor) -> torch.Tensor:
        """bool [N, A, K]: block position k lies at or after the visible prefix (k >= l)."""
        k = torch.arange(1, self.spec.block_size, device=prefix_NA.device)
        return k >= prefix_NA[..., None]

    def show_prefix(self, blocks, tb, prefix_NA: torch.Tensor) -> None:
        blocks.block_ids_NQ = show_prefix(
            blocks.block_ids_NQ,
            tb.input_ids_NT,
            tb.segment_ids_NT,
            blocks.anchors_NA,
            prefix_NA,
            self.spec.block_size,
            self.spec.mask_token_id,
        )

    def weights(self, lvalid_NAK: torch.Tensor, prefix_NA: torch.Tensor | None) -> torch.Tensor:
        """The denominator weights [N, A, K] (0 where no label)."""
        if self.cfg.loss == "dpace":
            return lvalid_NAK.float()
        if prefix_NA is not None:
            return prefix_position_weights(prefix_NA, self.spec.block_size, self.cfg.gamma) * (
                lvalid_NAK
            )
        return self.weights_k[None, None, :] * lvalid_NAK

    # ------------------------------------------------------------------ the loss
    def sums(self, h_M: torch.Tensor, tb, p, heads) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, weighted correct sum) of one micro-batch from the drafter's hidden states
        at its M labelled positions."""
        cfg, w_lm, b_lm = self.cfg, heads.lm_head.weight, heads.bias
        transform = self.drafter.logit_transform
        labels = p.select(p.labels_NAK)
        weights = p.select(p.weights_NAK if p.loss_weights_NAK is None else p.loss_weights_NAK)
        correct_w = None
        if cfg.loss == "soft_kl":
            th = target_hidden_at_labels(tb, p, self.spec.block_size)
            kl = soft_kl_sum(
                *(h_M, w_lm, th, weights),
                chunk=cfg.lm_head_chunk,
                logit_transform=transform,
                lm_head_b_V=b_lm,
            )
            return kl, h_M.new_zeros(())
        if cfg.loss == "dpace":
            # the head's per-position CE in one pass; without a selector (which makes its own
            # pass) on the graph, weighted by the D-PACE weights of its detached values
            # (accuracy per label, not per D-PACE weight)
            one_pass = self.selector is None
            with torch.set_grad_enabled(torch.is_grad_enabled() and one_pass):
                ce, hit = ce_per_position(
                    h_M if one_pass else h_M.detach(),
                    w_lm,
                    labels,
                    chunk=cfg.lm_head_chunk,
                    logit_transform=transform,
                    lm_head_b_V=b_lm,
                )
            dp = self._dpace_weights(ce.detach(), p)
            if one_pass:
                return (ce * dp).sum(), (hit * weights).sum()
            correct_w, weights = weights, dp
        fused = dict(
            dtype=self.dtype,
            output_multiplier=self.spec.output_multiplier,
            softcap=self.spec.final_logit_softcapping,
        )
        if self.selector is not None:
            sel = (p.select(self.predecessors(p)), self.selector)
            kw = dict(
                selection_weight=cfg.selector_loss_weight,
                chunk=cfg.lm_head_chunk,
                lm_head_b_V=b_lm,
                correct_weights_M=correct_w,
            )
            if self.fused:
                return fused_ce_selection_sum(
                    h_M, w_lm, labels, weights, *sel, **kw, **fused, tiles=self.tiles
                )
            return ce_selection_sum(
                h_M, w_lm, labels, weights, *sel, **kw, logit_transform=transform
            )
        if self.fused:
            return fused_weighted_ce_sum(
                h_M, w_lm, labels, weights, chunk=cfg.lm_head_chunk, lm_head_b_V=b_lm, **fused
            )
        return weighted_ce_sum(
            h_M,
            w_lm,
            labels,
            weights,
            chunk=cfg.lm_head_chunk,
            logit_transform=transform,
            lm_head_b_V=b_lm,
        )

    def _dpace_weights(self, ce: torch.Tensor, p) -> torch.Tensor:
        """D-PACE loss weights [M] from the detached per-position CE [M] of each whole block."""
        K = self.spec.block_size - 1
        grid = torch.zeros(p.weights_NAK.numel(), device=ce.device, dtype=torch.float32)
        grid.index_copy_(0, p.label_index_M, ce)
        valid = (p.weights_NAK > 0).reshape(-1, K)
        w = dpace_weights(grid.view(-1, K), valid, self.cfg.dpace_alpha)
        return w.flatten().index_select(0, p.label_index_M)

    def predecessors(self, p) -> torch.Tensor:
        """[N, A, K] the token before each block position on the path the chain verifies: the
        anchor, a visible prefix token, or the target's greedy token of the previous position."""
        N, A = p.blocks.anchors_NA.shape
        blk = p.blocks.block_ids_NQ.view(N, A, self.spec.block_size)
        prev = torch.cat([blk[..., :1], p.labels_NAK[..., :-1]], dim=-1)
        if p.prefix_NA is None:
            return prev
        k = torch.arange(1, self.spec.block_size, device=prev.device)
        return torch.where(k - 1 < p.prefix_NA[..., None], blk[..., :-1], prev)


def target_hidden_at_labels(tb, p, block_size: int) -> torch.Tensor:
    """The target's final hidden state [M, H] that predicts each labelled position."""
    if tb.final_hidden_NTH is None:
        raise ValueError("train.loss=soft_kl needs the target's final hidden states in the batch")
    anchors = p.blocks.anchors_NA
    k = torch.arange(1, block_size, device=anchors.device)
    src = (anchors[:, :, None] + k - 1).clamp(max=tb.final_hidden_NTH.shape[1] - 1)
    N = src.shape[0]
    th = tb.final_hidden_NTH.gather(
        1, src.view(N, -1, 1).expand(-1, -1, tb.final_hidden_NTH.shape[-1])
    )
    return p.select(th.view(*src.shape, -1))
