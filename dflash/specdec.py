"""Real speculative decoding with the target verifying (batch size 1, temperature 0).

Three decoders over the same HF target, all returning a `DecodeResult`:

- `generate_ar`: plain greedy decoding on the HF cache (the baseline, one token per forward).
- `generate_chain`: the z-lab `dflash_generate` loop. Prefill the target (aux states of the
  prompt captured by hooks on the aux layers, as `Target.capture` does), first token = argmax.
  Each round the drafter gets the block [bonus, MASK x (B-1)] at positions start..start+B-1 and
  a context of the aux features of all positions < start, kept as per-layer K/V
  (`DFlashDrafter.context_kv`) that only grows by the accepted positions. The drafted tokens
  (argmax at block positions 1..B-1) are verified in ONE target forward on its cache; accepted =
  leading matches of the draft with the target's argmax, the next bonus is the target's argmax
  at the first miss (or after the last draft), and the target cache is rolled back to the
  accepted length.
- `generate_tree`: DDTree. The best-`budget` tree of the drafter's per-position log-probs
  (`dflash.ddtree.build_ddtree`) is verified in one forward with depth-based positions and an
  ancestor-only 4D mask; the longest path matching the target's argmax is accepted and the
  attention cache is gathered to prefix + accepted path.

Cache rollback (DESIGN pitfall 8)
---------------------------------
Attention layers (`DynamicLayer`) roll back by cropping (chain) or gathering (tree) K/V along
the sequence. Gated-DeltaNet layers (`LinearAttentionLayer`: `conv_states[0]` = last
conv-kernel inputs, `recurrent_states[0]` = the delta-rule state, both updated *in place* by
a forward) cannot: `DynamicCache.crop()` raises on them unless `activate_past_recording()` was
called, and even then it only rolls back the conv window, never the recurrent state. So:

- chain on a hybrid target: the linear layers' conv/recurrent states are snapshotted (cloned)
  before the verify forward; on a partial acceptance they are restored, the attention layers
  are cropped back to the pre-verify length, and the accepted tokens (bonus + accepted drafts)
  are re-run through the target. Extra cost: one forward of accepted+1 tokens per round that
  does not accept the whole block (rounds that accept all B-1 drafts need no rollback).
- tree on a hybrid target: a recurrent layer cannot run a tree as one sequence, so every
  root-to-leaf path of the tree is verified as one row of a batch of chains (from a
  batch-expanded copy of the cache; the committed cache is not touched), the accepted path is
  found from the per-node argmaxes, and then the accepted tokens are run once on the committed
  cache. Cost per round: (#leaves) x (1 + max depth) verify tokens (vs 1 + budget for a real
  tree forward) plus a batch copy of the attention K/V, plus one forward of accepted+1 tokens.

`rollback="crop"` (chain only) is the naive alternative kept for the test that shows it is
wrong on hybrid targets: `activate_past_recording()` + `cache.crop(-n)` (conv states rolled
back, recurrent states not).

End-of-generation convention: at most `max_new_tokens` tokens are produced; in the last round
acceptance is capped at the number of tokens still needed (remaining = max_new_tokens -
generated). This is the offline walk's convention (`dflash.metrics.walk_chain`: avail =
min(D, L-1-i)), so a run with max_new_tokens = L visits the same rounds as the offline walk
of an L-token completion.

Numerics: "identical to greedy" holds up to floating-point near-ties. Verification runs B
tokens (on hybrid targets through the chunked Gated-DeltaNet kernel), AR decoding one token at
a time (the recurrent kernel), and a tree forward uses a masked attention over extra keys; if
the target's top-2 logits are closer than that arithmetic noise, the two can pick different
tokens. Greedy tokens come from the decoder's last hidden state through `lm_head` in chunks
(`Target.greedy_from_hidden`, the path of the training labels), never the full logits.

Legend: P prompt length, B block size, D = B-1 drafted positions, b tree budget, V vocab.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .blocks import block_attention_mask, mask_rules
from .ddtree import build_ddtree

__all__ = [
    "DecodeResult",
    "OracleDrafter",
    "generate_ar",
    "generate_chain",
    "generate_tree",
    "new_cache",
    "is_hybrid_cache",
]


# ----------------------------------------------------------------------------- result
@dataclass
class DecodeResult:
    mode: str  # "ar", "chain", "tree@b"
    tokens: list  # generated tokens (prompt excluded)
    accepted: list = field(default_factory=list)  # accepted drafted tokens per verify round
    wall_s: float = 0.0  # prefill + decoding
    prefill_s: float = 0.0
    drafts: list = field(default_factory=list)  # chain: drafted tokens per round (D each)
    tree_sizes: list = field(default_factory=list)  # tree: nodes verified per round
    verify_tokens: int = 0  # tokens run through the target after prefill

    @property
    def num_rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean accepted + 1 (the bonus) over verify rounds; nan without rounds (AR)."""
        return sum(self.accepted) / len(self.accepted) + 1.0 if self.accepted else math.nan

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else math.nan

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "tokens": len(self.tokens),
            "rounds": self.num_rounds,
            "tau": self.tau,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "tokens_per_s": self.tokens_per_s,
            "verify_tokens": self.verify_tokens,
        }


