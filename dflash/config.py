"""Typed configuration schemas.

One dataclass per Hydra config group, registered with Hydra's ConfigStore so that a typo or an
unknown key fails at composition with the key's name. Below the entry points nothing sees a
DictConfig: `to_run_config` converts once and every group's `validate` checks its own rules,
raising ValueError that names the dotted key, what is allowed and why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LINEAR_ATTN_BACKENDS = ("auto", "fla", "torch")
LAYER_TYPES = ("full_attention", "sliding_attention")
LOSSES = ("hard_ce", "soft_kl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DATA_SOURCES = ("selfgen", "jsonl", "parquet", "stdlib", "humaneval")
BACKENDS = ("auto", "nccl", "gloo")  # auto: nccl on CUDA, gloo on CPU


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
    # (dflash.tokenizer; text data sources offline), null = none (data.source=selfgen only).
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if present, else cpu
    linear_attn_backend: str = "auto"  # auto | fla | torch (Gated-DeltaNet kernels)
    attn_implementation: str = "sdpa"  # transformers attention kernel
    packed_capture: bool = True  # attention-only targets: samples share rows (checked once)
    capture_graphs: bool = True  # CUDA, full-attention SDPA targets: packed capture as CUDA graphs
    compile_layers: bool = False  # CUDA: decoder layers torch.compiled for the clean capture
    # Drafter mask token (a special id that never occurs in text). None: the tokenizer's mask
    # token, or vocab_size-1 for tokenizer-less random targets.
    mask_token_id: int | None = None
    # Text conventions of the target: the same settings are used for regenerated training data
    # and for eval prompts, so the drafter is judged on text formatted as it was trained on.
    chat_template: bool = False
    enable_thinking: bool = False  # chat template's thinking switch
    check_memory: bool = True  # refuse at start-up a target whose weights exceed free memory

    def validate(self) -> None:
        _check_choice("target.linear_attn_backend", self.linear_attn_backend, LINEAR_ATTN_BACKENDS)
        _check_choice("target.dtype", self.dtype, DTYPES)
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
    # config.json's rope scaling (dflash.spec): transformers' rope_parameters minus rope_theta,
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

    def validate(self) -> None:
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
                _check_choice(f"drafter.layer_types[{i}]", t, LAYER_TYPES)
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


@dataclass
class DataConfig:
    # selfgen: random prompts, the target's own greedy responses (tiny targets, smoke runs).
    # jsonl / parquet: prompts from local files (`prompt` or `messages` field).
    # stdlib: functions/classes of the CPython standard library turned into completion prompts.
    source: str = "selfgen"
    paths: list[str] = field(default_factory=list)  # jsonl/parquet files (globs)
    code_dirs: list[str] = field(default_factory=list)  # stdlib: more *.py dirs, `site-packages`
    prompt_field: str = "prompt"  # row field with the prompt
    num_samples: int = 256  # samples to (re)generate
    prompt_len: int = 16  # selfgen prompt tokens
    response_len: int = 64  # max response tokens
    max_length: int = 256  # max tokens per sample
    too_long: str = "truncate"  # truncate | drop
    regen_batch_size: int = 32  # prompts per regen batch
    regen_temperature: float = 0.0  # 0: greedy responses
    regen_compact: bool = False  # CUDA static regen: ended rows leave the batch (GPU: unmeasured)
    regen_compile: bool = False  # CUDA static regen: torch.compile the one-token step, then graph
    # Minutes, then train on the samples done (batches in a seeded random order: a random subset)
    regen_time_limit_min: float | None = None
    seed: int = 1234  # data and order seed
    cache_dir: str | None = None  # default: <run_dir>/data
    # Pack samples first-fit into rows of this many tokens (None: one sample per row, padded).
    # The drafter's masks keep samples apart; the target packs its own (packed_capture).
    pack_to: int | None = None

    def validate(self) -> None:
        _check_choice("data.source", self.source, DATA_SOURCES)
        _check_choice("data.too_long", self.too_long, ("truncate", "drop"))
        if self.source in ("jsonl", "parquet") and not self.paths:
            raise ValueError(
                f"data.paths is empty for data.source={self.source}: set "
                "data.paths=[/path/prompts.jsonl] (rows with a 'prompt' or 'messages' "
                "field), or data=selfgen for the target's own text on random prompts"
            )
        _check_positive(
            "data.regen_time_limit_min", self.regen_time_limit_min, " minutes (null: all)"
        )
        if self.pack_to is not None and self.pack_to < self.max_length:
            raise ValueError(
                f"data.pack_to={self.pack_to} is shorter than data.max_length="
                f"{self.max_length}: a full-length sample would not fit in a row; "
                "set data.pack_to >= data.max_length or null (no packing)"
            )


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps (an upper bound when time_budget_min is set)
    # minutes for the whole run (load, regen, training, evals; over resumes; dflash.budget)
    time_budget_min: float | None = None
    micro_batch_size: int = 8  # sequences per micro step (per trainer rank)
    grad_accum: int = 1  # micro-batches per step
    max_anchors: int = 512  # anchors per sequence, resampled every step
    lr: float = 6e-4  # peak learning rate
    min_lr_ratio: float = 0.0  # final lr / peak
    warmup_ratio: float = 0.04  # warmup share of steps
    weight_decay: float = 0.0  # AdamW decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    clip_grad: float = 1.0  # max grad norm
    loss: str = "hard_ce"  # hard_ce | soft_kl
    allow_soft_loss: bool = False  # soft KL must be chosen explicitly (see validate)
    gamma: float | None = None  # None: 7 for B=16, 5 for B=10, 4 for B=8
    # all | by_weight: keep position k's label with probability w_k / w_1, weighted 1 / p (the
    # same expected loss and gradient from ~45% of the lm_head rows at B=16, gamma 7)
    label_sampling: str = "all"
    noise_std: float = 0.0  # input-side Gaussian noise on aux features, relative to their RMS
    dtype: str = "auto"  # compute dtype under autocast; master weights stay fp32
    lm_head_chunk: int = 2048  # positions per chunk of the lm_head + CE
    attn_kernel: str = "auto"  # drafter attention: flex (block-sparse) | sdpa (dense) | auto
    compile: bool = False  # the drafter as one static compiled graph (rows padded to max_length)
    fuse: bool = False  # CUDA: one compiled kernel per RMSNorm / RoPE / SwiGLU (dflash.fuse)
    seed: int = 0  # init, anchors, noise
    log_every: int = 10  # steps between logs
    eval_every: int = 100  # steps between evals
    save_every: int = 100  # steps between saves
    keep_last: int = 2  # checkpoints kept
    profile_at: int = 0  # > 0: torch.profiler over steps profile_at.. into RUN/profile (loop.py)
    profile_steps: int = 5  # steps that profile covers
    save_on_interrupt: bool = True  # Ctrl-C: finish the step, save it, print the resume command
    dist: str = "ddp"  # trainer ranks: ddp | fsdp | deepspeed (dflash.parallelize)
    zero_stage: int = 1  # train.dist=deepspeed: ZeRO stage 1, 2 or 3

    def validate(self) -> None:
        _check_choice("train.dtype", self.dtype, DTYPES)
        _check_choice("train.loss", self.loss, LOSSES)
        _check_choice("train.label_sampling", self.label_sampling, ("all", "by_weight"))
        _check_choice("train.attn_kernel", self.attn_kernel, ("auto", "flex", "sdpa"))
        _check_choice("train.dist", self.dist, ("ddp", "fsdp", "deepspeed"))
        _check_choice("train.zero_stage", self.zero_stage, (1, 2, 3))
        if self.loss == "soft_kl" and not self.allow_soft_loss:
            raise ValueError(
                "train.loss=soft_kl trains a soft objective while acceptance is judged by the "
                "argmax (matching the target's distribution does not maximise exact-match "
                "acceptance); to train it anyway, also set train.allow_soft_loss=true (logged)"
            )
        _check_positive("train.gamma", self.gamma, " (position weights exp(-(k-1)/gamma))")
        _check_positive("train.time_budget_min", self.time_budget_min, " minutes")
        if len(self.betas) != 2:
            raise ValueError(f"train.betas must have two values, got {list(self.betas)}")
        at_least_one = "steps micro_batch_size grad_accum max_anchors log_every eval_every"
        for key in (at_least_one + " save_every lm_head_chunk profile_steps").split():
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class EvalConfig:
    enabled: bool = True  # in-loop eval on/off
    num_prompts: int = 8  # eval prompts
    completion_len: int = 96  # greedy tokens per prompt
    budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])  # DDTree node budgets
    batch_size: int = 4  # prompts per batch
    seed: int = 4321  # eval prompt seed
    source: str | None = None  # None: the training source, rows training does not use
    paths: list[str] = field(default_factory=list)  # eval prompt files
    show_rounds: int = 2  # rounds printed per prompt in the table
    # eval/tau_t{T} as the reference samples (dflash.sampling); top_p/top_k: target and drafter
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0  # nucleus (1.0: off)
    top_k: int = 0  # top-k (0: off)
    # eval.py: also decode the first N eval prompts for real: greedy AR / chain / tree speed and
    # == AR (dflash.decode_speed), and sampled at each temperature (dflash.decode_eval)
    real_decode_prompts: int = 0
    decode_tree_budgets: list[int] = field(default_factory=lambda: [64])  # its DDTree budgets

    def validate(self) -> None:
        if self.real_decode_prompts < 0:
            raise ValueError(
                f"eval.real_decode_prompts must be >= 0, got {self.real_decode_prompts}"
            )
        for key in ("budgets", "decode_tree_budgets"):
            bad = [b for b in getattr(self, key) if b < 1]
            if bad:
                raise ValueError(f"eval.{key} must all be >= 1 (DDTree node budgets); got {bad}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"eval.temperatures must be >= 0, got {list(self.temperatures)}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"eval.top_p={self.top_p} must be in (0, 1] and eval.top_k={self.top_k} >= 0"
            )


@dataclass
class LoggerConfig:
    kind: str = "console"  # console | wandb | none
    project: str = "dflash"  # wandb project
    entity: str | None = None  # wandb entity
    mode: str = "auto"  # auto: online when credentials exist, else offline
    tags: list[str] = field(default_factory=list)  # wandb tags
    log_checkpoints: bool = False  # wandb: each checkpoint as a model artifact (opt-in: GBs at 27B)

    def validate(self) -> None:
        _check_choice("logger.kind", self.kind, ("console", "wandb", "none"))


@dataclass
class TopologyConfig:
    """Process layout of a torch.distributed job (see docs/pipeline.md)."""

    mode: str = "colocated"  # colocated | split
    num_target_ranks: int = 0  # split: first T ranks run the target, the rest train
    window: int = 2  # batches in flight per worker->trainer link (backpressure); also the trainer's prefetch depth
    timeout_s: float = 600.0  # a silent peer this long stops the run (> eval/save pauses)
    on_bad_batch: str = "skip"  # skip | stop  (NaN/inf aux states)
    overlap_capture: bool = False  # colocated: capture the next step on a side CUDA stream
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    # Startup (target load, data regeneration/reading on rank 0, checkpoint load) may take this long
    # before the ranks meet; a rank that never arrives is named.
    startup_timeout_s: float = 3600.0

    def validate(self) -> None:
        _check_choice("topology.mode", self.mode, ("colocated", "split"))
        _check_choice("topology.on_bad_batch", self.on_bad_batch, ("skip", "stop"))
        _check_choice("topology.backend", self.backend, BACKENDS)
        if self.window < 1:
            raise ValueError(
                f"topology.window must be >= 1 (batches in flight per link), got {self.window}"
            )
        for key in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(
                    f"topology.{key} must be > 0 seconds (a silent peer is detected after it), "
                    f"got {getattr(self, key)}"
                )


@dataclass
class RunConfig:
    exp_name: str = "smoke"  # experiment name (set by +exp=NAME)
    run_name: str = "smoke"  # run directory name under out_root
    out_root: str = "outputs"  # where run directories go
    resume: str | None = None  # None | "true" | PATH
    ckpt: str | None = None  # eval.py: drafter checkpoint directory (ours or z-lab format)
    out: str | None = None  # eval.py: also write all figures to this JSON file
    eval_dir: str | None = None  # eval.py: its eval.log, eval-set cache (None: evals/<ckpt>)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)

    def validate(self) -> RunConfig:
        """Each group checks itself (no rule spans groups today)."""
        for name in _GROUPS:
            getattr(self, name).validate()
        return self


def _check_positive(name: str, value, what: str = "") -> None:
    """An optional number that must be > 0 when set."""
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0{what}, got {value}")


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


SCHEMA_NAME = "dflash_run_schema"
# config group name -> its schema (the RunConfig fields whose type is a *Config dataclass)
_GROUPS = {f.name: globals()[f.type] for f in dataclasses.fields(RunConfig) if "Config" in f.type}


def register_configs() -> None:
    """Register the typed schema with Hydra's ConfigStore as the root of conf/config.yaml's
    defaults list. Every group is a typed field of RunConfig, so each group file merged into
    it is checked against its dataclass (an unknown key or a wrong type fails at composition,
    naming the key). The schema is not stored in any group, so it is no user choice:
    `target=<schema>` does not exist and --help lists only real options."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig (already schema-checked by Hydra) -> validated RunConfig."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    raw.pop("hydra", None)
    for k in [k for k in raw if k not in {f.name for f in dataclasses.fields(RunConfig)}]:
        raise ValueError(f"unknown top-level config key {k!r}")
    kwargs = {}
    for name, value in raw.items():
        cls = _GROUPS.get(name)
        kwargs[name] = cls(**value) if cls is not None else value
    if kwargs.get("resume") is not None:
        kwargs["resume"] = str(kwargs["resume"])
    return RunConfig(**kwargs).validate()
