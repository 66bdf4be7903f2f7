"""Typed configuration: one dataclass schema per Hydra config group, checked at composition and
validated once below the entry points (`to_run_config`)."""

from .data import (  # data: prompts, regeneration
    DATA_SOURCES,
    FILE_SOURCES,
    DataConfig,
    MixSourceConfig,
)
from .eval import (  # eval: the in-loop and eval.py evaluation
    EVAL_BEFORE_THE_KEY,
    EVAL_NOT_IN_SET_KEY,
    EvalConfig,
    EvalSetConfig,
)
from .model import (  # target, drafter
    DTYPES,
    LAYER_TYPES,
    LINEAR_ATTN_BACKENDS,
    TARGET_EXECUTION_ONLY,
    TARGET_RESUMABLE,
    DrafterConfig,
    TargetConfig,
)
from .run import (  # the root schema, its Hydra registration and the one conversion
    BACKENDS,
    SCHEMA_NAME,
    LoggerConfig,
    RunConfig,
    TopologyConfig,
    register_configs,
    to_run_config,
)
from .train import LOSSES, TrainConfig  # train: optimization, budget, checkpoints
