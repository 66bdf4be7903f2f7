"""Rotary position embedding of the drafter, built from its full rope settings (context and
block positions alike)."""

from __future__ import annotations

import torch

from ..common.chains import rope
from .fuse import fused


class Rotary:
    """RoPE frequencies built from the spec's full rope settings by transformers' own rope
    functions (what the reference's `Qwen3RotaryEmbedding` does): yarn / linear / llama3 / ...
    change the frequencies, and yarn's attention factor scales cos and sin (so q.k by its square).

    `dynamic` and `longrope` recompute their frequencies from the largest position of each
    forward (stateful in the reference: cached context keys keep older ones); below that length
    they equal the static ones, so positions from there on are refused."""

    def __init__(self, spec):  # a dflash.drafter.spec.DrafterSpec
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rp, d = spec.rope_parameters, spec.head_dim
        kind = rp.get("rope_type", "default")
        self.limit = None
        if kind == "default":
            inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            self.scale = 1.0
        elif kind in ROPE_INIT_FUNCTIONS:
            qc = Qwen3Config(
                hidden_size=spec.hidden_size,
                num_attention_heads=spec.num_attention_heads,
                head_dim=d,
                max_position_embeddings=spec.max_position_embeddings,
                rope_parameters=dict(rp),
            )
            inv, self.scale = ROPE_INIT_FUNCTIONS[kind](qc, "cpu")
            if "dynamic" in kind:
                self.limit = spec.max_position_embeddings
            elif kind == "longrope":
                self.limit = int(qc.rope_parameters["original_max_position_embeddings"])
        else:
            raise ValueError(
                f"config.json rope type {kind!r} is not one of transformers' rope types "
                f"{['default', *ROPE_INIT_FUNCTIONS]}"
            )
        if inv.numel() * 2 != d:
            raise ValueError(
                f"config.json rope settings give {inv.numel() * 2} rotary dims for head_dim={d}: "
                "partial rotary is not supported by the Qwen3 drafter (remove partial_rotary_factor)"
            )
        self.kind, self.inv_freq = kind, inv.float()
        self.scale = float(self.scale)
        self._on = {}

    def cos_sin(self, pos: torch.Tensor, dtype: torch.dtype):
        """pos [..., L] -> cos, sin [..., L, d] (rotate-half convention)."""
        if self.limit is not None and pos.numel() and int(pos.max()) >= self.limit:
            raise ValueError(
                f"rope type {self.kind!r} recomputes its frequencies past position {self.limit} "
                "from the forward's length (stateful in the reference); positions >= "
                f"{self.limit} are not supported"
            )
        inv = self._on.get(pos.device)
        if inv is None:
            inv = self._on[pos.device] = self.inv_freq.to(pos.device)
        freqs = pos.float()[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


@fused
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, h, L, d]; cos/sin [N, L, d]."""
    return rope(x, cos[:, None], sin[:, None])
