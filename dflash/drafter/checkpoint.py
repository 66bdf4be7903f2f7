"""The serving-format drafter directory (config.json + model.safetensors with exactly the
drafter's weights, reference names), read and written; published z-lab drafters load too."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..common.storage import usual_mode
from .model import DFlashDrafter, DrafterSpec

# Serving weights are written in this dtype; the in-loop eval rounds to it (dflash.eval.offline).
EXPORT_DTYPE = torch.bfloat16


def save_drafter(path: str, drafter: DFlashDrafter, dtype: torch.dtype = EXPORT_DTYPE) -> None:
    """config.json + model.safetensors with exactly the drafter's weights (reference names)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(drafter.spec.to_hf_config(str(dtype).removeprefix("torch.")), f, indent=2)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    usual_mode(os.path.join(path, "model.safetensors"))


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
