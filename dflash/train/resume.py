"""Checkpoints of a training run and resuming them: the serving-format drafter
(dflash.drafter.checkpoint) plus train_state.pt (fp32 master weights, optimizer, scheduler, step,
RNG, stream position), written atomically; resume restores all of it on every rank.

A step directory is written under a temporary name and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a half-written one.

`train.keep_best=FIGURE` (`BestCheckpoint`): beside the periodic checkpoints, the drafter of the
eval that scored highest on one in-loop eval figure, in `checkpoints/best` (serving files only,
no resume state). A budgeted run can go past its peak: SmolLM2-135M's 20-minute DFlash2 run
scored 4.153 at 17 epochs and 4.098 at its last step (docs/history/2026-12-06.md). Selecting by
the prompts that also report the figure overstates it: name a held-out set's figure
(`eval/stdlib_heldout/tau`). The directory is replaced atomically, and on resume a best kept at
a later step than the one resumed from (or for another figure) is removed (those steps are
trained again).
"""

from __future__ import annotations

import glob
import math
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..common.comm import RankContext
from ..common.layout import (
    STATE_FILE,
    find_checkpoint,
    is_off,
    keep_metrics_until,
    newest_run_of,
    note_layout_change,
)
from ..common.manifest import read_manifest, verify_manifest, write_manifest
from ..config import RunConfig
from ..data.stream import SampleStream
from ..drafter.checkpoint import check_finite, load_drafter, read_drafter_config, save_drafter
from ..drafter.model import DFlashDrafter
from ..drafter.spec import DrafterSpec
from .parallelize import SHARDS_DIR


def _rng_state() -> dict:
    st = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if st.get("cuda") and torch.cuda.is_available():
        # Only this rank's own device: the saving job may have seen more devices (an 8-GPU
        # checkpoint resumed on fewer GPUs has states for devices that do not exist here).
        dev = torch.cuda.current_device()
        if dev < len(st["cuda"]):
            torch.cuda.set_rng_state(st["cuda"][dev], dev)


def save_checkpoint(
    run_dir: str,
    step: int,
    drafter: DFlashDrafter,
    train_state: dict,
    keep_last: int = 2,
    extra: dict | None = None,
    *,
    shards=None,
    writer: bool = True,
    run_info: dict | None = None,
) -> str:
    """Write checkpoints/step_N: serving files, train_state.pt, manifest.json (last); refused
    when a weight is NaN or inf, so a diverged run never replaces a good checkpoint.

    shards: the trainer's `Parallel` when each rank holds part of the optimizer state: then every
    trainer rank calls this (a collective), each writes its part to `optimizer/`, and the writer
    (the group's first rank) writes the rest and renames the directory into place.
    run_info: how the run stands (`ended`: the run finished at this step), kept in the manifest."""
    weights = drafter.state_dict()
    check_finite(weights, f"not saving step {step}: the drafter")  # every rank: same weights
    root = os.path.join(run_dir, "checkpoints")
    name = f"step_{step:08d}"
    final = os.path.join(root, name)
    tmp = _agreed(os.path.join(root, f".{name}.tmp{os.getpid()}"), shards)
    if writer:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    try:
        if shards is not None:
            _barrier(shards)
            shards.save_shards(os.path.join(tmp, SHARDS_DIR))
            _barrier(shards)
        if writer:
            # bf16 serving weights; fp32 master weights go with the resume state
            save_drafter(tmp, drafter, manifest=False)
            master = {k: v.detach().to("cpu", torch.float32).clone() for k, v in weights.items()}
            torch.save(
                {
                    "trainer": train_state,
                    "rng": _rng_state(),
                    "step": step,
                    "drafter_fp32": master,
                    **(extra or {}),
                },
                os.path.join(tmp, STATE_FILE),
            )
            write_manifest(tmp, {"step": step, **(run_info or {})})
    except BaseException:  # an interrupted save leaves nothing behind but the previous checkpoint
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if writer:
        _put_in_place(root, name, tmp, keep_last)
    if shards is not None:
        _barrier(shards)  # the step directory is in place before any rank goes on
    return final


def _aside(root: str, name: str) -> str:
    """root/name renamed to `.NAME.oldPID` (what a start's recovery looks for); returns that."""
    old = os.path.join(root, f".{name}.old{os.getpid()}")
    os.replace(os.path.join(root, name), old)
    return old


def _swap_in(root: str, name: str, tmp: str) -> None:
    """Rename the finished directory `tmp` to root/name; an existing one is moved aside first
    and removed after, so root/name is never half-written."""
    final = os.path.join(root, name)
    if not os.path.exists(final):
        os.replace(tmp, final)
        return
    old = _aside(root, name)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _remove(root: str, name: str) -> None:
    """root/name moved aside, as `_swap_in` does, and removed."""
    shutil.rmtree(_aside(root, name), ignore_errors=True)


