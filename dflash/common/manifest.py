"""Checkpoint integrity: `manifest.json` beside a checkpoint's files, with the sha256 of each, so
that a damaged or edited file is refused by name when the checkpoint is loaded instead of
resuming (or evaluating) on flipped bytes. It also records how the run stood when the checkpoint
was saved (`run`: step, and whether the run ended there), read without loading any tensor.

    {"files": {"config.json": "<sha256>", "model.safetensors": "...", "train_state.pt": "...",
               "optimizer/...": "..."},
     "run": {"step": 120, "ended": "budget", "time_budget_min": 30.0}}

A directory without a manifest (a published drafter, a checkpoint of an older dflash) loads as
before: there is nothing to check it against.
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _files_under(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != MANIFEST:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def write_manifest(root: str, run: dict | None = None) -> None:
    """Hash every file under `root` (written last, after every other file is complete)."""
    body = {"files": {rel: sha256_of(os.path.join(root, rel)) for rel in _files_under(root)}}
    if run:
        body["run"] = run
    tmp = os.path.join(root, f".{MANIFEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
    os.replace(tmp, os.path.join(root, MANIFEST))


def read_manifest(root: str) -> dict | None:
    """The manifest of a checkpoint directory, None when it has none."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            body = json.load(f)
        if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
            raise ValueError("no 'files' table")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is damaged ({str(e).splitlines()[0][:80]}); the checkpoint cannot be "
            "checked: use another step_* directory of the run"
        ) from None
    return body


def verify_manifest(root: str, only: list[str] | None = None) -> bool:
    """Check the files the manifest lists (or those of `only` it lists) against their sha256.
    Returns False when there is no manifest; raises ValueError naming the first file that is
    missing or differs."""
    body = read_manifest(root)
    if body is None:
        return False
    for rel, digest in sorted(body["files"].items()):
        if only is not None and rel not in only:
            continue
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            raise ValueError(
                f"{path} is missing (listed in {MANIFEST}); the checkpoint is incomplete: use "
                "another step_* directory of the run"
            )
        if sha256_of(path) != digest:
            raise ValueError(
                f"{path} differs from its sha256 in {MANIFEST} (damaged or changed since it was "
                "saved); refusing to load it: use another step_* directory of the run"
            )
    return True
