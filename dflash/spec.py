"""The drafter's full shape from its config group and the target's shape."""

from __future__ import annotations

from .config import DrafterConfig
from .drafter import DrafterSpec
from .shape import TargetShape
from .target import check_layer_ids, default_layer_ids


def resolve_spec(dcfg: DrafterConfig, shape: TargetShape) -> DrafterSpec:
    """drafter.* fields left null copy the target's; the hidden size must equal the target's
    (the drafter shares its embedding and lm_head)."""
    L, hidden, vocab = shape.num_layers, shape.hidden_size, shape.vocab_size
    ids = dcfg.target_layer_ids
    ids = check_layer_ids(ids if ids is not None else default_layer_ids(L, dcfg.num_aux_layers), L)
    if dcfg.hidden_size is not None and dcfg.hidden_size != hidden:
        raise ValueError(
            f"drafter.hidden_size={dcfg.hidden_size} but the target's hidden size is "
            f"{hidden}; the drafter shares the target's embedding and lm_head, so they "
            "must match (leave drafter.hidden_size=null to copy it)"
        )
    if not 0 <= shape.mask_token_id < vocab:
        raise ValueError(f"mask token id {shape.mask_token_id} is not < vocab size {vocab}")
    heads = dcfg.num_attention_heads or shape.num_attention_heads
    return DrafterSpec(
        hidden_size=hidden,
        intermediate_size=dcfg.intermediate_size or shape.intermediate_size,
        num_hidden_layers=dcfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=dcfg.num_key_value_heads or shape.num_key_value_heads or heads,
        head_dim=dcfg.head_dim or hidden // heads,
        vocab_size=vocab,
        block_size=dcfg.block_size,
        mask_token_id=shape.mask_token_id,
        target_layer_ids=ids,
        num_target_layers=L,
        layer_types=list(dcfg.layer_types or ["full_attention"] * dcfg.num_layers),
        sliding_window=dcfg.sliding_window,
        rms_norm_eps=dcfg.rms_norm_eps,
        rope_theta=dcfg.rope_theta,
        max_position_embeddings=dcfg.max_position_embeddings,
    )
