"""The elementwise chains of a Llama / Qwen-style decoder layer as plain functions, written once:
RMSNorm, the SwiGLU gate and RoPE. The drafter runs them as one fused kernel each under
`train.fuse` (dflash.drafter.fuse), the target's decode steps under `data.regen_fuse`
(dflash.target.fused); elsewhere they run eagerly."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the statistics in float32, the weight applied in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (halves rotated), cos / sin broadcastable to x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
