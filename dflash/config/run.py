"""The root schema (`RunConfig`: top-level keys + one field per group, with the `logger` and
`topology` groups), its registration with Hydra, and the one conversion from a DictConfig.

One dataclass per Hydra config group, registered with Hydra's ConfigStore so that a typo or an
unknown key fails at composition with the key's name. Below the entry points nothing sees a
DictConfig: `to_run_config` converts once and every group's `validate` checks its own rules,
raising ValueError that names the dotted key, what is allowed and why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .checks import check_choice
from .data import DataConfig
from .eval import EvalConfig
from .model import DrafterConfig, TargetConfig
from .train import TrainConfig

BACKENDS = ("auto", "nccl", "gloo")  # auto: nccl on CUDA, gloo on CPU


@dataclass
class LoggerConfig:
    kind: str = "console"  # console | wandb | none
    project: str = "dflash"  # wandb project
    entity: str | None = None  # wandb entity
    mode: str = "auto"  # auto: online when credentials exist, else offline
    tags: list[str] = field(default_factory=list)  # wandb tags
    log_checkpoints: bool = False  # wandb: each checkpoint as a model artifact (opt-in: GBs at 27B)

    def validate(self) -> None:
        check_choice("logger.kind", self.kind, ("console", "wandb", "none"))


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
        check_choice("topology.mode", self.mode, ("colocated", "split"))
        check_choice("topology.on_bad_batch", self.on_bad_batch, ("skip", "stop"))
        check_choice("topology.backend", self.backend, BACKENDS)
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
        """Each group checks itself; then the rules that span groups."""
        for name in GROUPS:
            getattr(self, name).validate()
        t, B = self.train, self.drafter.block_size
        if t.loss == "variable_prefix" and t.prefix_min > B - 1:
            raise ValueError(
                f"train.prefix_min={t.prefix_min} leaves no drafted position to learn in a block "
                f"of drafter.block_size={B}; use a value in 1..{B - 1}"
            )
        if t.keep_best and not self.eval.enabled:
            raise ValueError(
                f"train.keep_best={t.keep_best!r} needs the in-loop eval: set eval.enabled=true, "
                "or train.keep_best='' (keep no best)"
            )
        return self


SCHEMA_NAME = "dflash_run_schema"
# config group name -> its schema (the RunConfig fields whose type is a *Config dataclass)
GROUPS = {f.name: globals()[f.type] for f in dataclasses.fields(RunConfig) if "Config" in f.type}


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
        cls = GROUPS.get(name)
        kwargs[name] = cls(**value) if cls is not None else value
    if kwargs.get("resume") is not None:
        kwargs["resume"] = str(kwargs["resume"])
    return RunConfig(**kwargs).validate()
