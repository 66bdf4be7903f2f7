"""The launcher: typed config, process setup, one dispatch to the colocated or the split run, and
the exit codes of every process.

Exit codes: 0 done; 2 bad input (a config value, a missing file: one `error: ...` line);
3 the pipeline stopped (a peer rank died or hung, or topology.on_bad_batch=stop);
130 interrupted; 1 anything else (with its traceback).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
import traceback

from .build import BadBatchError
from .cli import names_run, typed
from .colocated import run_colocated
from .comm import (
    EXIT_PIPELINE,
    PeerError,
    RankContext,
    die,
    init_distributed,
    launcher_env,
    shutdown,
)
from .config import RunConfig
from .rundir import RunFinished, drop_unused_dir, plan_run
from .split.run import run_split
from .split.schedule import Roles

EXIT_BAD_INPUT = 2

_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|failed to pass monitoredBarrier"
)


def launch(cfg, run_dir: str) -> None:
    """Entry of `train.py` (cfg: the composed Hydra config). A single process without a split
    topology runs colocated in-process; anything else (torchrun, accelerate launch, or
    topology=split) runs as one rank of a torch.distributed job."""
    try:
        rc = typed(cfg)
        rank, world, _ = launcher_env()
        distributed = rc.topology.mode == "split" or world > 1
        roles = Roles.from_topology(rc.topology, world) if distributed else None
        plan = plan_run(rc, run_dir, named=names_run(cfg))
        if rank == 0:
            drop_unused_dir(run_dir, plan.run_dir)
        rc, run_dir = dataclasses.replace(rc, resume=plan.ckpt), plan.run_dir
        if not distributed:
            run_colocated(rc, run_dir)
            return
    except RunFinished as e:
        print(e, flush=True)
        return
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    run_distributed(rc, run_dir, roles)


def run_distributed(cfg: RunConfig, run_dir: str, roles: Roles | None) -> None:
    """One rank of the job (roles None: colocated data parallel). Any failure ends this process
    with a message naming the rank; peers notice (gloo at once, NCCL via the deadlines) and exit
    too, so the job never hangs silently."""
    rank = launcher_env()[0]
    ctx = init_distributed(
        cfg.topology.backend, cfg.topology.timeout_s, cfg.topology.startup_timeout_s
    )
    tag = f"[rank {rank}{'' if roles is None else ' ' + roles.role(rank)}]"
    try:
        if roles is None:
            run_colocated(cfg, run_dir, ctx=ctx)
        else:
            run_split(cfg, run_dir, ctx, roles)
        try:
            ctx.barrier()
        except RuntimeError as e:
            raise PeerError(
                f"not every rank reached the end of the run: {_first_line(e)}"
            ) from None
    except (PeerError, BadBatchError) as e:
        die(f"{tag} pipeline stopped: {e}", EXIT_PIPELINE)
    except (ValueError, FileNotFoundError) as e:
        die(f"{tag} error: {e}", EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        die(f"{tag} interrupted", 130)
    except BaseException as e:  # noqa: BLE001 - any other failure must still end the process
        _die_of(e, tag, ctx, wait_for_receiver=roles is not None)
    shutdown()


def _die_of(e: BaseException, tag: str, ctx: RankContext, wait_for_receiver: bool) -> None:
    # A collective among trainers breaks when a peer trainer stopped for a dead worker; give
    # this rank's receiver a moment to see the same root cause and report that instead.
    deadline = time.monotonic() + (2.0 if wait_for_receiver else 0.0)
    while ctx.root_cause is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if ctx.root_cause is not None:
        die(f"{tag} pipeline stopped: {ctx.root_cause}", EXIT_PIPELINE)
    if isinstance(e, RuntimeError) and _PEER_LOST.search(str(e)):
        die(
            f"{tag} pipeline stopped: a peer rank exited during a collective (the first rank to "
            f"stop names the cause): {_first_line(e)}",
            EXIT_PIPELINE,
        )
    traceback.print_exc()
    die(f"{tag} failed: {type(e).__name__}: {e}", 1)


def _first_line(e: BaseException) -> str:
    return (
        str(e).splitlines()[0].split(". This is typically")[0][:300] if str(e) else type(e).__name__
    )
