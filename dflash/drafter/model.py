"""The DFlash drafter (reference semantics of z-lab/dflash `DFlashDraftModel`).

Legend: N rows, T context positions, Q block queries (anchors x block size), H hidden,
F = K*H aux features, h heads, d head dim.

Context (aux states of positions strictly before each anchor) goes through fc -> hidden_norm and
only feeds K/V of every layer; it never enters the residual stream. Q comes from the block.
The drafter has no embedding and no LM head: it uses the target's, frozen, plus its own norm.
Its drafting rule (`propose`) takes the argmax of each position (or samples each position's
warped distribution); a variant (dflash.drafter.variants) subclasses it and overrides what differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..common.chains import rms_norm, silu_gate
from .attention import flex_attention, is_block_mask
from .fuse import fused
from .rope import Rotary, apply_rope


def head_logits(h_MH, w_VH, logit_transform=None, b_V=None):
    """fp32 logits through the frozen head (and its bias b_V, if any) in the head's own dtype:
    the hidden chunk is cast, never the [V, H] weight (a bf16 27B head is 2.5 GB; an fp32 copy
    per micro-batch is 5 GB). The one head computation: training's losses call it per chunk,
    eval and decoding through `DFlashDrafter.logits`."""
    logits = h_MH.to(w_VH.dtype) @ w_VH.t()
    logits = (logits + b_V if b_V is not None else logits).float()
    return logit_transform(logits) if logit_transform is not None else logits


__all__ = ["DFlashDrafter", "Rotary", "num_params"]


_rms_norm = fused(rms_norm)
_silu_gate = fused(silu_gate)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class DFlashAttention(nn.Module):
    def __init__(self, spec):  # spec: a dflash.drafter.spec.DrafterSpec, here and below
        super().__init__()
        H, h, kv, d = (
            spec.hidden_size,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        self.num_heads, self.num_kv, self.head_dim = h, kv, d
        bias = spec.attention_bias
        self.q_proj = nn.Linear(H, h * d, bias=bias)
        self.k_proj = nn.Linear(H, kv * d, bias=bias)
        self.v_proj = nn.Linear(H, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, H, bias=bias)
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
        if is_block_mask(mask_N1QK):  # block-sparse kernel; GQA without expanding K/V
            out = flex_attention(q, k, v, mask_N1QK)
            return self.o_proj(out.transpose(1, 2).reshape(N, Q, -1))
        if self.num_heads != self.num_kv:
            # Expanded explicitly: with enable_gqa only cuDNN takes a mask efficiently; the math
            # fallback then materialises [N, h, Q, T+Q] scores (44 GiB per layer at 27B scale).
            rep = self.num_heads // self.num_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_N1QK)
        return self.o_proj(out.transpose(1, 2).reshape(N, Q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.act = ACT2FN[spec.hidden_act]

    def forward(self, x):
        if isinstance(self.act, nn.SiLU):  # one fused kernel on CUDA (dflash.drafter.fuse)
            return self.down_proj(_silu_gate(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, spec, layer_type: str):
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

    layer_cls = DFlashLayer  # a variant's layers (dflash.drafter.dflash2)

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(spec.num_aux * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_cls(spec, t) for t in spec.layer_types)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = Rotary(spec)

    @staticmethod
    def check_spec(spec) -> None:
        """What a variant needs of the spec beyond DFlash's (dflash.drafter.variants)."""

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self._init_params(list(self.named_parameters()), std, generator)

    @staticmethod
    def _init_params(named: list, std: float, generator: torch.Generator | None) -> None:
        for name, p in named:
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
        cos, sin = self.rotary.cos_sin(ctx_pos_NT, ctx_NTH.dtype)
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

        block_emb_NQH: the target's input embeddings of the block ids (x input_embedding_scale
        here, so every caller gets it). masks: {layer_type: bool [N, 1, Q, T + Q]} (True = may
        attend), context keys first, built from `dflash.drafter.spec.attention_rule`. Or the same rule as a flex
        BlockMask (flex_attn.to_kernel_masks).
        Either aux_NTF + ctx_pos_NT (training, eval) or a precomputed ctx_kv (cached inference).
        """
        if ctx_kv is None:
            ctx_kv = self.context_kv(self.context(aux_NTF), ctx_pos_NT)
        h = block_emb_NQH
        if self.spec.input_embedding_scale != 1.0:
            h = h * self.spec.input_embedding_scale
        q_cos, q_sin = self.rotary.cos_sin(block_pos_NQ, h.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            h = layer(h, kv, q_cos, q_sin, masks[layer.layer_type])
        return self.norm(h)

    def logit_transform(self, logits: torch.Tensor) -> torch.Tensor:
        """config.json's output_multiplier and final_logit_softcapping, on fp32 logits."""
        if self.spec.output_multiplier != 1.0:
            logits = logits * self.spec.output_multiplier
        c = self.spec.final_logit_softcapping
        if c is not None:
            logits = torch.tanh(logits / c) * c
        return logits

    def logits(
        self, h: torch.Tensor, lm_head_w_VH: torch.Tensor, lm_head_b_V: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 draft logits through the target's lm_head (its bias too, when it has one), in
        the head's own dtype (no copy of the [V, H] weight): `head_logits` with this drafter's
        `logit_transform`, as training's losses compute them."""
        return head_logits(h, lm_head_w_VH, self.logit_transform, lm_head_b_V)

    def propose(self, h_nDH, logits_nDV, anchor_n, sampling=None, generator=None):
        """The drafting rule of one block per row: tokens [n, D] for block positions 1..B-1
        and, when sampling, the proposal q [n, D, V] they were drawn from (what rejection
        sampling divides by). sampling: None (greedy: each position's argmax) or an object with
        `.temperature` and `.probs(logits)` (dflash.decoding.sampled.Sampling). DFlash drafts
        every position independently: h_nDH and anchor_n are not needed."""
        if sampling is None:
            return logits_nDV.argmax(-1), None
        q = sampling.probs(logits_nDV)
        flat = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator)
        return flat.view(q.shape[:-1]), q

    def proposal(self, h_nDH, logits_nDV, prev_nD, sampling):
        """q [n, D, V] of each position when the tokens before it are prev_nD (prev_nD[:, k] is
        the token at block position k, the anchor first): the offline evaluation's
        distributions along a known continuation. DFlash's do not depend on prev."""
        return sampling.probs(logits_nDV)

    tree_temperature = 1.0  # DDTree over softmax(logits / T) (DFlash2: its selector's rows)

    def tree_logprobs(self, logits_xV, temperature: float | None = None):
        """log softmax(logits / T) of each position, DFlash's tree (T None: `tree_temperature`)."""
        t = self.tree_temperature if temperature is None else temperature
        return torch.log_softmax(logits_xV / t, -1)

    def tree_scores(self, h_nDH, logits_nDV, anchor_n, temperature: float | None = None):
        """The draft tree's children scores when a position depends on the token before it:
        (scores [n, D, K, K] at `temperature`, None: the drafter's own `tree_temperature`;
        candidates [n, D, K]) for dflash.decoding.ddtree.TreeRows. None: DFlash's positions are
        independent, and its tree is DDTree over softmax(logits)."""
        return None


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
