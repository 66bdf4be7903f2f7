"""Typed configuration schemas.

One dataclass per Hydra config group, registered with Hydra's ConfigStore so that a typo or an
unknown key fails at composition with the key's name. Below the entry points nothing sees a
DictConfig: `to_run_config` converts once and `RunConfig.validate` checks cross-field rules,
raising ValueError that names the dotted key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LINEAR_ATTN_BACKENDS = ("auto", "fla", "torch")
LAYER_TYPES = ("full_attention", "sliding_attention")
LOSSES = ("hard_ce", "soft_kl")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class TargetConfig:
    """The frozen target LLM.

    Exactly one of `path` (a local Hugging Face directory or GGUF folder) and `config`
    (a HF config dict: random weights, for tests, demos and benchmarks) must be set.
    """

    name: str = "tiny_qwen3_5"
    path: str | None = None
    gguf_file: str | None = None
    config: dict[str, Any] | None = None
    init_seed: int = 0
    init_std: float | None = None  # random weights: override initializer_range
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    linear_attn_backend: str = "auto"  # auto | fla | torch (Gated-DeltaNet kernels)
    attn_implementation: str = "sdpa"
    # Drafter mask token (a special id that never occurs in text). None: the tokenizer's mask
    # token, or vocab_size-1 for tokenizer-less random targets.
    mask_token_id: int | None = None
    # Text conventions of the target (pitfall 6): the same settings are used for
    # regenerated training data and for eval prompts.
    chat_template: bool = False
    enable_thinking: bool = False


@dataclass
class DrafterConfig:
    num_layers: int = 1
    # Per-layer attention type; None = all full_attention. Full layers are bidirectional inside
    # the block, sliding layers causal inside the block with `sliding_window`.
    layer_types: list[str] | None = None
    sliding_window: int = 2048
    # Target layers feeding the drafter (layer l = output of decoder layer l = HF
    # hidden_states[l + 1]). None = `num_aux_layers` evenly spaced over 1..L-3.
    target_layer_ids: list[int] | None = None
    num_aux_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None  # None: target.mask_token_id (see there)
    # Shape; None = copy from the target.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    # The rest of config.json's semantics, as the reference reads them (dflash.spec):
    # rope scaling as transformers' rope_parameters minus rope_theta, e.g.
    # {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}.
    rope_scaling: dict[str, Any] | None = None
    is_causal: bool | None = (
        None  # set: every layer causal (true) / bidirectional (false) in the block
    )
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    init_std: float = 0.02
    # Initialise from an existing drafter checkpoint directory (serving format).
    init_from: str | None = None


@dataclass
class DataConfig:
    # selfgen: random prompts, the target's own greedy responses (tiny targets, smoke runs).
    # jsonl / parquet: prompts from local files (`prompt` or `messages` field).
    # stdlib: functions/classes of the CPython standard library turned into completion prompts.
    source: str = "selfgen"
    paths: list[str] = field(default_factory=list)
    prompt_field: str = "prompt"
    num_samples: int = 256
    prompt_len: int = 16
    response_len: int = 64
    max_length: int = 256
    too_long: str = "truncate"  # truncate | drop
    regen_batch_size: int = 32
    regen_temperature: float = 0.0
    seed: int = 1234
    cache_dir: str | None = None  # default: <run_dir>/data
    # Pack samples first-fit into rows of this many tokens (None: one sample per row, padded).
    # The target still runs each sample alone; the drafter's masks keep samples apart.
    pack_to: int | None = None


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8  # sequences per micro step (per trainer rank)
    grad_accum: int = 1
    max_anchors: int = 512  # anchors per sequence, resampled every step
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    clip_grad: float = 1.0
    loss: str = "hard_ce"
    allow_soft_loss: bool = False  # soft KL must be chosen explicitly (pitfall 3)
    gamma: float | None = None  # None: 7 for B=16, 5 for B=10, 4 for B=8
    noise_std: float = 0.0  # input-side Gaussian noise on aux features, relative to their RMS
    dtype: str = "auto"  # compute dtype under autocast; master weights stay fp32
    lm_head_chunk: int = 2048  # positions per chunk of the (checkpointed) lm_head + CE
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 100
    keep_last: int = 2


@dataclass
class EvalConfig:
    enabled: bool = True
    num_prompts: int = 8
    completion_len: int = 96
    budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    batch_size: int = 4
    seed: int = 4321
    source: str | None = None  # None: the training source, rows training does not use
    paths: list[str] = field(default_factory=list)
    show_rounds: int = 2  # rounds printed per prompt in the table
    # Acceptance at temperature > 0 as the reference samples (dflash.sampling): eval/tau_t{T}
    # per temperature; top_p / top_k apply to target and drafter alike (0 / 1.0: off).
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class LoggerConfig:
    kind: str = "console"  # console | wandb | none
    project: str = "dflash"
    entity: str | None = None
    mode: str = "auto"  # auto: online when credentials exist, else offline
    tags: list[str] = field(default_factory=list)


@dataclass
class TopologyConfig:
    """Process layout of a torch.distributed job (see docs/pipeline.md)."""

    mode: str = "colocated"  # colocated | split
    num_target_ranks: int = 0  # split: first T ranks run the target, the rest train
    window: int = 2  # batches in flight per worker->trainer link (backpressure); also the trainer's prefetch depth
    timeout_s: float = (
        600.0  # a silent peer for this long stops the run (must exceed eval/checkpoint pauses)
    )
    on_bad_batch: str = "skip"  # skip | stop  (NaN/inf aux states)
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    # Startup (target load, data regeneration/reading on rank 0, checkpoint load) may take this long
    # before the ranks meet; a rank that never arrives is named.
    startup_timeout_s: float = 3600.0


@dataclass
class RunConfig:
    exp_name: str = "smoke"
    run_name: str = "smoke"
    out_root: str = "outputs"
    resume: str | None = None  # None | "true" | PATH
    ckpt: str | None = None  # eval.py: drafter checkpoint directory (ours or z-lab format)
    out: str | None = None  # eval.py: also write all figures to this JSON file
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)

    def validate(self) -> RunConfig:
        _check_choice(
            "target.linear_attn_backend", self.target.linear_attn_backend, LINEAR_ATTN_BACKENDS
        )
        _check_choice("target.dtype", self.target.dtype, DTYPES)
        _check_choice("train.dtype", self.train.dtype, DTYPES)
        _check_choice("train.loss", self.train.loss, LOSSES)
        _check_choice("data.too_long", self.data.too_long, ("truncate", "drop"))
        _check_choice(
            "data.source", self.data.source, ("selfgen", "jsonl", "parquet", "stdlib", "humaneval")
        )
        _check_choice("logger.kind", self.logger.kind, ("console", "wandb", "none"))
        _check_choice("topology.mode", self.topology.mode, ("colocated", "split"))
        _check_choice("topology.on_bad_batch", self.topology.on_bad_batch, ("skip", "stop"))
        if self.target.path is None and self.target.config is None:
            raise ValueError(
                f"target.path is not set (target={self.target.name}): set target.path=/path/to/the/"
                "weights (a local Hugging Face directory; nothing is downloaded at run time), or pick "
                "a tiny random target, e.g. target=tiny_qwen3_5"
            )
        if self.data.source in ("jsonl", "parquet") and not self.data.paths:
            raise ValueError(
                f"data.paths is empty for data.source={self.data.source}: set "
                "data.paths=[/path/prompts.jsonl] (rows with a 'prompt' or 'messages' "
                "field), or data=selfgen for the target's own text on random prompts"
            )
        if self.target.path is not None and self.target.config is not None:
            raise ValueError(
                "target: set exactly one of target.path (local weights) and target.config "
                f"(random weights from a config); got path={self.target.path!r}, "
                f"config={'set' if self.target.config else None}"
            )
        if self.train.loss == "soft_kl" and not self.train.allow_soft_loss:
            raise ValueError(
                "train.loss=soft_kl trains a soft objective while acceptance is judged by argmax "
                "(pitfall 3). Hard CE is the default; to train soft KL anyway, also set "
                "train.allow_soft_loss=true (it is logged)."
            )
        d = self.drafter
        if d.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {d.block_size}")
        if d.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {d.num_layers}")
        if (
            d.layer_types
            and "sliding_attention" in d.layer_types
            and d.sliding_window < d.block_size
        ):
            raise ValueError(
                f"drafter.sliding_window={d.sliding_window} is smaller than drafter.block_size="
                f"{d.block_size}; a sliding layer must see its whole block prefix"
            )
        if d.layer_types is not None:
            if len(d.layer_types) != d.num_layers:
                raise ValueError(
                    f"drafter.layer_types has {len(d.layer_types)} entries but drafter.num_layers="
                    f"{d.num_layers}; give one of {LAYER_TYPES} per layer"
                )
            for i, t in enumerate(d.layer_types):
                _check_choice(f"drafter.layer_types[{i}]", t, LAYER_TYPES)
        if self.train.gamma is not None and not self.train.gamma > 0:
            raise ValueError(
                f"train.gamma must be > 0 (position weights exp(-(k-1)/gamma)); got {self.train.gamma}"
            )
        if len(self.train.betas) != 2:
            raise ValueError(f"train.betas must have two values, got {list(self.train.betas)}")
        heads, kv = d.num_attention_heads, d.num_key_value_heads
        if heads and kv and heads % kv:
            raise ValueError(
                f"drafter.num_attention_heads={heads} must be a multiple of "
                f"drafter.num_key_value_heads={kv}"
            )
        if d.head_dim is not None and d.head_dim % 2:
            raise ValueError(f"drafter.head_dim={d.head_dim} must be even (rotary embedding)")
        for key in (
            "steps",
            "micro_batch_size",
            "grad_accum",
            "max_anchors",
            "log_every",
            "eval_every",
            "save_every",
            "lm_head_chunk",
        ):
            if getattr(self.train, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self.train, key)}")
        if self.data.pack_to is not None and self.data.pack_to < self.data.max_length:
            raise ValueError(
                f"data.pack_to={self.data.pack_to} is shorter than data.max_length="
                f"{self.data.max_length}: a full-length sample would not fit in a row; "
                "set data.pack_to >= data.max_length or null (no packing)"
            )
        if any(t < 0 for t in self.eval.temperatures):
            raise ValueError(f"eval.temperatures must be >= 0, got {list(self.eval.temperatures)}")
        if not 0 < self.eval.top_p <= 1 or self.eval.top_k < 0:
            raise ValueError(
                f"eval.top_p={self.eval.top_p} must be in (0, 1] and eval.top_k={self.eval.top_k} >= 0"
            )
        if self.topology.window < 1:
            raise ValueError(f"topology.window must be >= 1, got {self.topology.window}")
        return self


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (group defaults validate against them)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, node in (
        ("target", TargetConfig),
        ("drafter", DrafterConfig),
        ("data", DataConfig),
        ("train", TrainConfig),
        ("eval", EvalConfig),
        ("logger", LoggerConfig),
        ("topology", TopologyConfig),
    ):
        cs.store(group=group, name=f"{group}_schema", node=node)


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig (already schema-checked by Hydra) -> validated RunConfig."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    raw.pop("hydra", None)
    for k in [k for k in raw if k not in {f.name for f in dataclasses.fields(RunConfig)}]:
        raise ValueError(f"unknown top-level config key {k!r}")
    kwargs = {}
    for name, value in raw.items():
        cls = {
            "target": TargetConfig,
            "drafter": DrafterConfig,
            "data": DataConfig,
            "train": TrainConfig,
            "eval": EvalConfig,
            "logger": LoggerConfig,
            "topology": TopologyConfig,
        }.get(name)
        kwargs[name] = cls(**value) if cls is not None else value
    if kwargs.get("resume") is not None:
        kwargs["resume"] = str(kwargs["resume"])
    return RunConfig(**kwargs).validate()
