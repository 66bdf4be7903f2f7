"""Surgery on transformers' DynamicCache: snapshot/restore of linear-attention state, crop and
gather of attention K/V, batch expansion (see the package docstring for why each is needed)."""

from __future__ import annotations

import torch


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


def cache_kw(module) -> str:
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