# ----------------------------------------------------------------------------- cache helpers
def _cache_classes():
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
    )

    return DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin


def new_cache(model):
    """`DynamicCache(config=...)`: a bare DynamicCache() fails for qwen3_5 (hybrid layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _cache_kw(module) -> str:
    """The forward's cache argument: `cache` in transformers >= 5.24 (`past_key_values`
    deprecated), `past_key_values` before."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def is_hybrid_cache(cache) -> bool:
    """True if some layer holds linear-attention (conv/recurrent) state."""
    _, _, Lin = _cache_classes()
    return any(isinstance(layer, Lin) for layer in cache.layers)


def _linear_layers(cache):
    _, _, Lin = _cache_classes()
    return [layer for layer in cache.layers if isinstance(layer, Lin)]


def snapshot_linear_state(cache) -> list:
    """Clones of every linear-attention layer's conv/recurrent states (forwards update them
    in place, so references would not do)."""
    snap = []
    for layer in _linear_layers(cache):
        s = {}
        for i in range(layer.number_of_states):
            s[i] = (
                layer.conv_states[i].clone() if layer.is_conv_states_initialized[i] else None,
                layer.recurrent_states[i].clone()
                if layer.is_recurrent_states_initialized[i]
                else None,
                layer.has_previous_state[i],
            )
        snap.append(s)
    return snap


def restore_linear_state(cache, snap: list) -> None:
    for layer, s in zip(_linear_layers(cache), snap):
        for i, (conv, rec, prev) in s.items():
            if conv is not None:
                if layer.conv_states[i].shape == conv.shape:
                    layer.conv_states[i].copy_(conv)
                else:
                    layer.conv_states[i] = conv.clone()
            if rec is not None:
                layer.recurrent_states[i].copy_(rec)
            layer.has_previous_state[i] = prev


def crop_attention(cache, n: int) -> None:
    """Drop the last n positions of every attention layer's K/V; linear layers untouched."""
    if n <= 0:
        return
    Dyn, Slide, Lin = _cache_classes()
    for layer in cache.layers:
        if isinstance(layer, Slide):
            Slide.crop(layer, -n)
        elif isinstance(layer, Dyn):
            Dyn.crop(layer, -n)
        elif not isinstance(layer, Lin):
            raise NotImplementedError(f"cannot roll back cache layer {type(layer).__name__}")


def gather_attention(cache, keep_idx: torch.Tensor) -> None:
    """Keep only the sequence positions keep_idx (in order) of every attention layer."""
    Dyn, Slide, Lin = _cache_classes()
    for layer in cache.layers:
        if isinstance(layer, Slide):
            raise NotImplementedError(
                "tree verification on sliding-window cache layers is not supported"
            )
        if isinstance(layer, Dyn):
            if layer.is_initialized:
                idx = keep_idx.to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
        elif not isinstance(layer, Lin):
            raise NotImplementedError(f"cannot gather cache layer {type(layer).__name__}")


