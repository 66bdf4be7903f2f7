"""Checkpoints: serving-format drafter directories + resume state, written atomically.

Layout of a run:  <run_dir>/checkpoints/step_00000100/{config.json, model.safetensors,
train_state.pt}  and  <run_dir>/checkpoints/latest  (a text file naming the newest step dir).
A step directory is written under a temporary name and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a half-written one.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .drafter import DFlashDrafter, DrafterSpec

STATE_FILE = "train_state.pt"
# Serving weights are written in this dtype; the in-loop eval rounds to it (dflash.evaluation).
EXPORT_DTYPE = torch.bfloat16


def save_drafter(path: str, drafter: DFlashDrafter, dtype: torch.dtype = EXPORT_DTYPE) -> None:
    """config.json + model.safetensors with exactly the drafter's weights (reference names)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(drafter.spec.to_hf_config(str(dtype).removeprefix("torch.")), f, indent=2)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def read_drafter_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(
            f"{path}: no config.json; expected a DFlash drafter directory "
            "(config.json + model.safetensors)"
        )
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e})") from None


def load_drafter(path: str, device="cpu", strict: bool = True) -> tuple[DFlashDrafter, dict]:
    """Load our checkpoints and published z-lab-format drafters. Returns (drafter, report) where
    report lists loaded / missing / unexpected parameter names."""
    cfg = read_drafter_config(path)
    spec = DrafterSpec.from_hf_config(cfg)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    tensors = {}
    for fn in files:
        try:
            with safe_open(fn, framework="pt", device="cpu") as f:
                for k in f.keys():
                    tensors[k.removeprefix("model.")] = f.get_tensor(k)
        except Exception as e:  # safetensors raises several types for corrupt files
            raise ValueError(
                f"{fn} is not a readable safetensors file ({type(e).__name__}: {e})"
            ) from None
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] % spec.hidden_size == 0:
        k = fc.shape[1] // spec.hidden_size
        if k != spec.num_aux:
            raise ValueError(
                f"{path}: fc input {fc.shape[1]} = {k} target layers but "
                f"dflash_config.target_layer_ids has {spec.num_aux}"
            )
    drafter = DFlashDrafter(spec)
    own = drafter.state_dict()
    loaded = [k for k in tensors if k in own]
    unexpected = sorted(k for k in tensors if k not in own)
    missing = sorted(k for k in own if k not in tensors)
    bad_shape = [
        f"{k}: {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}"
        for k in loaded
        if tensors[k].shape != own[k].shape
    ]
    if bad_shape:
        raise ValueError(f"{path}: weight shapes do not match config.json: {bad_shape[:3]}")
    if strict and missing:
        raise ValueError(
            f"{path}: missing drafter weights {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    drafter.load_state_dict({k: tensors[k].float() for k in loaded}, strict=False)
    report = {
        "loaded": len(loaded),
        "missing": missing,
        "skipped": unexpected,
        "fc_input": int(fc.shape[1]) if fc is not None else None,
    }
    return drafter.to(device), report


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
