"""What the drafter needs of the frozen target: its shape (`TargetShape`) and its input
embedding + LM head (`Heads`). Both the full target (`Target.shape`) and the
trainer ranks' heads-only loader (`dflash.train.split.heads`) return them, so the drafter is built
the same way whichever side holds the target. Also the aux-layer id rules both sides check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TargetShape:
    num_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int  # 0: the config does not say (the drafter then uses its heads)
    dtype: torch.dtype
    mask_token_id: int
    layer_ids: tuple[int, ...]  # the aux layers the drafter reads

    @classmethod
    def from_hf_config(
        cls, config, *, vocab_size: int, dtype: torch.dtype, mask_token_id: int, layer_ids
    ) -> TargetShape:
        """From a Hugging Face (text) config; fields a config may lack get the usual defaults."""
        hidden = int(config.hidden_size)
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=hidden,
            vocab_size=int(vocab_size),
            intermediate_size=int(getattr(config, "intermediate_size", 4 * hidden)),
            num_attention_heads=int(getattr(config, "num_attention_heads", 8)),
            num_key_value_heads=int(getattr(config, "num_key_value_heads", 0) or 0),
            dtype=dtype,
            mask_token_id=int(mask_token_id),
            layer_ids=tuple(int(i) for i in layer_ids),
        )


@dataclass
class Heads:
    """The target's frozen input embedding and LM head, shared by the drafter and used as the
    reference drafter uses them: the embedding's table read directly (`embed_ids`; a module that
    scales its output, as Gemma's does by sqrt(H), is not called) and the head with its bias
    (`bias`, None when it has none), as `lm_head(h)` gives the target's own logits."""

    embed: nn.Embedding
    lm_head: nn.Linear

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_table(self.embed, ids)

    @property
    def bias(self) -> torch.Tensor | None:
        return head_bias(self.lm_head)


def embed_table(embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's block input embeddings: rows of the target's table (the reference's
    F.embedding(ids, weight)), whatever the embedding module's forward adds."""
    return F.embedding(ids, embed.weight)


def head_bias(lm_head: nn.Module) -> torch.Tensor | None:
    b = getattr(lm_head, "bias", None)
    return b.detach() if b is not None else None


def default_layer_ids(num_target_layers: int, num_aux: int) -> list[int]:
    """Evenly spaced over 1..L-3 (z-lab's rule): [1, 16, 31, 46, 61] for 64 layers, 5 aux."""
    if num_aux == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if num_aux > end - start + 1:
        raise ValueError(
            f"drafter.num_aux_layers={num_aux}: a {num_target_layers}-layer target has "
            f"{max(end - start + 1, 0)} layers to spread them over (1..{end}); lower it, or list "
            f"drafter.target_layer_ids (any distinct ids <= {num_target_layers - 2})"
        )
    return [int(round(start + i * (end - start) / (num_aux - 1))) for i in range(num_aux)]


def check_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Refuse out-of-range ids and the final layer (its output is the target's logits: a
    shortcut that does not exist at inference)."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("drafter.target_layer_ids is empty; give at least one target layer id")
    bad = [i for i in ids if i < 0 or i >= num_target_layers]
    if bad:
        raise ValueError(
            f"drafter.target_layer_ids {bad} out of range for a target with "
            f"{num_target_layers} layers (valid: 0..{num_target_layers - 2})"
        )
    if num_target_layers - 1 in ids:
        raise ValueError(
            f"drafter.target_layer_ids contains {num_target_layers - 1}, the target's final layer: "
            "its output produces the target logits, so the drafter would learn a shortcut that does "
            f"not exist at inference. Use ids <= {num_target_layers - 2} (default: evenly spaced over "
            f"1..{num_target_layers - 3})"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"drafter.target_layer_ids has duplicates: {ids}")
    return ids