def expand_cache(model, cache, n: int):
    """A new cache holding n copies (batch) of the batch-1 `cache`; `cache` is left untouched."""
    from transformers.cache_utils import LinearAttentionLayer

    Dyn, Slide, Lin = _cache_classes()
    out = new_cache(model)
    for src, dst in zip(cache.layers, out.layers):
        if type(src) is not type(dst):
            raise NotImplementedError(f"cache layer {type(src).__name__} vs {type(dst).__name__}")
        if isinstance(src, Slide):
            raise NotImplementedError(
                "tree verification on sliding-window cache layers is not supported"
            )
        if isinstance(src, Lin):
            for i in range(src.number_of_states):
                conv = src.conv_states[i] if src.is_conv_states_initialized[i] else None
                rec = src.recurrent_states[i] if src.is_recurrent_states_initialized[i] else None
                rep = lambda t: t.repeat(n, *([1] * (t.dim() - 1)))  # noqa: E731
                conv_r = rep(conv) if conv is not None else None
                rec_r = rep(rec) if rec is not None else None
                # the linear part's initializer (mixed attention+linear layers dispatch on kwargs)
                LinearAttentionLayer.lazy_initialization(
                    dst,
                    conv_states=conv_r,
                    recurrent_states=rec_r,
                    state_idx=i,
                    conv_kernel_size=src.conv_kernel_size[i],
                )
                if conv_r is not None:
                    dst.conv_states[i].copy_(conv_r)
                if rec_r is not None:
                    dst.recurrent_states[i].copy_(rec_r)
                dst.has_previous_state[i] = src.has_previous_state[i]
        if isinstance(src, Dyn) and src.is_initialized:
            Dyn.update(dst, src.keys.repeat(n, 1, 1, 1), src.values.repeat(n, 1, 1, 1))
    return out


# ----------------------------------------------------------------------------- target forward
class _TargetRunner:
    """Target forwards on a cache, with aux states captured by hooks on the aux layers."""

    def __init__(self, target):
        self.target = target
        self.model = target.model
        self.decoder = target.model.get_decoder()
        self.cache_kw = _cache_kw(self.decoder)

    @torch.no_grad()
    def __call__(
        self,
        ids_NT: torch.Tensor,
        pos_NT: torch.Tensor,
        cache,
        attn_mask=None,
        want_aux: bool = True,
        last_only: bool = False,
    ):
        """Returns the target's greedy tokens [N, T] ([N, 1] with last_only) and aux [N, T, K*H]
        (or None). Runs the decoder and takes the argmax of lm_head in chunks
        (`Target.greedy_from_hidden`, as `Target.capture`), so the full [N, T, V] logits of a
        large tree batch are never held."""
        with self.target.tap_aux(enabled=want_aux) as taps:
            out = self.decoder(
                input_ids=ids_NT,
                position_ids=pos_NT,
                attention_mask=attn_mask,
                use_cache=True,
                **{self.cache_kw: cache},
            )
        final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if last_only:
            final = final[:, -1:]
        return self.target.greedy_from_hidden(final, 4096), taps.aux()


def _as_prompt(target, prompt_ids) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty")
    return ids.to(target.device)[None]


def _arange(start: int, n: int, device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device)[None]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- AR baseline
@torch.no_grad()
def generate_ar(
    target, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None
) -> DecodeResult:
    """Plain greedy decoding on the HF cache, one token per forward."""
    model, dev = target.model, target.device
    ids = _as_prompt(target, prompt_ids)
    P = ids.shape[1]
    _sync(dev)
    t0 = time.perf_counter()
    cache = new_cache(model)
    kw = _cache_kw(model)
    logits = model(
        input_ids=ids,
        position_ids=_arange(0, P, dev),
        use_cache=True,
        logits_to_keep=1,
        **{kw: cache},
    ).logits
    tok = int(logits[0, -1].argmax())
    _sync(dev)
    t_pre = time.perf_counter() - t0
    out = [tok]
    while len(out) < max_new_tokens and tok != eos_token_id:
        pos = P + len(out) - 1
        logits = model(
            input_ids=torch.tensor([[tok]], device=dev),
            position_ids=_arange(pos, 1, dev),
            use_cache=True,
            **{kw: cache},
        ).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
    _sync(dev)
    res = DecodeResult("ar", out[:max_new_tokens], wall_s=time.perf_counter() - t0, prefill_s=t_pre)
    res.verify_tokens = max(0, len(res.tokens) - 1)
    return res


