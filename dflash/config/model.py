"""Schemas of the `target` and `drafter` config groups (conf/target/, conf/drafter/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import check_at_least_one, check_choice

LINEAR_ATTN_BACKENDS = ("auto", "fla", "torch")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# How the target runs the training capture, not what any forward computes: the regenerated data
# and the eval sets (eager, one row at a time) are the same under any value, so neither cache's
# name depends on them (changing one reuses both caches).
TARGET_EXECUTION_ONLY = (
    "check_memory",
    "packed_capture",
    "capture_graphs",
    "compile_layers",
    "compile_gdn",
)
# How the target computes, which a resumed run may change (another machine may lack a kernel):
# unlike the settings above they change the numerics, so the text at near-ties, and they name
# both caches; a resumed run reads the data cache it trained on (dflash.train.build).
TARGET_RESUMABLE = ("attn_implementation", "linear_attn_backend")
# Drafter variants, the names of dflash.drafter.variants.VARIANTS (a test keeps the two equal).
DRAFTER_VARIANTS = ("dflash", "dflash2")


@dataclass
class TargetConfig:
    """The frozen target LLM.

    Exactly one of `path` (a local Hugging Face directory or GGUF folder) and `config`
    (a HF config dict: random weights, for tests, demos and benchmarks) must be set.
    """

    name: str = "tiny_qwen3_5"  # label in logs and caches
    path: str | None = None  # local HF directory or GGUF folder
    gguf_file: str | None = None  # GGUF file inside path (converted once)
    config: dict[str, Any] | None = None  # HF config dict: random weights
    init_seed: int = 0  # seed of random weights
    init_std: float | None = None  # random weights: override initializer_range
    # Random weights: LM head x this after init (same greedy text; logits spread realistically)
    lm_head_scale: float = 1.0
    # Config-built targets: "bytes" = the built-in byte-level tokenizer with a chat template
    # (dflash.target.tokenizer; text data sources offline), null = none (data.source=selfgen only).
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if present, else cpu
    linear_attn_backend: str = "auto"  # auto | fla | torch (Gated-DeltaNet kernels)
    attn_implementation: str = "sdpa"  # transformers attention kernel
    # Attention-only targets with sdpa / eager / flex attention: samples share rows in the clean
    # capture, checked once against one sample per row on the first batch with a shared row
    packed_capture: bool = True
    capture_graphs: bool = True  # CUDA, full-attention SDPA targets: packed capture as CUDA graphs
    compile_layers: bool = False  # CUDA: decoder layers torch.compiled for the clean capture
    # What compile_layers compiles of a Gated-DeltaNet layer: layer (the whole layer, its fla
    # kernels called outside the compiled graphs; the 27B forward 1.19x eager, 75 % of the matmul
    # peak on an H100) or mlp (its MLP only: 1.05x)
    compile_gdn: str = "layer"
    # Drafter mask token (a special id that never occurs in text). None: the tokenizer's mask
    # token, or vocab_size-1 for tokenizer-less random targets.
    mask_token_id: int | None = None
    # Text conventions of the target: the same settings are used for regenerated training data
    # and for eval prompts, so the drafter is judged on text formatted as it was trained on.
    chat_template: bool = False
    enable_thinking: bool = False  # chat template's thinking switch
    check_memory: bool = True  # refuse at start-up a target whose weights exceed free memory

    def validate(self) -> None:
        check_choice("target.linear_attn_backend", self.linear_attn_backend, LINEAR_ATTN_BACKENDS)
        check_choice("target.dtype", self.dtype, DTYPES)
        check_choice("target.compile_gdn", self.compile_gdn, ("mlp", "layer"))
        if self.path is None and self.config is None:
            raise ValueError(
                f"target.path is not set (target={self.name}): set target.path=/path/to/the/"
                "weights (a local Hugging Face directory; nothing is downloaded at run time), or pick "
                "a tiny random target, e.g. target=tiny_qwen3_5"
            )
        if self.path is not None and self.config is not None:
            raise ValueError(
                "target: set exactly one of target.path (local weights) and target.config "
                f"(random weights from a config); got path={self.path!r}, "
                f"config={'set' if self.config else None}"
            )


@dataclass
class DrafterConfig:
    # dflash (z-lab DFlashDraftModel) | dflash2 (DFlash2DraftModel: grouped dynamic causal
    # convolutions around attention and MLP, and a top-k candidate selector that picks the path)
    variant: str = "dflash"
    num_layers: int = 1  # decoder layers
    # Per-layer attention type; None = all full_attention. Full layers are bidirectional inside
    # the block, sliding layers causal inside the block with `sliding_window`.
    layer_types: list[str] | None = None
    sliding_window: int = 2048  # tokens seen by sliding layers
    # Target layers feeding the drafter (layer l = output of decoder layer l = HF
    # hidden_states[l + 1]). None = `num_aux_layers` evenly spaced over 1..L-3.
    target_layer_ids: list[int] | None = None
    num_aux_layers: int = 5  # aux layers when ids are None
    block_size: int = 16  # anchor + drafted positions
    mask_token_id: int | None = None  # None: target.mask_token_id (see there)
    # Shape; None = copy from the target.
    hidden_size: int | None = None  # None: the target's
    intermediate_size: int | None = None  # MLP width; None: target's
    num_attention_heads: int | None = None  # None: target's
    num_key_value_heads: int | None = None  # None: target's
    head_dim: int | None = None  # None: target's
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 1_000_000.0  # RoPE base
    max_position_embeddings: int = 32768  # longest position
    # config.json's rope scaling (dflash.drafter.spec): transformers' rope_parameters minus rope_theta,
    # e.g. {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}.
    rope_scaling: dict[str, Any] | None = None
    # set: every layer causal (true) / bidirectional (false) in the block
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0  # scales token embeddings
    output_multiplier: float = 1.0  # scales final hidden
    final_logit_softcapping: float | None = None  # tanh cap on logits
    attention_bias: bool = False  # bias in q/k/v/o
    hidden_act: str = "silu"  # MLP activation
    init_std: float = 0.02  # init std of weights
    init_norm_from_target: bool = False  # final norm starts at the target's gain (else ones)
    # Drafter layer i starts as a copy of target layer ids[i] (negative: from the end; same widths)
    init_layers_from_target: list[int] | None = None
    init_from: str | None = None  # start from a drafter checkpoint directory (serving format)
    # drafter.variant=dflash2 only (config.json dflash_config fields of the same names):
    conv_kernel_size: int = 2  # taps of each in-block causal convolution (self + predecessors)
    conv_group_size: int = 16  # channels sharing one dynamic tap (must divide the hidden size)
    selector_rank: int = 256  # width of the selector's token codebooks and hidden projection
    selector_top_k: int = 16  # candidates per block position the selector chooses among

    def validate(self) -> None:
        check_choice("drafter.variant", self.variant, DRAFTER_VARIANTS)
        check_at_least_one(
            "drafter", self, "conv_kernel_size conv_group_size selector_rank selector_top_k"
        )
        if self.block_size < 2:
            raise ValueError(
                f"drafter.block_size must be >= 2 (the anchor plus at least one drafted "
                f"position), got {self.block_size}"
            )
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"drafter.layer_types has {len(self.layer_types)} entries but "
                    f"drafter.num_layers={self.num_layers}; give one of {LAYER_TYPES} per layer"
                )
            for i, t in enumerate(self.layer_types):
                check_choice(f"drafter.layer_types[{i}]", t, LAYER_TYPES)
            if "sliding_attention" in self.layer_types and self.sliding_window < self.block_size:
                raise ValueError(
                    f"drafter.sliding_window={self.sliding_window} is smaller than "
                    f"drafter.block_size={self.block_size}; a sliding layer must see its whole "
                    "block prefix"
                )
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads and kv and heads % kv:
            raise ValueError(
                f"drafter.num_attention_heads={heads} must be a multiple of "
                f"drafter.num_key_value_heads={kv} (each key/value head serves a whole group)"
            )
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(
                f"drafter.head_dim={self.head_dim} must be even (the rotary embedding rotates "
                "pairs of dimensions)"
            )
