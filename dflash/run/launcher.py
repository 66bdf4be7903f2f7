"""The launcher: typed config, process setup, one dispatch to the colocated or the split run, and
the exit codes of every process.

Exit codes: 0 done; 2 bad input (a config value, a missing file, an out_root that cannot be
written: one `error: ...` line); 3 the pipeline stopped (a peer rank died or hung, or
topology.on_bad_batch=stop); 130 / 143 stopped by Ctrl-C / SIGTERM (128 + the signal); 1
anything else: a full disk or a file-size limit in one line naming what was being written, any
other failure with its traceback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
import traceback

from ..common.comm import (
    EXIT_PIPELINE,
    PeerError,
    RankContext,
    at_die,
    die,
    init_distributed,
    launcher_env,
    shutdown,
)
from ..common.interrupt import Interrupted, exit_code, restore, stop_at_once, stop_signal
from ..common.layout import clean_leftovers
from ..common.liveness import Liveness
from ..common.storage import storage_error
from ..config import RunConfig
from ..train.budget import start_clock_at_process_start
from ..train.build import BadBatchError
from ..train.colocated import run_colocated
from ..train.split.run import run_split
from ..train.split.schedule import Roles
from .cli import names_run, typed
from .directory import RunDir
from .lock import live_owner
from .plan import ResumeCommand, RunFinished, plan_run
from .preflight import check_run

EXIT_BAD_INPUT = 2

_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|failed to pass monitoredBarrier"
)
_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def launch(cfg, overrides: list[str] | None = None) -> None:
    """Entry of `train.py` (cfg: the composed Hydra config; overrides: its command line, for the
    resume command printed on Ctrl-C). A single process without a split topology runs colocated
    in-process; anything else (torchrun, accelerate launch, or topology=split) runs as one rank of
    a torch.distributed job. The run directory is made only after every check that needs no
    model passed, and removed again if the run fails before it started."""
    start_clock_at_process_start()  # train.time_budget_min counts from the process start
    handlers = stop_at_once()  # SIGTERM before training: like Ctrl-C (the loop finishes a step)
    try:
        _launch(cfg, overrides)
    finally:
        restore(handlers)


def _launch(cfg, overrides: list[str] | None) -> None:
    try:
        rc = typed(cfg)
        rank, world, _ = launcher_env()
        distributed = rc.topology.mode == "split" or world > 1
        roles = Roles.from_topology(rc.topology, world) if distributed else None
        check_run(rc, hold_reads=rank == 0)  # rank 0 builds the data (colocated and split)
        if refused := live_owner(os.path.join(rc.out_root, rc.run_name)):
            raise ValueError(refused)  # before plan_run's own refusals: the owner is the news
        plan = plan_run(rc, os.path.join(rc.out_root, rc.run_name), named=names_run(cfg))
        rc = dataclasses.replace(rc, resume=plan.ckpt)
        # rank 0 owns the directory; in a split run the first trainer (the one that logs the
        # training) writes its lines to train.log too
        logs = rank == (0 if roles is None else roles.trainer_rank(0))
        run_dir = RunDir(plan.run_dir, "train.log", writer=rank == 0, logs=rank == 0 or logs)
    except RunFinished as e:
        print(e, flush=True)
        return
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    resume_cmd = ResumeCommand(overrides or [], rc, run_dir.path, world)
    if distributed:
        run_distributed(rc, run_dir, roles, resume_cmd, fresh=plan.ckpt is None)
        return
    refused = _take(run_dir, resume_cmd, fresh=plan.ckpt is None)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    try:
        run_colocated(rc, run_dir.path)
    except Interrupted as e:
        _finish(run_dir, True, resume_cmd.line(e), exit_code(e.signum))
    except KeyboardInterrupt:
        _finish(run_dir, False, resume_cmd.line(None), exit_code(stop_signal()))
    except (ValueError, FileNotFoundError) as e:
        _finish(run_dir, False, f"error: {e}", EXIT_BAD_INPUT)
    except BaseException as e:
        line = _storage_line(e, run_dir.path)
        if line:
            _finish(run_dir, False, f"error: {line}", 1)
        run_dir.log_only(traceback.format_exc())  # Python prints it to the console
        run_dir.close(ok=False)
        raise
    run_dir.close(ok=True)


def _take(run_dir: RunDir, resume_cmd: ResumeCommand, fresh: bool) -> str | None:
    """Rank 0: own the run directory (one live run per directory), start its log, save the
    resume command and clean what a killed process of this run left. The line that refuses the
    start, or None."""
    try:
        refused = run_dir.own()
        if refused:
            return refused
        run_dir.open()
        if line := run_dir.taken_over():
            print(line, flush=True)
        resume_cmd.save()
        if line := clean_leftovers(run_dir.path, fresh):
            print(line, flush=True)
    except OSError as e:
        line = storage_error(e, e.filename or run_dir.path)
        run_dir.close(ok=False)
        return line or f"cannot write the run directory {run_dir.path}: {e}"
    return None


def _storage_line(e: BaseException, run_dir: str) -> str | None:
    """A full disk, a quota, a file-size limit: one line naming what was being written (the
    file when the error knows it, else a checkpoint's folder or the run directory)."""
    if isinstance(e, KeyboardInterrupt | SystemExit):
        return None
    path = getattr(e, "filename", None)
    if path:
        return storage_error(e, path)
    saving = any(f.name == "save_checkpoint" for f in traceback.extract_tb(e.__traceback__))
    path = os.path.join(run_dir, "checkpoints") if saving else run_dir
    return storage_error(e, path, ("a checkpoint under " if saving else "under ") + path)


def _finish(run_dir: RunDir, ok: bool, msg: str, code: int, hard: bool = False) -> None:
    """The last line goes to the console and the log, then the log closes (a run dir of a start
    that failed is removed) and the process exits; `hard`: without teardown (see comm.die)."""
    if msg:
        print(msg, file=sys.stderr, flush=True)
        run_dir.note(msg)
    run_dir.close(ok)
    if hard:
        die("", code)
    sys.exit(code)


def run_distributed(
    cfg: RunConfig, run_dir: RunDir, roles: Roles | None, resume_cmd: ResumeCommand, fresh: bool
) -> None:
    """One rank of the job (roles None: colocated data parallel). Any failure ends this process
    with a message naming the rank; peers notice (gloo at once, NCCL via the deadlines) and exit
    too, so the job never hangs silently."""
    rank = launcher_env()[0]
    tag = f"[rank {rank}{'' if roles is None else ' ' + roles.role(rank)}]"
    writer = rank == (0 if roles is None else roles.trainer_rank(0))  # says how to resume
    ok = False
    try:
        ctx = init_distributed(
            cfg.topology.backend, cfg.topology.timeout_s, cfg.topology.startup_timeout_s
        )
    except (ValueError, FileNotFoundError) as e:
        die(f"{tag} error: {e}", EXIT_BAD_INPUT)
    ctx.liveness = _watch(ctx, roles, tag, run_dir)
    # rank 0 owns the directory; every rank learns whether the start is refused
    refused = ctx.broadcast_object(_take(run_dir, resume_cmd, fresh) if rank == 0 else None, 0)
    if refused:
        die(f"error: {refused}" if rank == 0 else "", EXIT_BAD_INPUT)
    run_dir.open()  # the split run's first trainer logs to train.log too
    try:
        if roles is None:
            run_colocated(cfg, run_dir.path, ctx=ctx)
        else:
            run_split(cfg, run_dir.path, ctx, roles)
        try:
            ctx.barrier()
        except RuntimeError as e:
            raise PeerError(
                f"not every rank reached the end of the run: {_first_line(e)}"
            ) from None
        ok = True
    except Interrupted as e:
        msg = resume_cmd.line(e) if writer else ""  # a split worker stopped with the trainers
        _finish(run_dir, True, msg, exit_code(e.signum), True)
    except KeyboardInterrupt:
        msg = f"{tag} {resume_cmd.line(None)}" if writer else ""
        _finish(run_dir, False, msg, exit_code(stop_signal()), hard=True)
    except (PeerError, BadBatchError) as e:
        if stop_signal() is not None:  # asked to stop: the peers stopping too is no failure
            _finish(run_dir, True, "", exit_code(stop_signal()), hard=True)
        why = ctx.explain(e) if isinstance(e, PeerError) else str(e)
        _finish(run_dir, False, f"{tag} pipeline stopped: {why}", EXIT_PIPELINE, hard=True)
    except (ValueError, FileNotFoundError) as e:
        _finish(run_dir, False, f"{tag} error: {e}", EXIT_BAD_INPUT, hard=True)
    except BaseException as e:  # noqa: BLE001 - any other failure must still end the process
        line = _storage_line(e, run_dir.path)
        if line:
            _finish(run_dir, False, f"{tag} error: {line}", 1, hard=True)
        msg, code = _cause(e, tag, ctx, wait_for_receiver=roles is not None)
        _finish(run_dir, False, msg, code, hard=True)  # the line reaches train.log too
    if ctx.liveness is not None:
        ctx.liveness.stop()
    run_dir.close(ok=ok)
    shutdown()


def _watch(ctx: RankContext, roles: Roles | None, tag: str, run_dir: RunDir) -> Liveness | None:
    """This rank's heartbeat and the watchdog that ends it, naming the peer, once a peer has
    been silent for topology.timeout_s (dflash.common.liveness)."""

    def name(r: int) -> str:
        return f"rank {r}" + (f" ({roles.role(r)})" if roles is not None else "")

    try:
        live = Liveness(ctx.rank, ctx.world, ctx.timeout_s, name)
    except Exception:  # noqa: BLE001 - no store to reach: the message deadlines still name peers
        return None
    at_die(lambda line, code: live.stop(line))

    def silent_peer(line: str) -> None:  # from the watchdog's thread: leave at once
        run_dir.note(f"{tag} pipeline stopped: {line}")
        die(f"{tag} pipeline stopped: {line}", EXIT_PIPELINE)

    return live.start(silent_peer)


def _cause(e: BaseException, tag: str, ctx: RankContext, wait_for_receiver: bool) -> tuple:
    """(last line, exit code) of a rank that failed outside the known errors."""
    # A collective among trainers breaks when a peer trainer stopped for a dead worker; give
    # this rank's receiver a moment to see the same root cause and report that instead.
    deadline = time.monotonic() + (2.0 if wait_for_receiver else 0.0)
    while ctx.root_cause is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if stop_signal() is not None and (ctx.root_cause is not None or _PEER_LOST.search(str(e))):
        return "", exit_code(stop_signal())  # asked to stop: the peers stopped too
    if ctx.root_cause is not None:
        return f"{tag} pipeline stopped: {ctx.explain(ctx.root_cause)}", EXIT_PIPELINE
    lost = isinstance(e, RuntimeError) and _PEER_LOST.search(str(e))
    if lost or isinstance(e, RuntimeError) and _TIMED_OUT.search(str(e)):
        why = ctx.liveness.explain() if ctx.liveness is not None else None
        if lost:
            why = why or "a peer rank exited during a collective (the first to stop names why)"
        else:
            waited = ctx.collective_timeout.total_seconds()
            why = f"a collective did not complete within {waited:g} s; " + (
                why or "every rank is alive: one of them hangs outside the collective"
            )
        return f"{tag} pipeline stopped: {why}: {_first_line(e)}", EXIT_PIPELINE
    traceback.print_exc()
    return f"{tag} failed: {type(e).__name__}: {e}", 1


def _first_line(e: BaseException) -> str:
    return (
        str(e).splitlines()[0].split(". This is typically")[0][:300] if str(e) else type(e).__name__
    )