# ----------------------------------------------------------------------------- drafter side
class _DrafterState:
    """The drafter's context K/V cache (positions 0..T-1) and one-block drafting."""

    def __init__(self, target, drafter):
        self.target, self.drafter, self.spec = target, drafter, drafter.spec
        p = next(drafter.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.ctx_kv: list | None = None
        self.T = 0

    @torch.no_grad()
    def append(self, aux_TF: torch.Tensor) -> None:
        """Context features of the next positions T..T+n-1 (only committed positions)."""
        n = aux_TF.shape[0]
        if n == 0:
            return
        pos = _arange(self.T, n, self.device)
        kv = self.drafter.context_kv(
            self.drafter.context(aux_TF.to(self.device, self.dtype)[None]), pos
        )
        if self.ctx_kv is None:
            self.ctx_kv = kv
        else:
            self.ctx_kv = [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                for (k0, v0), (k1, v1) in zip(self.ctx_kv, kv)
            ]
        self.T += n

    def masks(self, start: int) -> dict:
        """Per layer type bool [1, 1, B, start + B]: the training/eval rule of dflash.blocks
        (`dflash.spec.attention_rule`: context < anchor, then the layer's MaskRule)."""
        spec, dev = self.spec, self.device
        pos = torch.arange(start + 1, device=dev)[None]  # context + the anchor itself
        seg = torch.zeros_like(pos)
        anchors = torch.tensor([[start]], device=dev)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        out = {}
        for t, r in mask_rules(spec).items():
            m = block_attention_mask(
                anchors,
                valid,
                pos,
                seg,
                spec.block_size,
                causal_in_block=r.causal_in_block,
                window=r.window,
                window_both_sides=r.window_both_sides,
            )
            out[t] = torch.cat(
                [m[..., :start], m[..., start + 1 :]], dim=-1
            )  # drop the anchor column
        return out

    @torch.no_grad()
    def draft_logits(self, start: int, bonus: int) -> torch.Tensor:
        """float32 logits [D, V] of block positions 1..B-1 for the block anchored at `start`."""
        if self.T != start:
            raise AssertionError(
                f"drafter context holds {self.T} positions, block anchored at {start}"
            )
        B, dev = self.spec.block_size, self.device
        ids = torch.full(
            (1, B), self.spec.mask_token_id, dtype=torch.long, device=self.target.device
        )
        ids[0, 0] = bonus
        emb = self.target.embed_tokens(ids).to(dev, self.dtype)
        h = self.drafter(emb, _arange(start, B, dev), self.masks(start), ctx_kv=self.ctx_kv)[0, 1:]
        W = self.target.lm_head.weight
        return self.drafter.logits(h.to(W.device), W)


def _leading_matches(draft: torch.Tensor, tgt: torch.Tensor) -> int:
    m = (draft == tgt).long()
    return int(m.cumprod(0).sum())


# ----------------------------------------------------------------------------- chain
@torch.no_grad()
def generate_chain(
    target,
    drafter,
    prompt_ids,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    rollback: str = "auto",
    draft_fn: Callable | None = None,
) -> DecodeResult:
    """Chain speculative decoding (z-lab `dflash_generate`); output identical to greedy.

    rollback: "auto" (crop attention; snapshot/restore + re-run for linear-attention layers) or
    "crop" (transformers' `cache.crop` only: wrong on hybrid targets, kept to show it).
    draft_fn(drafter_state, start, bonus) -> logits [D, V]: override for tests.
    """
    if rollback not in ("auto", "crop"):
        raise ValueError(f"rollback={rollback!r}; choose auto or crop")
    model, dev = target.model, target.device
    run = _TargetRunner(target)
    ids = _as_prompt(target, prompt_ids)
    P = ids.shape[1]
    B = drafter.spec.block_size
    _sync(dev)
    t0 = time.perf_counter()
    cache = new_cache(model)
    hybrid = is_hybrid_cache(cache)
    if rollback == "crop" and hybrid:
        cache.activate_past_recording()
    greedy, aux = run(ids, _arange(0, P, dev), cache, last_only=True)
    out = [int(greedy[0, -1])]
    ds = _DrafterState(target, drafter)
    ds.append(aux[0])
    _sync(dev)
    res = DecodeResult("chain", [], prefill_s=time.perf_counter() - t0)
    start = P
    draft_fn = draft_fn or (lambda st, s, b: st.draft_logits(s, b))
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        bonus = out[-1]
        draft = draft_fn(ds, start, bonus).argmax(-1).to(dev)  # [D]
        block = torch.cat([torch.tensor([bonus], device=dev), draft])[None]
        snap = snapshot_linear_state(cache) if hybrid and rollback == "auto" else None
        greedy, aux = run(block, _arange(start, B, dev), cache)
        res.verify_tokens += B
        tgt = greedy[0]  # [B]
        acc = min(_leading_matches(draft, tgt[:-1]), max_new_tokens - len(out))
        new = draft[:acc].tolist() + [int(tgt[acc])]
        keep = acc + 1  # bonus + accepted drafts
        if keep < B:
            if rollback == "crop":
                cache.crop(-(B - keep))
            elif hybrid:
                restore_linear_state(cache, snap)
                crop_attention(cache, B)
                run(
                    block[:, :keep],
                    _arange(start, keep, dev),
                    cache,
                    want_aux=False,
                    last_only=True,
                )
                res.verify_tokens += keep
            else:
                crop_attention(cache, B - keep)
        elif rollback == "crop" and hybrid:
            cache.crop(0)  # trims the recorded conv window back to the kernel size
        ds.append(aux[0, :keep])
        res.accepted.append(acc)
        res.drafts.append(draft.tolist())
        out.extend(new)
        start += keep
        if eos_token_id is not None and eos_token_id in new:
            break
    _sync(dev)
    res.tokens = _finish(out, max_new_tokens, eos_token_id)
    res.wall_s = time.perf_counter() - t0
    return res


def _finish(out: list, max_new_tokens: int, eos_token_id: int | None) -> list:
    out = out[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in out:
        out = out[: out.index(eos_token_id) + 1]
    return out


# ----------------------------------------------------------------------------- tree
def _tree_verify_mask(tree, start: int, dtype, device) -> torch.Tensor:
    """Additive float mask [1, 1, 1+b, start+1+b]: every row sees the committed prefix and the
    bonus (root); node rows see their ancestors and themselves; the bonus row sees only the
    prefix and itself."""
    b = tree.num_nodes
    allowed = torch.zeros(1 + b, start + 1 + b, dtype=torch.bool, device=device)
    allowed[:, : start + 1] = True
    allowed[1:, start + 1 :] = tree.visibility.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _tree_forward(run, cache, tree, bonus: int, start: int):
    """One target forward over [bonus, tree nodes] appended to the cache (which holds positions
    0..start-1): positions start + depth, ancestor-only mask. Returns greedy [1, 1+b] and aux."""
    dev = run.target.device
    block = torch.cat([torch.tensor([bonus]), tree.tokens]).to(dev)[None]
    pos = (start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])).to(dev)[None]
    mask = _tree_verify_mask(tree, start, run.model.dtype, dev)
    return run(block, pos, cache, attn_mask=mask)


