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
import re
import shutil

import torch

from ..config import RunConfig
from .manifest import read_manifest
from .storage import writing

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


def drafter_dir(path: str) -> str:
    """A drafter directory (config.json + weights) from what a user names: a step directory or
    a published drafter as it is, a run directory or its checkpoints/ (-> the step that
    checkpoints/latest names, else the newest step_*), or the file checkpoints/latest itself."""
    p = os.path.normpath(os.path.expanduser(path))
    if os.path.isfile(p) and os.path.basename(p) == "latest":
        with open(p) as f:
            p = os.path.join(os.path.dirname(p), f.read().strip())
    if os.path.isfile(os.path.join(p, "config.json")) or glob.glob(
        os.path.join(p, "*.safetensors")
    ):
        return p  # a drafter (one missing its config.json is named by load_drafter)
    for root in (os.path.join(p, "checkpoints"), p):
        latest = os.path.join(root, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                cand = os.path.join(root, f.read().strip())
            if os.path.isfile(os.path.join(cand, "config.json")):
                return cand
        steps = sorted(
            d
            for d in (os.listdir(root) if os.path.isdir(root) else [])
            if d.startswith("step_") and os.path.isfile(os.path.join(root, d, "config.json"))
        )
        if steps:
            return os.path.join(root, steps[-1])
    what = "is not a directory" if not os.path.exists(p) else "holds no drafter"
    raise FileNotFoundError(
        f"ckpt={path!r} {what}: name a drafter directory (config.json + model.safetensors: a "
        "step_* directory or a published drafter), a run directory (its newest checkpoint), or "
        "its checkpoints/latest"
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
    """The run's run_config.json (None: it has none); a damaged one is a ValueError naming it."""
    path = os.path.join(run_dir, RUN_CONFIG) if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is damaged (not valid JSON: {e}); the run's config is rewritten when it "
            "starts again: delete the file to resume without checking that its data and model "
            "are unchanged"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} is damaged (a JSON {type(saved).__name__}, not the run's config)")
    return saved


def newest_run_of(out_root: str, exp_name: str) -> str:
    """The checkpoint of the newest run under out_root whose run_config.json records exp_name;
    a run whose run_config.json is damaged is skipped with a line."""
    found = []
    for d in sorted(glob.glob(os.path.join(out_root, "*"))):
        try:
            saved = read_run_config(d)
        except ValueError as e:
            print(f"resume=true: skipping {d}: {e}", flush=True)
            continue
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


# what a process killed while writing leaves: a step directory or `latest` being saved, an old
# step being replaced, a file written under a temporary name (run config, caches, shards)
_LEFTOVER = re.compile(r"\.(step_\d+\.(tmp|old)|latest\.tmp)\d+|.+\.tmp\d*")


def clean_leftovers(run_dir: str, fresh: bool) -> str | None:
    """Remove what killed processes of this run left in its directory (the caller owns it, so
    nothing there is being written): temporary files and folders of interrupted saves, and on a
    fresh start the metrics of an earlier start that saved no checkpoint (they would be
    duplicated). A shared data.cache_dir outside the run directory is left alone. Returns the
    line that says what went, or None."""
    gone = []

    def drop(path: str, own: bool) -> None:
        name = os.path.basename(path)
        if _LEFTOVER.fullmatch(name) and (own or _writer_gone(name)):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            gone.append(os.path.relpath(path, run_dir))

    for root in (run_dir, os.path.join(run_dir, "checkpoints")):
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            drop(os.path.join(root, name), own=True)
    # another run may read and write this run's data dir (its data.cache_dir): there only what
    # a process that is gone left
    data = os.path.join(run_dir, "data")
    for name in sorted(os.listdir(data)) if os.path.isdir(data) else []:
        path = os.path.join(data, name)
        if name.endswith(".partial") and os.path.isdir(path):  # a regeneration's shards
            for part in sorted(os.listdir(path)):
                drop(os.path.join(path, part), own=False)
        else:
            drop(path, own=False)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if fresh and os.path.isfile(metrics):
        os.remove(metrics)
        gone.append("metrics.jsonl (of an earlier start that saved no checkpoint)")
    if not gone:
        return None
    return f"run dir: removed what an interrupted earlier start left: {', '.join(gone)}"


def _writer_gone(name: str) -> bool:
    """A `.tmpPID` file whose writer (a process of this host) no longer runs."""
    m = re.search(r"\.tmp(\d+)$", name)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


LAYOUT_CHANGES = "layout_changes"  # run_config.json: resumes that cut the steps differently
# run_config.json: the target's dtype as the run resolved it (target.dtype=auto: float32 on a CPU,
# bfloat16 on CUDA), which a resume may not change (dflash.run.plan.check_same_run)
TARGET_DTYPE = "target_dtype"


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
    with writing(path), open(tmp, "w") as f:
        json.dump(body, f, indent=2, default=str)
    os.replace(tmp, path)


def ended_at(ckpt: str) -> dict:
    """How the run stood at this checkpoint, from its manifest ({} when it has none):
    `ended` "steps" or "budget" when the run finished there, and the budget it ran on."""
    body = read_manifest(ckpt)
    return (body or {}).get("run") or {}
