"""The DFlash drafter (reference semantics of z-lab/dflash `DFlashDraftModel`).

Legend: N rows, T context positions, Q block queries (anchors x block size), H hidden,
F = K*H aux features, h heads, d head dim.

Context (aux states of positions strictly before each anchor) goes through fc -> hidden_norm and
only feeds K/V of every layer; it never enters the residual stream. Q comes from the block.
The drafter has no embedding and no LM head: it uses the target's, frozen, plus its own norm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterSpec:
    """Resolved drafter shape; serialises to a z-lab/vLLM/SGLang compatible Qwen3 config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list
    num_target_layers: int
    layer_types: list
    sliding_window: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    def to_hf_config(self, dtype: str = "bfloat16") -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": any(t == "sliding_attention" for t in self.layer_types),
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
            "torch_dtype": dtype,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DrafterSpec:
        """Read a serving-format config.json; layer ids always come from the checkpoint."""
        dc = cfg.get("dflash_config") or {}
        if "target_layer_ids" not in dc:
            raise ValueError(
                "config.json has no dflash_config.target_layer_ids; not a DFlash drafter"
            )
        if "mask_token_id" not in dc and "mask_token_id" not in cfg:
            raise ValueError(
                "config.json has no dflash_config.mask_token_id; the drafter's mask token "
                "must come from the checkpoint"
            )
        n = int(cfg["num_hidden_layers"])
        layer_types = cfg.get("layer_types")
        if not layer_types:
            sliding = cfg.get("use_sliding_window", False) and cfg.get("sliding_window")
            layer_types = ["sliding_attention" if sliding else "full_attention"] * n
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=int(cfg["vocab_size"]),
            block_size=int(cfg.get("block_size", 16)),
            mask_token_id=int(dc.get("mask_token_id", cfg.get("mask_token_id"))),
            target_layer_ids=[int(i) for i in dc["target_layer_ids"]],
            num_target_layers=int(cfg.get("num_target_layers", -1)),
            layer_types=list(layer_types),
            sliding_window=int(cfg.get("sliding_window") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        )

    def as_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """pos [..., L] -> cos, sin [..., L, d] (Qwen3 / Llama rotate-half convention)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    )
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, h, L, d]; cos/sin [N, L, d]."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        H, h, kv, d = (
            spec.hidden_size,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        self.num_heads, self.num_kv, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, kv * d, bias=False)
        self.v_proj = nn.Linear(H, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def project_kv(self, x_NLH: torch.Tensor, cos, sin):
        """K/V of context or block states: k_norm + RoPE at their true positions."""
        N, L, _ = x_NLH.shape
        k = self.k_norm(self.k_proj(x_NLH).view(N, L, self.num_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_NLH).view(N, L, self.num_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, h_NQH, ctx_kv, q_cos, q_sin, mask_N1QK):
        N, Q, _ = h_NQH.shape
        q = self.q_norm(self.q_proj(h_NQH).view(N, Q, self.num_heads, self.head_dim)).transpose(
            1, 2
        )
        q = apply_rope(q, q_cos, q_sin)
        k_blk, v_blk = self.project_kv(h_NQH, q_cos, q_sin)
        k_ctx, v_ctx = ctx_kv
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if self.num_heads != self.num_kv:
            # Expanded explicitly: with enable_gqa only cuDNN takes a mask efficiently; the math
            # fallback then materialises [N, h, Q, T+Q] scores (44 GiB per layer at 27B scale).
            rep = self.num_heads // self.num_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_N1QK)
        return self.o_proj(out.transpose(1, 2).reshape(N, Q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(spec)
        self.mlp = DFlashMLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, h_NQH, ctx_kv, q_cos, q_sin, mask_N1QK):
        h_NQH = h_NQH + self.self_attn(self.input_layernorm(h_NQH), ctx_kv, q_cos, q_sin, mask_N1QK)
        return h_NQH + self.mlp(self.post_attention_layernorm(h_NQH))


class DFlashDrafter(nn.Module):
    """Weights named exactly as the serving format (fc, hidden_norm, layers.i..., norm)."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(spec.num_aux * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(spec, t) for t in spec.layer_types)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def context(self, aux_NTF: torch.Tensor) -> torch.Tensor:
        # fc runs in the autocast dtype (bf16/fp32): fp16 overflows here (its input concatenates
        # several target layers' hidden states).
        return self.hidden_norm(self.fc(aux_NTF))

    def context_kv(self, ctx_NTH: torch.Tensor, ctx_pos_NT: torch.Tensor) -> list:
        """Per-layer K/V of the context; independent of the block, so inference can cache it."""
        cos, sin = rope_cos_sin(ctx_pos_NT, self.spec.head_dim, self.spec.rope_theta, ctx_NTH.dtype)
        return [layer.self_attn.project_kv(ctx_NTH, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_emb_NQH: torch.Tensor,
        block_pos_NQ: torch.Tensor,
        masks: dict,
        aux_NTF: torch.Tensor | None = None,
        ctx_pos_NT: torch.Tensor | None = None,
        ctx_kv: list | None = None,
    ) -> torch.Tensor:
        """Returns the normed final hidden states of the block queries [N, Q, H].

        masks: {layer_type: bool [N, 1, Q, T + Q]} (True = may attend), context keys first.
        Either aux_NTF + ctx_pos_NT (training, eval) or a precomputed ctx_kv (cached inference).
        """
        if ctx_kv is None:
            ctx_kv = self.context_kv(self.context(aux_NTF), ctx_pos_NT)
        h = block_emb_NQH
        q_cos, q_sin = rope_cos_sin(block_pos_NQ, self.spec.head_dim, self.spec.rope_theta, h.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            h = layer(h, kv, q_cos, q_sin, masks[layer.layer_type])
        return self.norm(h)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
