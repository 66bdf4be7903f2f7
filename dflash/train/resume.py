"""Checkpoints of a training run and resuming them: the serving-format drafter
(dflash.drafter.checkpoint) plus train_state.pt (fp32 master weights, optimizer, scheduler, step,
RNG, stream position), written atomically; resume restores all of it on every rank.

A step directory is written under a temporary name and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a half-written one.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch

from ..common.comm import RankContext
from ..common.layout import STATE_FILE, find_checkpoint, is_off, keep_metrics_until, newest_run_of
from ..config import RunConfig
from ..data.stream import SampleStream
from ..drafter.checkpoint import load_drafter, save_drafter
from ..drafter.model import DFlashDrafter


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
) -> str:
    root = os.path.join(run_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"step_{step:08d}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".{name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter(
            tmp, drafter
        )  # bf16 serving weights; fp32 master weights go with the resume state
        master = {
            k: v.detach().to("cpu", torch.float32).clone() for k, v in drafter.state_dict().items()
        }
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
    except BaseException:  # an interrupted save leaves nothing behind but the previous checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):  # move the old one aside first: `final` is never half-written
        old = os.path.join(root, f".{name}.old{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    latest_tmp = os.path.join(root, f".latest.tmp{os.getpid()}")
    with open(latest_tmp, "w") as f:
        f.write(name + "\n")
    os.replace(latest_tmp, os.path.join(root, "latest"))
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for old in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def load_checkpoint(path: str, drafter: DFlashDrafter) -> dict:
    ck = find_checkpoint(path)
    loaded, report = load_drafter(ck)
    if loaded.spec.as_dict() != drafter.spec.as_dict():
        raise ValueError(f"resume: drafter config in {ck} differs from this run's drafter config")
    state_file = os.path.join(ck, STATE_FILE)
    try:
        state = torch.load(state_file, weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, ...: torch raises many types
        raise ValueError(
            f"{state_file} is not a readable train state ({type(e).__name__}); the checkpoint "
            "is damaged: resume from another step_* directory of the run"
        ) from None
    if not isinstance(state, dict) or "trainer" not in state:
        raise ValueError(f"{state_file} holds no train state; resume from another step_* directory")
    drafter.load_state_dict(state.get("drafter_fp32") or loaded.state_dict())
    _set_rng_state(state["rng"])
    state["path"] = ck
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


def resume_from(ckpt: str, trainer, stream: SampleStream, logger) -> None:
    """Weights (fp32 master), optimizer, scheduler, step, RNG and the stream position."""
    state = load_checkpoint(ckpt, trainer.drafter)
    trainer.load_state_dict(state["trainer"])
    stream.load_state_dict(state["source"]["stream"])
    logger.info(
        f"resumed from {state['path']} at step {trainer.step} (sample position {stream.position})"
    )


def resume(
    cfg: RunConfig,
    run_dir: str,
    trainer,
    stream: SampleStream,
    logger,
    ctx: RankContext | None = None,
    src: int = 0,
) -> dict:
    """Rank `src` (the first trainer) resolves and loads the checkpoint, then announces
    {ckpt, step, position} to every rank of the job: the other trainers load the same one, split
    workers start producing at exactly that stream position. Returns the announcement."""
    start = None
    if ctx is None or ctx.rank == src:
        ckpt = resume_path(cfg, run_dir)
        ckpt = find_checkpoint(ckpt) if ckpt else None  # a run dir -> its latest step
        if ckpt:
            resume_from(ckpt, trainer, stream, logger)
            # the run continues in its own metrics.jsonl: rows past the checkpoint are redone
            keep_metrics_until(run_dir, trainer.step)
        start = {"ckpt": ckpt, "step": trainer.step, "position": stream.position}
    if ctx is None or ctx.world == 1:
        return start
    start = ctx.broadcast_object(start, src=src)
    if ctx.rank != src and start["ckpt"]:
        resume_from(start["ckpt"], trainer, stream, logger)
        if (trainer.step, stream.position) != (start["step"], start["position"]):
            raise ValueError(
                f"trainer rank {ctx.rank} resumed at step {trainer.step}, position "
                f"{stream.position}; trainer rank {src} at {start}"
            )
    return start
