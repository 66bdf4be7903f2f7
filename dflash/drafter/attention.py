"""Block-sparse drafter attention: flex attention over a BlockMask built from the block rule.

Legend: N rows, Q block queries, K = T + Q keys (context first, then the blocks), h heads.

The dense rule (`blocks.block_attention_mask`, bool [N, 1, Q, K]) stays the one definition of
who sees what; this module only turns it into a BlockMask: tiles of 128 x 128 that hold no
visible pair are skipped by the kernel, tiles that are all visible run without a mask, and the
mixed ones read the dense rule inside the kernel. So the work scales with what is visible
(context before each anchor, the sliding window, the block's own diagonal tile) instead of
N x Q x (T + Q), and the result is the dense rule's by construction.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("auto", "flex", "sdpa")
TILE = 128


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """ "auto": flex on CUDA (compiled Triton kernel), dense SDPA elsewhere (flex runs only as an
    eager reference on CPU, slower than SDPA)."""
    if kernel not in KERNELS:
        raise ValueError(f"train.attn_kernel={kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "sdpa"
    if kernel == "flex" and (device.type != "cuda" or not flex_available()):
        raise ValueError(
            "train.attn_kernel=flex needs a CUDA device and torch.nn.attention.flex_attention "
            "(flex has no backward on CPU); use train.attn_kernel=sdpa or auto"
        )
    return kernel


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def block_mask_from_dense(mask_N1QK: torch.Tensor):
    """BlockMask equal to a dense bool mask (True = may attend). Padded tiles are False; the
    mask_mod reads the padded copy, so it never indexes past the tensor."""
    from torch.nn.attention.flex_attention import BlockMask

    N, _, Q, K = mask_N1QK.shape
    Qp, Kp = round_up(Q, TILE), round_up(K, TILE)
    dense = F.pad(mask_N1QK[:, 0], (0, Kp - K, 0, Qp - Q))  # [N, Qp, Kp]
    tiles = dense.view(N, Qp // TILE, TILE, Kp // TILE, TILE)
    any_t = tiles.any(dim=4).any(dim=2)  # [N, Qb, Kb]
    all_t = tiles.all(dim=4).all(dim=2)
    partial = any_t & ~all_t

    def indices(sel):  # selected tiles first, in key order (stable sort)
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[:, None].contiguous(), idx[:, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(all_t)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(Q, K)
    )


def to_kernel_masks(masks: dict, kernel: str) -> dict:
    """{layer_type: dense bool mask} -> the form the drafter's attention runs on: the dense mask
    (SDPA) or a BlockMask (flex). DFlashAttention dispatches on the type."""
    if kernel == "sdpa":
        return masks
    return {t: block_mask_from_dense(m) for t, m in masks.items()}


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention(q, k, v, block_mask) -> torch.Tensor:
    """q [N, h, Q, d], k/v [N, kv, K, d] (GQA without expanding K/V). Compiled on CUDA; on CPU
    the eager implementation (a reference, used by the tests)."""
    # flex is not on autocast's list: run it in the autocast dtype as SDPA would. The norms and
    # RoPE hand q and k back in float32 under autocast; v comes straight from a linear layer, so
    # its dtype is the autocast one (or the model's without autocast), read without asking the
    # autocast state (which a traced graph would break on).
    dt = v.dtype
    q, k = q.to(dt), k.to(dt)
    if q.is_cuda and not torch.compiler.is_compiling():  # inside torch.compile: traced as is
        fn = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def is_block_mask(mask) -> bool:
    return _BlockMask is not None and isinstance(mask, _BlockMask)


try:  # resolved once: is_block_mask runs inside compiled drafter graphs (train.compile)
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask
except ImportError:
    _BlockMask = None
