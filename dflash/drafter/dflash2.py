"""DFlash2 (reference semantics of z-lab/dflash `DFlash2DraftModel`): DFlash plus, in every layer,
a grouped dynamic causal convolution around attention and around the MLP, and a candidate
selector that drafts the block as one path through each position's top-k tokens.

Legend: N rows, Q block queries (A blocks x B), B block size, H hidden, G = H / conv_group_size
groups, C = conv_kernel_size taps, n blocks, D = B-1 drafted positions, K = selector_top_k,
r = selector_rank, V vocab, M labelled positions.

Convolution (`GroupedDynamicCausalConv`, one per sublayer): base_kernel [2, C, H] (index 0 before
the sublayer, 1 after it) and kernel_projection H -> 2*C*G, both dynamic halves computed from the
sublayer's normed input: y_t = sum_{o<C} (base[o] + dyn_t[o]) * x_{t-o}, with one dyn_t[o] per
group of conv_group_size channels. Taps never cross a block: x_{t-o} is zero before the block's
anchor, so a block drafted alone (decoding) and the same block packed with others (training,
evaluation) compute the same thing.

Selector (`CandidateSelector`): the candidates of a position are the top-K of its logits; the
score of candidate b after predecessor a at position t is logit_t(b) + <A[a] * P h_t, S[b]>
(A, S: predecessor / successor codebooks [V, r]; P: hidden_projection H -> r). The path starts
at the anchor (the bonus token) and walks the positions in order, each step conditioned on the
token it chose before: at T=0 the best-scoring candidate, at T>0 a draw from softmax(scores / T),
whose rows are the proposal q that rejection sampling uses (the reference applies no top-p /
top-k to them).

Checkpoint names: the codebooks are parameters named `candidate_selector.predecessor_codebook`
and `candidate_selector.successor_codebook` (no `.weight`), as the published DFlash2 files store
them; the reference's `from_pretrained` maps those keys onto its nn.Embedding weights.

Initialisation (ours; the reference leaves it to training): every convolution starts as the
identity (self tap 1, no dynamic part) and the successor codebook at zero, so a fresh DFlash2
drafts exactly what a DFlash drafter with the same other weights drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import DFlashDrafter, DFlashLayer
from .topk import tiled_topk

# dflash_config fields of DFlash2DraftModel (and drafter.* keys of the same names)
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def grouped_causal_conv(x_NQH, dyn_NQCG, base_CH, group_size: int, block_size: int):
    """y_t = sum_o (base[o] + dyn_t[o]) * x_{t-o}, within each block of `block_size` queries."""
    N, Q, H = x_NQH.shape
    G, C, B = H // group_size, base_CH.shape[0], block_size
    x = x_NQH.view(N, Q // B, B, G, group_size)
    dyn = dyn_NQCG.reshape(N, Q // B, B, C, G, 1)
    out = torch.zeros_like(x)
    for o in range(min(C, B)):  # a tap reaching before the anchor reads zeros
        shifted = x if o == 0 else F.pad(x[:, :, :-o], (0, 0, 0, 0, o, 0))
        out = (
            out + (base_CH[o].view(1, 1, 1, G, group_size).to(x.dtype) + dyn[:, :, :, o]) * shifted
        )
    return out.view(N, Q, H)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(
            hidden, 2 * kernel_size * (hidden // group_size), bias=False
        )

    def prepare(self, x_NQH: torch.Tensor):
        """The convolution before the sublayer, and the dynamic taps of the one after it."""
        G = x_NQH.shape[-1] // self.group_size
        dyn = self.kernel_projection(x_NQH).view(*x_NQH.shape[:-1], 2, self.kernel_size, G)
        y = grouped_causal_conv(
            x_NQH, dyn[..., 0, :, :], self.base_kernel[0], self.group_size, self.block_size
        )
        return y, dyn[..., 1, :, :]

    def finish(self, y_NQH: torch.Tensor, dyn_NQCG: torch.Tensor) -> torch.Tensor:
        return grouped_causal_conv(
            y_NQH, dyn_NQCG, self.base_kernel[1], self.group_size, self.block_size
        )

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.kernel_projection.weight.zero_()
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0


class DFlash2Layer(DFlashLayer):
    def __init__(self, spec, layer_type: str):
        super().__init__(spec, layer_type)
        f = spec.variant_config
        args = (spec.hidden_size, f["conv_kernel_size"], f["conv_group_size"], spec.block_size)
        self.attention_conv = GroupedDynamicCausalConv(*args)
        self.mlp_conv = GroupedDynamicCausalConv(*args)

    def forward(self, h_NQH, ctx_kv, q_cos, q_sin, mask_N1QK):
        # the block's K/V come from the convolved input, as its queries do
        x, dyn = self.attention_conv.prepare(self.input_layernorm(h_NQH))
        a = self.self_attn(x, ctx_kv, q_cos, q_sin, mask_N1QK)
        h_NQH = h_NQH + self.attention_conv.finish(a, dyn)
        x, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h_NQH))
        return h_NQH + self.mlp_conv.finish(self.mlp(x), dyn)


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def candidates(self, logits_xV: torch.Tensor):
        """(unary logits, token ids) [..., K] of each position's top-K (`tiled_topk`: the values
        and order of ``torch.topk``, in two short passes over a wide vocabulary)."""
        return tiled_topk(logits_xV, min(self.top_k, logits_xV.shape[-1]))

    def forward(self, h_xH, unary_xK, cand_xK, prev_x):
        """Scores [..., K] of each position's candidates after the given predecessor tokens
        (all positions at once: teacher forcing). A module call, so a sharded wrapper (FSDP
        unit, ZeRO-3) gathers the codebooks for it."""
        return self._scores(self.hidden_projection(h_xH), unary_xK, cand_xK, prev_x)

    def _scores(self, proj_xR, unary_xK, cand_xK, prev_x):
        """The selector's scores from the projected hidden state: unary + the rank-r pair term
        of (predecessor, candidate); `forward` (every position at once) and `walk` (one step
        of the path at a time) share it."""
        gate = F.embedding(prev_x, self.predecessor_codebook) * proj_xR
        pair = torch.einsum("...r,...kr->...k", gate, F.embedding(cand_xK, self.successor_codebook))
        return unary_xK + pair.to(unary_xK.dtype)

    def walk(self, h_nDH, logits_nDV, anchor_n, temperature: float, generator=None):
        """The drafted path [n, D] from the anchor on, the candidates [n, D, K] and, at T > 0,
        the rows q [n, D, K] each step was drawn from (None at T = 0)."""
        unary, cand = self.candidates(logits_nDV)
        proj = self.hidden_projection(h_nDH)
        prev, path, rows = anchor_n, [], []
        for t in range(h_nDH.shape[1]):
            scores = self._scores(proj[:, t], unary[:, t], cand[:, t], prev)
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                pick = torch.multinomial(q, 1, generator=generator)[:, 0]
                rows.append(q)
            else:
                pick = scores.argmax(-1)
            prev = cand[:, t].gather(-1, pick[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, 1), cand, torch.stack(rows, 1) if rows else None


def _variant_only(name: str) -> bool:
    return "_conv." in name or name.startswith("candidate_selector.")


class DFlash2Drafter(DFlashDrafter):
    """Weights named as the published DFlash2 files: DFlash's plus layers.i.{attention,mlp}_conv.*
    and candidate_selector.*."""

    layer_cls = DFlash2Layer

    def __init__(self, spec):
        super().__init__(spec)
        f = spec.variant_config
        self.candidate_selector = CandidateSelector(
            spec.vocab_size, spec.hidden_size, f["selector_rank"], f["selector_top_k"]
        )

    @staticmethod
    def check_spec(spec) -> None:
        """What config.json / drafter.* must hold for DFlash2; ValueError naming the field."""
        f = spec.variant_config
        for key in FIELDS:
            if not isinstance(f.get(key), int) or f[key] < 1:
                raise ValueError(
                    f"DFlash2DraftModel needs dflash_config.{key} (drafter.{key}) as an integer "
                    f">= 1, got {f.get(key)!r}"
                )
        if spec.hidden_size % f["conv_group_size"]:
            raise ValueError(
                f"dflash_config.conv_group_size={f['conv_group_size']} (drafter.conv_group_size) "
                f"must divide the hidden size {spec.hidden_size}"
            )

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """DFlash's weights drawn first, in DFlash's order (the same seed gives a DFlash2 whose
        shared weights equal a DFlash drafter's), then the variant's; identity start."""
        named = list(self.named_parameters())
        self._init_params([(n, p) for n, p in named if not _variant_only(n)], std, generator)
        self._init_params([(n, p) for n, p in named if _variant_only(n)], std, generator)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        with torch.no_grad():
            self.candidate_selector.successor_codebook.zero_()

    def propose(self, h_nDH, logits_nDV, anchor_n, sampling=None, generator=None):
        """The selector's path; with sampling, q [n, D, V] is the drawn rows on the candidates
        (one-hot on the path at temperature 0)."""
        temperature = 0.0 if sampling is None else float(sampling.temperature)
        path, cand, rows = self.candidate_selector.walk(
            h_nDH, logits_nDV, anchor_n, temperature, generator
        )
        if sampling is None:
            return path, None
        q = torch.zeros_like(logits_nDV, dtype=torch.float32)
        if rows is None:
            return path, q.scatter_(-1, path[..., None], 1.0)
        return path, q.scatter_(-1, cand, rows)

    # The selector's rows at T=1 are sharper than how often their candidates are the target's
    # token given the prefix: at T = 1.5 the tree spends its budget wider. On a 20-minute
    # Qwen2.5-Coder-0.5B checkpoint (32 x 32, 2026-12-06; docs/evaluation.md#the-trees-temperature):
    # DDTree@64 7.918 against 7.679 at T=1 on HumanEval, 2.922 against 2.814 on ShareGPT.
    tree_temperature = 1.5

    def tree_scores(self, h_nDH, logits_nDV, anchor_n, temperature: float | None = None):
        """The selector's tree: (scores [n, D, P, K] of the K candidates at depth t+1 after each
        candidate p of depth t, the anchor at depth 0 (every p), divided by `temperature`
        (None: `tree_temperature`); candidates [n, D, K]). At temperature 1, q(. | p) =
        softmax(scores) are the T=1 rows of the path's walk; the tree is DDTree's best b
        prefixes over them (dflash.decoding.ddtree.TreeRows)."""
        sel = self.candidate_selector
        unary, cand = sel.candidates(logits_nDV)  # [n, D, K]
        n, _, K = cand.shape
        prev = torch.cat([anchor_n.view(n, 1, 1).expand(n, 1, K), cand[:, :-1]], 1)  # [n, D, P]
        proj = sel.hidden_projection(h_nDH)[:, :, None]  # [n, D, 1, r]
        scores = sel._scores(proj, unary[:, :, None], cand[:, :, None], prev)  # [n, D, P, K]
        t = self.tree_temperature if temperature is None else temperature
        return (scores if t == 1 else scores / t), cand

    def proposal(self, h_nDH, logits_nDV, prev_nD, sampling):
        """The step distributions when the path so far is prev_nD (teacher forcing)."""
        unary, cand = self.candidate_selector.candidates(logits_nDV)
        scores = self.candidate_selector(h_nDH, unary, cand, prev_nD)
        q = torch.zeros_like(logits_nDV, dtype=torch.float32)
        if sampling.temperature <= 0:
            return q.scatter_(-1, cand.gather(-1, scores.argmax(-1, keepdim=True)), 1.0)
        return q.scatter_(-1, cand, torch.softmax(scores.float() / sampling.temperature, -1))