def _walk_tree(tree, node_argmax: list, root_argmax: int, cap: int) -> tuple[list, int]:
    """Longest root path whose tokens are the target's argmax; returns (node path, next bonus)."""
    children = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children[(p, t)] = i
    path, nxt = [], root_argmax
    node = -1
    while len(path) < cap:
        child = children.get((node, nxt))
        if child is None:
            break
        path.append(child)
        node = child
        nxt = node_argmax[child]
    return path, nxt


def _root_to_leaf_paths(tree) -> list:
    parents = tree.parents.tolist()
    has_child = set(p for p in parents if p >= 0)
    paths = []
    for i in range(len(parents)):
        if i in has_child:
            continue
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


@torch.no_grad()
def generate_tree(
    target,
    drafter,
    prompt_ids,
    max_new_tokens: int,
    budget: int,
    *,
    eos_token_id: int | None = None,
    draft_fn: Callable | None = None,
) -> DecodeResult:
    """DDTree speculative decoding; output identical to greedy.

    Attention-only targets: one forward over [bonus, tree nodes] with depth positions and the
    ancestor-only mask, then the K/V of prefix + bonus + accepted nodes are gathered in order.
    Hybrid targets: root-to-leaf paths verified as a batch of chains (see module docstring).
    """
    model, dev = target.model, target.device
    run = _TargetRunner(target)
    ids = _as_prompt(target, prompt_ids)
    P = ids.shape[1]
    _sync(dev)
    t0 = time.perf_counter()
    cache = new_cache(model)
    hybrid = is_hybrid_cache(cache)
    greedy, aux = run(ids, _arange(0, P, dev), cache, last_only=True)
    out = [int(greedy[0, -1])]
    ds = _DrafterState(target, drafter)
    ds.append(aux[0])
    _sync(dev)
    res = DecodeResult(f"tree@{budget}", [], prefill_s=time.perf_counter() - t0)
    start = P
    draft_fn = draft_fn or (lambda st, s, b: st.draft_logits(s, b))
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        bonus = out[-1]
        lp = torch.log_softmax(draft_fn(ds, start, bonus), -1)
        tree = build_ddtree(lp, budget)
        b = tree.num_nodes
        cap = max_new_tokens - len(out)
        if not hybrid:
            greedy, aux = _tree_forward(run, cache, tree, bonus, start)
            res.verify_tokens += 1 + b
            am = greedy[0].tolist()
            path, nxt = _walk_tree(tree, am[1:], am[0], cap)
            rows = [0] + [1 + i for i in path]
            keep_idx = torch.cat(
                [torch.arange(start + 1), start + 1 + torch.tensor(path, dtype=torch.long)]
            )
            gather_attention(cache, keep_idx)
            new_aux = aux[0, rows]
        else:
            path, nxt, n_tok = _verify_tree_as_paths(
                run, model, cache, tree, bonus, start, cap, dev
            )
            res.verify_tokens += n_tok
            acc_ids = torch.tensor([[bonus] + tree.tokens[path].tolist()], device=dev)
            _, aux = run(acc_ids, _arange(start, acc_ids.shape[1], dev), cache, last_only=True)
            res.verify_tokens += acc_ids.shape[1]
            new_aux = aux[0]
        acc = len(path)
        ds.append(new_aux)
        res.accepted.append(acc)
        res.tree_sizes.append(b)
        new = tree.tokens[path].tolist() + [int(nxt)]
        out.extend(new)
        start += acc + 1
        if eos_token_id is not None and eos_token_id in new:
            break
    _sync(dev)
    res.tokens = _finish(out, max_new_tokens, eos_token_id)
    res.wall_s = time.perf_counter() - t0
    return res


