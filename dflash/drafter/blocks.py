"""Block construction shared by training and evaluation: anchors, block inputs, attention masks,
labels. One code path, so what training optimises is what evaluation measures.

Legend: N rows, T positions, A anchors per row, B block size, Q = A*B block queries,
K = T + Q keys (context first, then the blocks).

A row may hold several samples (segment_ids_NT, -1 = padding); position_ids restart per sample.
Block k (1..B-1) of anchor a predicts the token at a+k; its hard label is the target's greedy
prediction for a+k, i.e. next_token[a+k-1] from the clean forward (no shift beyond that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .spec import MaskRule, mask_rules  # noqa: F401  (mask_rules: callers build `rules` with it)


@dataclass
class Blocks:
    anchors_NA: torch.Tensor  # absolute index of each anchor in its row; valid_NA marks real ones
    valid_NA: torch.Tensor
    block_ids_NQ: torch.Tensor  # [token(anchor), MASK x (B-1)] per anchor
    block_pos_NQ: torch.Tensor  # position ids anchor_pos .. anchor_pos+B-1
    masks: dict  # layer_type -> bool [N, 1, Q, T+Q]


def candidate_anchors(segment_ids_NT: torch.Tensor, loss_mask_NT: torch.Tensor) -> torch.Tensor:
    """bool [N, T]: a may anchor a block if a and a+1 are response tokens of the same sample (at
    inference the anchor is always a generated token: the bonus) and a has context before it."""
    N, T = segment_ids_NT.shape
    ok = torch.zeros(N, T, dtype=torch.bool, device=segment_ids_NT.device)
    if T < 3:
        return ok
    seg = segment_ids_NT
    same_next = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] >= 0)
    ok[:, :-1] = same_next & loss_mask_NT[:, 1:].bool() & loss_mask_NT[:, :-1].bool()
    ok[:, 0] = False
    ok[:, 1:] &= seg[:, 1:] == seg[:, :-1]
    return ok


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function (uint64 arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_uniforms(seeds_N, count: int) -> np.ndarray:
    """[N, count] float64 draws in [0, 1): draw i of row n is a hash (splitmix64) of the row's
    seed and i alone, so a row's draws never depend on the other rows, on how many of its draws
    are used or on the batch's padded shapes, and a whole batch takes a few vectorised calls on
    the host (the per-row torch.Generator loops were most of a step's host-side ops)."""
    seeds = np.asarray([int(s) % 2**64 for s in seeds_N], dtype=np.uint64)
    with np.errstate(over="ignore"):
        state = _mix64(seeds)[:, None] + _GOLDEN * np.arange(1, count + 1, dtype=np.uint64)
        z = _mix64(state)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_anchors(
    candidates_NT: torch.Tensor, max_anchors: int, seeds_N: list[int], pad: bool = False
):
    """Uniform without replacement, per row from its own seed (so a row's anchors do not depend on
    how rows are grouped into micro-batches or ranks): the candidates with the max_anchors
    smallest of the row's draws (`row_uniforms`, one per position), in position order. Returns
    anchors_NA, valid_NA (A = the largest count, or max_anchors with pad=True: static shapes
    under `train.compile`); padding anchors are 0 and invalid."""
    cand = candidates_NT.cpu().numpy().astype(bool)  # one device->host copy for the batch
    N, T = cand.shape
    counts = np.minimum(cand.sum(1), max_anchors)
    A = max(int(counts.max(initial=0)), max_anchors if pad else 1)
    keys = np.where(cand, row_uniforms(seeds_N, T), 2.0)  # non-candidates sort last
    picked = np.argsort(keys, axis=1, kind="stable")[:, : min(A, T)]
    real = np.arange(picked.shape[1])[None, :] < counts[:, None]
    picked = np.sort(np.where(real, picked, T), axis=1)  # real anchors first, in position order
    anchors = np.zeros((N, A), dtype=np.int64)
    valid = np.zeros((N, A), dtype=bool)
    anchors[:, : picked.shape[1]] = np.where(picked < T, picked, 0)
    valid[:, : picked.shape[1]] = picked < T
    dev = candidates_NT.device
    return torch.from_numpy(anchors).to(dev), torch.from_numpy(valid).to(dev)


def sample_kept_labels(keep_p_k: torch.Tensor, seeds_N: list[int], shape):
    """Which of the [N, A, B-1] labels a step keeps (`train.label_sampling=by_weight`): block
    position k with probability keep_p_k[k], per row from its own seed; the draw of (anchor a,
    position k) is the row's draw a*(B-1)+k, so it does not depend on the batch's padded anchor
    count."""
    N, A, K = shape
    u = row_uniforms(seeds_N, A * K).reshape(N, A, K)
    return torch.from_numpy(u < keep_p_k.double().numpy())


def sample_prefix_lengths(
    seeds_N: list[int], shape, block_size: int, base: float, shortest: int
) -> torch.Tensor:
    """Visible prefix length l [N, A] per block (`train.loss=variable_prefix`): block positions
    0..l-1 hold real tokens, from a truncated geometric prior P(l) ~ base^l over
    shortest..B-1; per row from its own seed (the inverse CDF of the row's draws, one per
    anchor), so a row's draw does not depend on the batch's padded anchor count."""
    N, A = shape
    prior = float(base) ** np.arange(shortest, block_size, dtype=np.float64)
    cdf = np.cumsum(prior) / prior.sum()
    u = row_uniforms(seeds_N, A)
    idx = np.minimum(np.searchsorted(cdf, u, side="right"), len(prior) - 1)
    return torch.from_numpy(shortest + idx.astype(np.int64))


def show_prefix(
    block_ids_NQ, input_ids_NT, segment_ids_NT, anchors_NA, prefix_NA, block_size, mask_token_id
):
    """Block ids with positions 1..l-1 holding the row's real tokens at anchor+k (the mask token
    where anchor+k leaves the anchor's sample); position 0 is the anchor as always."""
    N, T = input_ids_NT.shape
    k_B = torch.arange(block_size, device=anchors_NA.device)
    pos = anchors_NA[:, :, None] + k_B  # [N, A, B]
    pos_c = pos.clamp(max=T - 1).view(N, -1)
    same = segment_ids_NT.gather(1, pos_c).view(pos.shape) == segment_ids_NT.gather(
        1, anchors_NA
    ).unsqueeze(-1)
    seen = (k_B < prefix_NA[..., None]) & (pos < T) & same
    real = input_ids_NT.gather(1, pos_c).view(pos.shape)
    blk = block_ids_NQ.view(pos.shape)
    return torch.where(seen, real, blk.new_full((), mask_token_id)).where(k_B > 0, blk).view(N, -1)


def build_blocks(
    input_ids_NT: torch.Tensor,
    position_ids_NT: torch.Tensor,
    segment_ids_NT: torch.Tensor,
    anchors_NA: torch.Tensor,
    valid_NA: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    rules: dict[str, MaskRule],
) -> Blocks:
    """rules: {layer_type: MaskRule}, i.e. `mask_rules(spec)`."""
    N, T = input_ids_NT.shape
    A, B = anchors_NA.shape[1], block_size
    dev = input_ids_NT.device
    k_B = torch.arange(B, device=dev)
    block_ids = torch.full((N, A, B), mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = input_ids_NT.gather(1, anchors_NA)
    anchor_pos_NA = position_ids_NT.gather(1, anchors_NA)
    block_pos = anchor_pos_NA[:, :, None] + k_B
    masks = {
        t: block_attention_mask(
            anchors_NA,
            valid_NA,
            position_ids_NT,
            segment_ids_NT,
            B,
            causal_in_block=r.causal_in_block,
            window=r.window,
            window_both_sides=r.window_both_sides,
        )
        for t, r in rules.items()
    }
    return Blocks(anchors_NA, valid_NA, block_ids.view(N, A * B), block_pos.view(N, A * B), masks)


def block_attention_mask(
    anchors_NA,
    valid_NA,
    position_ids_NT,
    segment_ids_NT,
    block_size: int,
    causal_in_block: bool,
    window: int | None,
    window_both_sides: bool = False,
) -> torch.Tensor:
    """bool [N, 1, Q, T+Q] for one `MaskRule`. Query (a, i) sees context j iff j < a, j is in a's
    sample and, with a window, pos(a)+i - pos(j) < window; it sees block keys (a', i') iff
    a' == a, (not causal_in_block or i' <= i) and, with a window, i - i' < window (and
    i' - i < window when window_both_sides). Blocks never see each other, and nothing at or
    after the anchor leaks in."""
    N, T = position_ids_NT.shape
    A, B = anchors_NA.shape[1], block_size
    dev = anchors_NA.device
    j_T = torch.arange(T, device=dev)
    i_B = torch.arange(B, device=dev)
    seg_anchor_NA = segment_ids_NT.gather(1, anchors_NA)
    ctx = (
        (j_T[None, None, :] < anchors_NA[:, :, None])
        & (segment_ids_NT[:, None, :] == seg_anchor_NA[:, :, None])
        & valid_NA[:, :, None]
    )  # [N, A, T]
    ctx = ctx[:, :, None, :].expand(N, A, B, T)
    if window is not None:
        qpos_NAB = position_ids_NT.gather(1, anchors_NA)[:, :, None] + i_B
        dist = qpos_NAB[..., None] - position_ids_NT[:, None, None, :]
        ctx = ctx & (dist < window)
    intra_BB = (
        (i_B[None, :] <= i_B[:, None])
        if causal_in_block
        else torch.ones(B, B, dtype=torch.bool, device=dev)
    )
    if window is not None:
        ahead_BB = i_B[:, None] - i_B[None, :]  # q - k for query i, key i'
        intra_BB = intra_BB & (ahead_BB < window)
        if window_both_sides:
            intra_BB = intra_BB & (-ahead_BB < window)
    eye_AA = torch.eye(A, dtype=torch.bool, device=dev)
    blk = eye_AA[:, None, :, None] & intra_BB[None, :, None, :]  # [A, B, A, B]
    blk = blk.reshape(A * B, A * B)[None].expand(N, -1, -1)
    return torch.cat([ctx.reshape(N, A * B, T), blk], dim=-1)[:, None]


def gather_labels(next_token_NT: torch.Tensor, anchors_NA: torch.Tensor, block_size: int):
    """labels_NAk for k = 1..B-1: next_token[a+k-1], the target's greedy token for position a+k
    (clamped inside the row; `label_valid` says which are real)."""
    N, T = next_token_NT.shape
    k = torch.arange(1, block_size, device=anchors_NA.device)
    src = (anchors_NA[:, :, None] + k - 1).clamp(max=T - 2)
    return next_token_NT.gather(1, src.reshape(N, -1)).view_as(src)


def label_valid(loss_mask_NT, segment_ids_NT, anchors_NA, valid_NA, block_size: int):
    """bool [N, A, B-1]: a+k is in the row, in the anchor's sample, and it and every position
    between the anchor and it are response tokens: a block ends where the answer does, never
    reaching across a user turn or template markers into the next answer (a served draft never
    does). Needs no target output, so the trainer computes it on the host copy of the batch."""
    N, T = segment_ids_NT.shape
    k = torch.arange(1, block_size, device=anchors_NA.device)
    tgt_NAk = anchors_NA[:, :, None] + k  # position a+k
    tgt_c = tgt_NAk.clamp(max=T - 1).reshape(N, -1)
    seg_a = segment_ids_NT.gather(1, anchors_NA)[:, :, None]
    same = segment_ids_NT.gather(1, tgt_c).view(N, -1, block_size - 1) == seg_a
    resp = loss_mask_NT.bool().gather(1, tgt_c).view(N, -1, block_size - 1)
    resp = resp.int().cumprod(-1).bool()  # the answer's run from the anchor on
    return (tgt_NAk < T) & same & resp & valid_NA[:, :, None]
