"""Drafter weights that start from the target's (`drafter.init_layers_from_target`,
`drafter.init_norm_from_target`): an initialisation only; the serving format is unchanged.

A drafter with the target's widths (the default: heads, head_dim, hidden and MLP sizes are the
target's) can start each of its layers as a copy of one target decoder layer: attention
projections, MLP and the two norms. The drafter's q/k norms start at the target's when it has
them (Qwen3) and at ones otherwise (Qwen2); target biases the drafter does not have are dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from ..target.capture import norm_gain

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def warm_start(drafter: nn.Module, target, dcfg, log) -> None:
    """Apply drafter.init_norm_from_target / init_layers_from_target (skipped with
    drafter.init_from, whose weights replace them; a resumed run loads its own over them)."""
    if dcfg.init_from:
        return
    for option, needs, what in (
        ("init_norm_from_target", "final_norm_gain", "final norm"),
        ("init_layers_from_target", "decoder_layers", "layers"),
    ):
        if getattr(dcfg, option) and not hasattr(target, needs):
            raise ValueError(
                f"drafter.{option} needs the target's {what}, which split trainer ranks do not "
                "load; use topology=colocated or drop the option"
            )
    if dcfg.init_norm_from_target:
        with torch.no_grad():
            drafter.norm.weight.copy_(target.final_norm_gain())
    if dcfg.init_layers_from_target:
        log(copy_target_layers(drafter, target, dcfg.init_layers_from_target))


def copy_target_layers(drafter: nn.Module, target, layer_ids) -> str:
    """Drafter layer i := target decoder layer layer_ids[i] (negative ids count from the end).
    Returns the line for the log; a layer that does not fit is refused with its names."""
    layers = target.decoder_layers()
    ids = [
        int(i) % len(layers) if -len(layers) <= int(i) < len(layers) else None for i in layer_ids
    ]
    if None in ids or len(ids) != len(drafter.layers):
        raise ValueError(
            f"drafter.init_layers_from_target={list(layer_ids)}: give one id per drafter layer "
            f"({len(drafter.layers)}), each in [-{len(layers)}, {len(layers) - 1}] (the target has "
            f"{len(layers)} layers)"
        )
    dropped = set()
    with torch.no_grad():
        for mine, lid in zip(drafter.layers, ids):
            theirs = layers[lid]
            for name in _LINEARS:
                a, b = mine.get_submodule(name), _find(theirs, name, lid)
                if a.weight.shape != b.weight.shape:
                    raise ValueError(
                        f"drafter.init_layers_from_target: {name} is {tuple(a.weight.shape)} in "
                        f"the drafter but {tuple(b.weight.shape)} in target layer {lid}; leave the "
                        "drafter's widths (heads, head_dim, intermediate_size) at the target's"
                    )
                a.weight.copy_(b.weight)
                if a.bias is not None:
                    a.bias.copy_(b.bias if b.bias is not None else torch.zeros_like(a.bias))
                elif b.bias is not None:
                    dropped.add(name.split(".")[-1])
            for name in _NORMS:
                try:
                    src = theirs.get_submodule(name)
                except AttributeError:
                    continue  # no q/k norm in the target (Qwen2, Llama): ones
                dst = mine.get_submodule(name)
                dst.weight.copy_(norm_gain(src, dst.weight.numel()))
    line = f"drafter: layers start from target layers {ids}"
    if dropped:
        line += f" (the target's {'/'.join(sorted(dropped))} biases dropped: drafter.attention_bias=false)"
    return line


def _find(layer: nn.Module, name: str, lid: int) -> nn.Module:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"drafter.init_layers_from_target: target layer {lid} has no {name} (a linear-attention "
            "layer?); name full-attention layers of the target"
        ) from None