def _verify_tree_as_paths(run, model, cache, tree, bonus: int, start: int, cap: int, dev):
    """Hybrid targets: each root-to-leaf path is one row [bonus, path..., pad] of a batch run
    from a batch copy of the committed cache (right padding is harmless: causal). Returns the
    accepted node path, the next bonus token and the number of tokens run."""
    paths = _root_to_leaf_paths(tree)
    if not paths:  # empty tree: only the bonus row
        paths = [[]]
    L = 1 + max(len(p) for p in paths)
    toks = tree.tokens.tolist()
    rows = torch.full((len(paths), L), bonus, dtype=torch.long)
    for r, p in enumerate(paths):
        rows[r, 1 : 1 + len(p)] = torch.tensor([toks[i] for i in p], dtype=torch.long)
    bcache = expand_cache(model, cache, len(paths))
    pos = _arange(start, L, dev).expand(len(paths), L)
    greedy, _ = run(rows.to(dev), pos, bcache, want_aux=False)
    am = greedy.tolist()
    node_argmax = [0] * tree.num_nodes
    for r, p in enumerate(paths):
        for j, i in enumerate(p):
            node_argmax[i] = am[r][j + 1]
    path, nxt = _walk_tree(tree, node_argmax, am[0][0], cap)
    return path, nxt, len(paths) * L


