"""The on-disk layout of a run, which every part reads: where checkpoints, the run config and the
metrics live, and how a path given by a user resolves to a checkpoint.

    <run_dir>/run_config.json          the resolved config (rank 0 writes it at start)
    <run_dir>/metrics.jsonl            one JSON row per logged step
    <run_dir>/checkpoints/step_00000100/{config.json, model.safetensors, train_state.pt,
                                         manifest.json, optimizer/ (fsdp, deepspeed)}
    <run_dir>/checkpoints/latest       a text file naming the newest step dir
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import torch

from ..config import RunConfig
from .manifest import read_manifest

STATE_FILE = "train_state.pt"


def find_checkpoint(path: str) -> str:
    """A step dir, or a run dir / checkpoints dir (-> its latest step)."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    for root in (os.path.join(path, "checkpoints"), path):
        latest = os.path.join(root, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                cand = os.path.join(root, f.read().strip())
            if os.path.isfile(os.path.join(cand, STATE_FILE)):
                return cand
    for root in (
        os.path.join(path, "checkpoints"),
        path,
    ):  # `latest` lost: newest complete step dir
        steps = sorted(
            d
            for d in (os.listdir(root) if os.path.isdir(root) else [])
            if d.startswith("step_") and os.path.isfile(os.path.join(root, d, STATE_FILE))
        )
        if steps:
            return os.path.join(root, steps[-1])
    raise FileNotFoundError(
        f"no resumable checkpoint under {path!r} (expected a step_* directory "
        f"with {STATE_FILE}, or a run directory with checkpoints/latest)"
    )


RUN_CONFIG = "run_config.json"


def is_off(resume) -> bool:
    return resume is None or str(resume).lower() in ("false", "none", "null", "")


def checkpoint_step(ckpt: str) -> int:
    name = os.path.basename(os.path.normpath(ckpt))
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return int(torch.load(os.path.join(ckpt, STATE_FILE), weights_only=False)["step"])


def run_dir_of(ckpt: str) -> str | None:
    """The run directory a step directory belongs to (`<run>/checkpoints/step_N`), else None."""
    parent = os.path.dirname(os.path.abspath(ckpt))
    if os.path.basename(parent) == "checkpoints":
        return os.path.dirname(parent)
    return None


def _checkpoint_or_none(path: str) -> str | None:
    try:
        return find_checkpoint(path)
    except FileNotFoundError:
        return None


def read_run_config(run_dir: str | None) -> dict | None:
    path = os.path.join(run_dir, RUN_CONFIG) if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def newest_run_of(out_root: str, exp_name: str) -> str:
    """The checkpoint of the newest run under out_root whose run_config.json records exp_name."""
    found = []
    for d in glob.glob(os.path.join(out_root, "*")):
        saved = read_run_config(d)
        ck = _checkpoint_or_none(d) if saved and saved.get("exp_name") == exp_name else None
        if ck:
            found.append((os.path.getmtime(ck), ck))
    if not found:
        raise FileNotFoundError(
            f"resume=true but no run of experiment exp_name={exp_name} with a checkpoint under "
            f"out_root={out_root!r}; pass resume=/path/to/run_or_step_dir, or run_name=NAME "
            "to continue that run"
        )
    return max(found)[1]


def keep_metrics_until(run_dir: str, step: int) -> list[int]:
    """Keep the metric rows up to the checkpoint being continued (the rows past it are trained
    again), in place, so the file stays the run's one metrics.jsonl. A row that does not parse
    (a half-written last row of a killed run, a damaged block) is dropped alone; every row that
    parses is kept. Returns the line numbers of the dropped damaged rows."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    keep, damaged = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a row")
        except (ValueError, UnicodeDecodeError):
            damaged.append(n)
            continue
        if row.get("step", 0) <= step:
            keep.append(line + b"\n")
    # in place, not a new file: the logger already holds it open for appending
    with open(path, "r+b") as f:
        f.writelines(keep)
        f.truncate()
    return damaged


LAYOUT_CHANGES = "layout_changes"  # run_config.json: resumes that cut the steps differently


def note_layout_change(run_dir: str, change: dict) -> None:
    """Append a step layout change to run_config.json (kept by later write_run_config calls)."""
    saved = read_run_config(run_dir) or {}
    saved[LAYOUT_CHANGES] = [*saved.get(LAYOUT_CHANGES, []), change]
    _write_json(os.path.join(run_dir, RUN_CONFIG), saved)


def write_run_config(cfg: RunConfig, run_dir: str, extra: dict | None = None) -> None:
    """The resolved config, plus `extra` figures of the run's data (data_mix: each mix source's
    share of samples and tokens) and the step layout changes of earlier resumes."""
    body = {**dataclasses.asdict(cfg), **(extra or {})}
    try:
        changes = (read_run_config(run_dir) or {}).get(LAYOUT_CHANGES)
    except ValueError:  # a damaged file is replaced: it holds nothing to keep
        changes = None
    if changes:
        body[LAYOUT_CHANGES] = changes
    _write_json(os.path.join(run_dir, RUN_CONFIG), body)


def _write_json(path: str, body: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=2, default=str)
    os.replace(tmp, path)


def ended_at(ckpt: str) -> dict:
    """How the run stood at this checkpoint, from its manifest ({} when it has none):
    `ended` "steps" or "budget" when the run finished there, and the budget it ran on."""
    body = read_manifest(ckpt)
    return (body or {}).get("run") or {}
