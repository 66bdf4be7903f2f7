"""The serving-format drafter directory (config.json + model.safetensors with exactly the
drafter's weights, reference names, and a manifest.json of their sha256), read and written;
published z-lab drafters (DFlash and DFlash2, dflash.drafter.variants; no manifest) load too.
Loading checks the files against the manifest and the weights for NaN / inf."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..common.manifest import verify_manifest, write_manifest
from ..common.storage import usual_mode
from .model import DFlashDrafter
from .spec import DrafterSpec
from .variants import build_model

# Serving weights are written in this dtype; the in-loop eval rounds to it (dflash.eval.offline).
EXPORT_DTYPE = torch.bfloat16


def save_drafter(
    path: str, drafter: DFlashDrafter, dtype: torch.dtype = EXPORT_DTYPE, manifest: bool = True
) -> None:
    """config.json + model.safetensors with exactly the drafter's weights (reference names), and
    their manifest.json (manifest=False: the caller writes it after adding its own files)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(drafter.spec.to_hf_config(str(dtype).removeprefix("torch.")), f, indent=2)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    usual_mode(os.path.join(path, "model.safetensors"))
    if manifest:
        write_manifest(path)


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights holding NaN or inf (a diverged run's, or damaged bytes that still parse)."""
    bad = [
        k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    if bad:
        raise ValueError(
            f"{where}: {len(bad)} weight tensor(s) hold NaN or inf ({', '.join(sorted(bad)[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); the checkpoint is not usable: use an earlier one"
        )


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


def load_drafter(
    path: str, device="cpu", strict: bool = True, verify: bool = True
) -> tuple[DFlashDrafter, dict]:
    """Load our checkpoints and published z-lab-format drafters. Returns (drafter, report) where
    report lists loaded / missing / unexpected parameter names. verify: check the files against
    the directory's manifest.json, when it has one (False: the caller has checked them)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if verify and os.path.isdir(path):
        verify_manifest(path, only=["config.json", *(os.path.basename(f) for f in files)])
    cfg = read_drafter_config(path)
    spec = DrafterSpec.from_hf_config(cfg)
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    tensors = {}
    for fn in files:
        try:
            with safe_open(fn, framework="pt", device="cpu") as f:
                for k in f.keys():
                    tensors[_own_name(k)] = f.get_tensor(k)
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
    drafter = build_model(spec)
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
    check_finite({k: tensors[k] for k in loaded}, path)
    drafter.load_state_dict({k: tensors[k].float() for k in loaded}, strict=False)
    report = {
        "loaded": len(loaded),
        "missing": missing,
        "skipped": unexpected,
        "fc_input": int(fc.shape[1]) if fc is not None else None,
    }
    return drafter.to(device), report


def _own_name(key: str) -> str:
    """A stored weight's name in our modules: without a leading `model.`, and the selector's
    codebooks without `.weight` (how a transformers save of the reference's nn.Embedding names
    them; the published files and our exports store `candidate_selector.*_codebook`)."""
    key = key.removeprefix("model.")
    if key.startswith("candidate_selector.") and key.endswith("_codebook.weight"):
        return key.removesuffix(".weight")
    return key