# ----------------------------------------------------------------------------- test instrument
class OracleDrafter(torch.nn.Module):
    """A test/benchmark instrument, not a drafter: a real `DFlashDrafter` (its context, masks
    and K/V path run unchanged) whose output hidden state is pushed towards known tokens.

    `truth[p]` is the token at absolute position p (prompt + the target's greedy completion).
    For the block anchored at position p, drafted position k (1..B-1) is labelled by a
    deterministic hash of (p, k, seed):
      hit     the truth token becomes the clear argmax (+`strength` logits),
      second  a decoy token (truth+1) becomes the argmax and the truth the runner-up
              (chain misses, a DDTree with a branch there can still accept),
      miss    untouched: the base drafter's own (context-dependent) argmax.
    pattern "mixed": a leading streak s(p) of hits, s = clamp(u - 2, 0, D) with u uniform over
    0..D+4 (zero, partial and full-block acceptances), then a mix; "full": every position a hit; "none":
    the base drafter unchanged. Positions past the end of `truth` are untouched.
    Exposes the `DFlashDrafter` interface used by decoding and evaluation (spec, context,
    context_kv, forward), so offline evaluation and real decoding see the same drafter.
    """

    HIT, SECOND, MISS = 0, 1, 2

    def __init__(
        self,
        base,
        lm_head_weight: torch.Tensor,
        truth: Sequence[int] = (),
        pattern: str = "mixed",
        seed: int = 0,
        strength: float = 10.0,
    ):
        super().__init__()
        if pattern not in ("mixed", "full", "none"):
            raise ValueError(f"pattern={pattern!r}")
        self.base, self.spec = base, base.spec
        self.pattern, self.seed, self.strength = pattern, int(seed), float(strength)
        W = lm_head_weight.detach()
        self.register_buffer(
            "dirs", W / W.pow(2).sum(-1, keepdim=True), persistent=False
        )  # dirs[t].W[t] = 1
        self.truth = list(truth)

    def _h(self, p: int, k: int) -> int:
        x = (p * 0x9E3779B1 + k * 0x85EBCA77 + self.seed * 0xC2B2AE3D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        return x ^ (x >> 12)

    def label(self, p: int, k: int) -> int:
        if self.pattern == "full":
            return self.HIT
        if self.pattern == "none":
            return self.MISS
        D = self.spec.block_size - 1
        s = min(max(self._h(p, 0) % (D + 5) - 2, 0), D)  # P(0) = P(D) = 3/(D+5)
        if k <= s:
            return self.HIT
        if k == s + 1:
            return self.SECOND if self._h(p, 1) % 2 == 0 else self.MISS
        return self._h(p, k) % 3

    def context(self, aux):
        return self.base.context(aux)

    def logits(self, h, lm_head_w):
        return self.base.logits(h, lm_head_w)

    def context_kv(self, ctx, pos):
        return self.base.context_kv(ctx, pos)

    def forward(
        self, block_emb_NQH, block_pos_NQ, masks, aux_NTF=None, ctx_pos_NT=None, ctx_kv=None
    ):
        h = self.base(
            block_emb_NQH,
            block_pos_NQ,
            masks,
            aux_NTF=aux_NTF,
            ctx_pos_NT=ctx_pos_NT,
            ctx_kv=ctx_kv,
        )
        if self.pattern == "none" or not self.truth:
            return h
        B, V = self.spec.block_size, self.dirs.shape[0]
        add = torch.zeros_like(h)
        pos = block_pos_NQ.tolist()
        for n, row in enumerate(pos):
            for q in range(len(row)):
                k = q % B
                if k == 0:
                    continue
                p = row[q - k]
                t = p + k
                if t >= len(self.truth):
                    continue
                tok = int(self.truth[t])
                lab = self.label(p, k)
                if lab == self.HIT:
                    add[n, q] = self.strength * self.dirs[tok].to(h.dtype)
                elif lab == self.SECOND:
                    add[n, q] = self.strength * (
                        0.6 * self.dirs[tok] + 0.8 * self.dirs[(tok + 1) % V]
                    ).to(h.dtype)
        return h + add
