"""The drafter-trainer role of a split run: the target's heads only, the shared training setup,
and the stream from the workers as the batch source."""

from __future__ import annotations

import torch

from ...common.comm import RankContext
from ...common.layout import write_run_config
from ...config import RunConfig
from ...data.stream import SampleStream
from ..build import data_cache
from ..loop import train_loop
from ..resume import resume
from ..session import open_session
from .heads import check_heads, heads_fingerprint, load_heads_only
from .receiver import StreamedBatchSource
from .schedule import Roles, Schedule


def run_trainer(
    cfg: RunConfig, run_dir: str, ctx: RankContext, roles: Roles, dp_group, ctrl_group=None
) -> None:
    d = ctx.rank - roles.num_workers
    writer = d == 0
    torch.manual_seed(cfg.train.seed)
    target = load_heads_only(cfg, ctx.device)  # while worker 0 loads the target and the data
    info = ctx.broadcast_object(None, src=0)  # worker 0 has the data (and the eval cache) ready
    check_heads(heads_fingerprint(target.embed_tokens.weight, target.lm_head.weight), info["heads"])
    W = roles.num_workers
    describe = [
        f"topology: split, {W} target worker(s) (ranks 0..{W - 1}) -> {roles.num_trainers} "
        f"trainer(s) (ranks {W}..{ctx.world - 1}), window {cfg.topology.window}, backend "
        f"{ctx.backend}, timeout {cfg.topology.timeout_s:g} s",
        f"trainer heads: {target.how}",
    ]
    session = open_session(cfg, run_dir, target.shape, writer=writer, describe=describe)
    trainer, evaluator = session.start(target, ctx.device, dp_group=dp_group, ctrl_group=ctrl_group)
    stream = SampleStream(
        info["num_samples"], cfg.data.seed, info["digest"], data_cache(cfg, run_dir)
    )
    # trainer 0 announces (checkpoint, step, stream position) to every rank, workers included
    start = resume(cfg, run_dir, trainer, stream, session.logger, ctx, src=roles.trainer_rank(0))
    if writer:
        write_run_config(cfg, run_dir, info.get("data"))
    sched = Schedule.from_config(cfg, roles, start["step"], start["position"])
    source = StreamedBatchSource(cfg, ctx, roles, sched, d, stream, dp_group)
    source.start()
    train_loop(cfg, trainer, source, evaluator, session.logger, run_dir, writer=writer)
    source.join()