def _put_in_place(root: str, name: str, tmp: str, keep_last: int) -> None:
    _swap_in(root, name, tmp)
    latest_tmp = os.path.join(root, f".latest.tmp{os.getpid()}")
    with open(latest_tmp, "w") as f:
        f.write(name + "\n")
    os.replace(latest_tmp, os.path.join(root, "latest"))
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for old in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def _agreed(tmp: str, shards) -> str:
    """The writer's temporary directory name, on every rank that writes into it."""
    if shards is None or shards.group is None:
        return tmp
    box = [tmp]
    dist.broadcast_object_list(box, src=dist.get_global_rank(shards.group, 0), group=shards.group)
    return box[0]


def _barrier(shards) -> None:
    if shards.group is not None:
        dist.barrier(group=shards.group)


def load_checkpoint(path: str, drafter: DFlashDrafter | None = None, verify: bool = True) -> dict:
    """The train state of a step directory (or of a run's newest), on the CPU whatever device
    saved it, its files checked against manifest.json (verify) and its fp32 master weights
    (`state["weights"]`) for NaN / inf. With `drafter`: its config must be the checkpoint's, and
    the weights are loaded into it."""
    ck = find_checkpoint(path)
    if verify:
        verify_manifest(ck)
    spec = DrafterSpec.from_hf_config(read_drafter_config(ck))
    if drafter is not None and spec.as_dict() != drafter.spec.as_dict():
        raise ValueError(f"resume: drafter config in {ck} differs from this run's drafter config")
    state_file = os.path.join(ck, STATE_FILE)
    try:
        # map_location: every rank reads to the host (not onto the saving rank's GPU); the
        # optimizer moves its state to its parameters' device when it loads it
        state = torch.load(state_file, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, ...: torch raises many types
        raise ValueError(
            f"{state_file} is not a readable train state ({type(e).__name__}); the checkpoint "
            "is damaged: resume from another step_* directory of the run"
        ) from None
    if not isinstance(state, dict) or "trainer" not in state:
        raise ValueError(f"{state_file} holds no train state; resume from another step_* directory")
    weights = state.get("drafter_fp32") or load_drafter(ck, verify=False)[0].state_dict()
    check_finite(weights, state_file)
    if drafter is not None:
        drafter.load_state_dict(weights)
    state["weights"], state["path"] = weights, ck
    return state


# ----------------------------------------------------------------------------- resume, run config
def resume_path(cfg: RunConfig, run_dir: str) -> str | None:
    """The launcher has already resolved resume=true to a checkpoint (`rundir.plan_run`); a
    caller that did not gets this run dir's own checkpoint, else this experiment's newest."""
    r = cfg.resume
    if is_off(r):
        return None
    if str(r).lower() == "true":
        try:
            return find_checkpoint(run_dir)
        except FileNotFoundError:
            return newest_run_of(cfg.out_root, cfg.exp_name)
    return str(r)


def resume_from(ckpt: str, trainer, stream: SampleStream, logger, verify: bool = True) -> dict:
    """Optimizer (its whole state, in ddp), scheduler, step, RNG and the stream position; the
    weights follow in `_load_weights` (a collective of the trainers in sharded modes). Returns
    the checkpoint's state."""
    state = load_checkpoint(ckpt, verify=verify)
    trainer.load_state_dict(state["trainer"])
    stream.load_state_dict(state["source"]["stream"])
    _set_rng_state(state["rng"])
    logger.info(
        f"resumed from {state['path']} at step {trainer.step} (sample position {stream.position})"
    )
    return state


def _load_weights(trainer, state: dict) -> None:
    """The fp32 master weights, and in sharded modes each rank's part of the optimizer state:
    every trainer rank at once (fsdp and DeepSpeed load them as collectives)."""
    trainer.par.load_weights(state["weights"])
    if trainer.par.shards_optimizer:
        trainer.par.load_shards(os.path.join(state["path"], SHARDS_DIR))


def layout_changes(old: dict | None, now: dict) -> dict:
    """{key: (then, now)} of the step layout keys that differ (none known for old checkpoints)."""
    return {k: (old[k], v) for k, v in now.items() if old and k in old and old[k] != v}


def _say_layout_change(changes: dict, step: int, run_dir: str, logger) -> None:
    """A resume that cuts the sample stream into steps differently no longer reproduces the
    uninterrupted run: one line, and the change kept in run_config.json."""
    then = {k: a for k, (a, _) in changes.items()}
    now = {k: b for k, (_, b) in changes.items()}
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
    logger.info(
        f"resume: the step layout changed at step {step} ({what}); from here on the run is not "
        "the uninterrupted one (another cut of the samples into steps); recorded in "
        "run_config.json (layout_changes)"
    )
    note_layout_change(run_dir, {"step": step, "from": then, "to": now})


def resume(
    cfg: RunConfig,
    run_dir: str,
    trainer,
    stream: SampleStream,
    logger,
    ctx: RankContext | None = None,
    src: int = 0,
) -> dict:
    """Rank `src` (the first trainer) resolves and loads the checkpoint (checking its files
    against the manifest), then announces {ckpt, step, position} to every rank of the job: the
    other trainers load the same one, split workers start producing at exactly that stream
    position. In sharded modes every trainer then reads its part of the optimizer state.
    Returns the announcement."""
    start = state = None
    if ctx is None or ctx.rank == src:
        ckpt = resume_path(cfg, run_dir)
        ckpt = find_checkpoint(ckpt) if ckpt else None  # a run dir -> its latest step
        if ckpt:
            state = resume_from(ckpt, trainer, stream, logger)
            # the run continues in its own metrics.jsonl: rows past the checkpoint are redone
            for line in keep_metrics_until(run_dir, trainer.step):
                logger.info(f"metrics.jsonl: line {line} is damaged (not JSON); dropped it")
            if changes := layout_changes(state["trainer"].get("layout"), trainer.layout()):
                _say_layout_change(changes, trainer.step, run_dir, logger)
        start = {"ckpt": ckpt, "step": trainer.step, "position": stream.position}
    if ctx is not None and ctx.world > 1:
        start = ctx.broadcast_object(start, src=src)
        if ctx.rank != src and start["ckpt"]:
            state = resume_from(start["ckpt"], trainer, stream, logger, verify=False)
            if (trainer.step, stream.position) != (start["step"], start["position"]):
                raise ValueError(
                    f"trainer rank {ctx.rank} resumed at step {trainer.step}, position "
                    f"{stream.position}; trainer rank {src} at {start}"
                )
    if state is not None:
        _load_weights(trainer, state)
    return start


# ------------------------------------------------------------------------ train.keep_best

BEST_DIR = "best"


class BestCheckpoint:
    """`checkpoints/best` and the figure it was kept for (train.keep_best; module docstring)."""

    def __init__(self, run_dir: str, metric: str, resumed_step: int, writer: bool = True):
        self.metric = metric
        self.path = os.path.join(run_dir, "checkpoints", BEST_DIR)
        self.value: float | None = None
        self.step: int | None = None
        self.writer = writer
        if writer:
            self._recover()
        kept = (read_manifest(self.path) or {}).get("run") or {}
        self._stale: dict | None = None  # a best on disk this run does not continue
        if kept.get("best_metric") == metric and kept.get("step", resumed_step + 1) <= resumed_step:
            self.value, self.step = float(kept["best_value"]), int(kept["step"])
        elif os.path.isdir(self.path):
            self._stale = {**kept, "resumed_step": resumed_step}

    def start(self, prefixes: list[str]) -> str | None:
        """When the loop starts (a resume too, before any training): the figure must name one of
        the eval's sets (`prefixes`: eval/ or eval/<set>/), since eval.sets may change at a
        resume; then a best kept after the resumed step, or for another figure, is removed, so
        checkpoints/best never holds a drafter of discarded steps. Returns the line saying so."""
        if not any(
            self.metric.startswith(p) and "/" not in self.metric[len(p) :] for p in prefixes
        ):
            raise ValueError(
                f"train.keep_best={self.metric!r} names no set of this run's eval (its figures "
                f"start with {' or '.join(prefixes)}); name one of them, or train.keep_best=''"
            )
        if self._stale is None or not self.writer:
            return None
        _remove(os.path.dirname(self.path), BEST_DIR)
        k, self._stale = self._stale, None
        return (
            f"best: removed {self.path} ({k.get('best_metric')} at step {k.get('step')}; "
            f"resumed at step {k['resumed_step']}, keeping {self.metric})"
        )

    def check(self, metrics: dict) -> None:
        """The metric is one this run's eval reports (the step-0 eval: before any training)."""
        if self.metric not in metrics:
            names = sorted(k for k in metrics if k.startswith("eval/") and "@" not in k)
            raise ValueError(
                f"train.keep_best={self.metric!r} is not a figure this run's eval reports; "
                f"choose one of {names}"
            )

    def offer(self, step: int, metrics: dict, drafter) -> bool:
        """Keep `drafter` when `metrics[metric]` beats every earlier eval's (ties keep the
        earlier). Every rank calls it with the same all-reduced figures; the writer writes."""
        self.check(metrics)
        value = float(metrics[self.metric])
        if not math.isfinite(value) or (self.value is not None and not value > self.value):
            return False
        self.value, self.step = value, step
        if self.writer:
            self._write(step, value, drafter)
        return True

    def _recover(self) -> None:
        """A process killed between moving the old `best` aside and renaming the new one into
        place left `.best.oldPID` and no `best`: put it back (any other old copy goes; a
        `.best.tmpPID` is removed with the run's other leftovers when it starts)."""
        root = os.path.dirname(self.path)
        olds = sorted(glob.glob(os.path.join(root, f".{BEST_DIR}.old*")), key=os.path.getmtime)
        if olds and not os.path.exists(self.path):
            os.replace(olds.pop(), self.path)
        for old in olds:
            shutil.rmtree(old, ignore_errors=True)

    def _write(self, step: int, value: float, drafter) -> None:
        root = os.path.dirname(self.path)
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, f".{BEST_DIR}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_drafter(tmp, drafter, manifest=False)
            write_manifest(tmp, {"step": step, "best_metric": self.metric, "best_value": value})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _swap_in(root, BEST_DIR, tmp)
