"""A split run: ranks 0..NW-1 become target workers, the rest drafter trainers."""

from __future__ import annotations

from ...common.comm import RankContext, new_group
from ...config import RunConfig
from .schedule import Roles
from .trainer import run_trainer
from .worker import run_worker


def run_split(cfg: RunConfig, run_dir: str, ctx: RankContext, roles: Roles) -> None:
    # collectives: every rank creates them. Their waits are bounded like the job's own group's
    # (a library default would wait 30 min in the DDP all-reduce for a stopped trainer)
    timeout = ctx.collective_timeout
    dp_group = new_group(roles.trainer_ranks, timeout=timeout)
    # the trainers' stop flags agree on the host (gloo), not through the step's stream
    ctrl_group = new_group(roles.trainer_ranks, backend="gloo", timeout=timeout)
    if ctx.rank < roles.num_workers:
        run_worker(cfg, run_dir, ctx, roles)
    else:
        run_trainer(cfg, run_dir, ctx, roles, dp_group, ctrl_group)
