"""What the drafter needs of the frozen target: its shape (`TargetShape`) and its input
embedding + LM head (`Heads`). Both the full target (`dflash.target.Target.shape`) and the
trainer ranks' heads-only loader (`dflash.split.heads`) return them, so the drafter is built
the same way whichever side holds the target."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
    """The target's frozen input embedding and LM head, shared by the drafter."""

    embed: nn.Embedding
    lm_head: nn.Linear
