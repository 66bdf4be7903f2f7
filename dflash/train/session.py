"""One training setup for every trainer rank, colocated or split: the drafter, the logger and
the lines that describe the run (`open_session`), then the evaluator and the `DrafterTrainer`
(`Session.start`). The runs differ only in where the target's shape and heads come from."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..common.loggers import Logger, make_logger
from ..config import RunConfig
from ..drafter.model import DFlashDrafter, num_params
from ..drafter.warmstart import warm_start
from ..eval.offline import Evaluator
from ..target.shape import Heads, TargetShape
from .build import build_drafter, data_cache
from .step import DrafterTrainer


@dataclass
class Session:
    cfg: RunConfig
    run_dir: str
    writer: bool  # this rank writes metrics, evaluations and checkpoints
    drafter: DFlashDrafter
    logger: Logger

    def start(
        self, target, device: torch.device, dp_group=None, ctrl_group=None
    ) -> tuple[DrafterTrainer, Evaluator | None]:
        """`target`: the full target or a trainer's heads-only one (embedding, lm_head, and what
        the eval set needs); the evaluator reads or builds the eval set in the data cache."""
        cfg = self.cfg
        evaluator = None
        if self.writer and cfg.eval.enabled:
            evaluator = Evaluator.from_config(
                cfg, target, data_cache(cfg, self.run_dir), log=self.logger.info
            )
        warm_start(self.drafter, target, cfg.drafter, self.logger.info)
        trainer = DrafterTrainer(
            self.drafter,
            Heads(target.embed_tokens, target.lm_head),
            cfg.train,
            device,
            dp_group=dp_group,
            ctrl_group=ctrl_group,
        )
        return trainer, evaluator


def open_session(
    cfg: RunConfig,
    run_dir: str,
    shape: TargetShape,
    *,
    writer: bool,
    describe: list[str],
    logger: Logger | None = None,
) -> Session:
    os.makedirs(run_dir, exist_ok=True)
    drafter = build_drafter(cfg, shape)
    logger = logger or make_logger(
        cfg.logger, run_dir, os.path.basename(run_dir), dataclasses.asdict(cfg), rank0=writer
    )
    logger.info(f"run dir: {run_dir}")
    for line in describe:
        logger.info(line)
    s = drafter.spec
    logger.info(
        f"drafter: {s.variant}, {num_params(drafter) / 1e6:.2f}M params, {s.num_hidden_layers} layers "
        f"{s.layer_types}, block {s.block_size}, aux layers {s.target_layer_ids}, "
        f"mask token {s.mask_token_id}, loss {cfg.train.loss}"
    )
    return Session(cfg, run_dir, writer, drafter, logger)
