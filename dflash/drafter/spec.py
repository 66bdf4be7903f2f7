"""The drafter's resolved shape and semantics, and its serving-format `config.json`.

`DrafterSpec.from_hf_config` reads every field the current z-lab reference (`DFlashDraftModel`,
2026) reads, with the reference's precedence: DFlash knobs come from `dflash_config` first, then
the top level; everything Qwen3 (rope, sliding window, layer types) is interpreted as
transformers' `Qwen3Config` interprets it. The architecture names the variant
(dflash.drafter.variants: DFlashDraftModel, DFlash2DraftModel) and its own dflash_config fields;
what we cannot run as the reference does (other architectures, a variant's fields under another
architecture, partial rotary) is refused, never run as something else.

`attention_rule` is THE per-layer attention rule: block masks (dflash.drafter.blocks), decoding and any
fused attention kernel derive their visibility from it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..config import DrafterConfig
from ..target.shape import TargetShape, check_layer_ids, default_layer_ids
from .rope import Rotary
from .variants import from_config_json, variant


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
    sliding_window: int | None = (
        2048  # None: sliding layers have no window (use_sliding_window off)
    )
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    # rope scaling as transformers' rope_parameters minus rope_theta ({"rope_type": "yarn",
    # "factor": ..., ...}); None = plain RoPE.
    rope_scaling: dict | None = None
    is_causal: bool | None = None  # set: overrides the per-layer causal rule for every layer
    input_embedding_scale: float = 1.0  # block input embeddings x this
    output_multiplier: float = 1.0  # logits x this
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    attention_bias: bool = False
    hidden_act: str = "silu"
    variant: str = "dflash"  # dflash.drafter.variants: the model class and its architecture name
    # the variant's own dflash_config fields (DFlash2: conv_kernel_size, ..., selector_top_k)
    variant_config: dict = field(default_factory=dict)

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rope_parameters(self) -> dict:
        return {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}

    def to_hf_config(self, dtype: str = "bfloat16") -> dict:
        sliding = any(t == "sliding_attention" for t in self.layer_types)
        dc = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
        }
        if self.final_logit_softcapping is not None:
            dc["final_logit_softcapping"] = self.final_logit_softcapping
        dc.update(self.variant_config)
        cfg = {
            "architectures": [variant(self.variant).architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            # both spellings: transformers 5 reads rope_parameters, older readers rope_scaling
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": self.rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": sliding and self.sliding_window is not None,
            "max_window_layers": self.num_hidden_layers,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dc,
            "torch_dtype": dtype,
        }
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DrafterSpec:
        """Read a serving-format config.json; layer ids always come from the checkpoint."""
        var = from_config_json(cfg)
        dc = cfg.get("dflash_config") or {}

        def knob(name, default=None):  # the reference's precedence: dflash_config, then top level
            return dc.get(name, cfg.get(name, default))

        if knob("target_layer_ids") is None:
            raise ValueError(
                "config.json has no dflash_config.target_layer_ids; not a DFlash drafter"
            )
        if knob("mask_token_id") is None:
            raise ValueError(
                "config.json has no dflash_config.mask_token_id; the drafter's mask token "
                "must come from the checkpoint"
            )
        n = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        # Qwen3Config: the window exists only with use_sliding_window; without layer_types,
        # layers from max_window_layers on slide.
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        layer_types = cfg.get("layer_types") or [
            "sliding_attention"
            if window is not None and i >= int(cfg.get("max_window_layers", 28))
            else "full_attention"
            for i in range(n)
        ]
        if "sliding_attention" not in layer_types:  # unused then: keep it as written
            window = cfg.get("sliding_window")
        theta, scaling = _rope_from_config(cfg, heads, head_dim)
        is_causal = cfg.get("is_causal")
        softcap = knob("final_logit_softcapping")
        spec = cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            block_size=int(knob("block_size", 16)),
            mask_token_id=int(knob("mask_token_id")),
            target_layer_ids=[int(i) for i in knob("target_layer_ids")],
            num_target_layers=int(cfg.get("num_target_layers", -1)),
            layer_types=list(layer_types),
            sliding_window=int(window) if window is not None else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope_scaling=scaling,
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=float(knob("input_embedding_scale", 1.0)),
            output_multiplier=float(knob("output_multiplier", 1.0)),
            # the reference applies softcapping only when > 0
            final_logit_softcapping=float(softcap)
            if softcap is not None and float(softcap) > 0
            else None,
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            variant=var.name,
            variant_config={f: knob(f) for f in var.fields},
        )
        spec.check()
        return spec

    def check(self) -> None:
        """Values the drafter cannot run; raises ValueError naming the config.json field."""
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} (config.json / drafter.hidden_act) is not a "
                "transformers activation "
                f"(ACT2FN); choose one of {sorted(ACT2FN)[:8]}..."
            )
        for key in ("input_embedding_scale", "output_multiplier"):
            v = getattr(self, key)
            if not math.isfinite(v):
                raise ValueError(f"{key}={v} (dflash_config / drafter.{key}) must be finite")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(
                    f"config.json layer_types has {t!r}; allowed: full_attention, sliding_attention"
                )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.json layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        Rotary(self)  # builds the frequencies: refuses what it cannot run
        variant(self.variant).model.check_spec(self)

    def as_dict(self) -> dict:
        return asdict(self)


def _rope_from_config(cfg: dict, heads: int, head_dim: int) -> tuple[float, dict | None]:
    """(rope_theta, scaling) exactly as transformers' Qwen3Config standardises rope_theta /
    rope_scaling / rope_parameters (the reference builds Qwen3RotaryEmbedding from it)."""
    import logging

    from transformers import Qwen3Config

    keys = ("rope_theta", "rope_scaling", "rope_parameters")
    kw = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        qc = Qwen3Config(
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            **kw,
        )
    finally:
        logging.getLogger("transformers").setLevel(level)
    rp = dict(qc.rope_parameters)
    theta = float(rp.pop("rope_theta"))
    rp.pop("type", None)
    return theta, (None if rp in ({}, {"rope_type": "default"}) else rp)


@dataclass(frozen=True)
class MaskRule:
    """Visibility of one drafter layer's attention, on top of the rule every layer obeys (a
    block query sees context positions strictly before its anchor, in the anchor's sample, and
    its own block, never another block).

    causal_in_block: block query i sees block key i' only if i' <= i (else the whole block).
    window: None, or W: query position q sees key position k only if q - k < W (positions as in
        the KV sequence; context and block keys alike).
    window_both_sides: also k - q < W (a non-causal windowed layer; only block keys can lie
        after the query).
    """

    causal_in_block: bool
    window: int | None
    window_both_sides: bool


def attention_rule(spec: DrafterSpec, layer_type: str) -> MaskRule:
    """The reference's rule: sliding layers are causal (unless config.json's top-level
    `is_causal` says otherwise, which then applies to every layer) and windowed."""
    sliding = layer_type == "sliding_attention"
    causal = sliding if spec.is_causal is None else bool(spec.is_causal)
    window = spec.sliding_window if sliding else None
    return MaskRule(causal, window, window is not None and not causal)


def mask_rules(spec: DrafterSpec) -> dict[str, MaskRule]:
    """{layer_type: MaskRule} for the layer types this drafter has."""
    return {t: attention_rule(spec, t) for t in dict.fromkeys(spec.layer_types)}


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
    spec = DrafterSpec(
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
        rope_scaling=dict(dcfg.rope_scaling) if dcfg.rope_scaling else None,
        is_causal=dcfg.is_causal,
        input_embedding_scale=dcfg.input_embedding_scale,
        output_multiplier=dcfg.output_multiplier,
        final_logit_softcapping=dcfg.final_logit_softcapping,
        attention_bias=dcfg.attention_bias,
        hidden_act=dcfg.hidden_act,
        variant=dcfg.variant,
        variant_config={f: getattr(dcfg, f) for f in variant(dcfg.variant).fields},
    )
    spec.check()
    return spec
