"""Gated-DeltaNet kernel selection for hybrid targets (Qwen3.5/3.6, Qwen3-Next): choose fla or
the torch fallback before transformers binds one at import, and report what was bound."""

from __future__ import annotations

import importlib
import os
import sys

import torch
from torch import nn

_GDN_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
# Canonical Gated-DeltaNet op -> module attribute names. transformers >= 5.15 binds each op
# through `use_kernel_func_from_hub_with_fallback`, a wrapper named after the torch function
# whose closure holds the chosen implementation; older versions expose the fla/causal_conv1d
# function (or None = torch fallback) under the kernel's own name.
_GDN_OPS = {
    "chunk_gated_delta_rule": ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
    "recurrent_gated_delta_rule": (
        "torch_recurrent_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
    ),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
    "causal_conv1d_update": ("causal_conv1d_update",),
}


def select_linear_attn_backend(backend: str, device: torch.device) -> str:
    """Decide the Gated-DeltaNet implementation before transformers imports its modeling code.

    transformers (>= 5.15) binds fla kernels at import of the modeling module if `fla` imports,
    with no device check; on a CPU-only machine with fla + triton the forward then crashes. So
    `torch` hides fla from the import system, and `fla` is refused without CUDA.
    Returns the resolved choice ("fla" or "torch").
    """
    if backend not in ("auto", "fla", "torch"):
        raise ValueError(f"target.linear_attn_backend={backend!r}; choose auto, fla or torch")
    if backend == "auto":
        backend = "fla" if device.type == "cuda" and _fla_importable() else "torch"
    if backend == "fla":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                "target.linear_attn_backend=fla needs a CUDA device (fla kernels are "
                "Triton GPU kernels); use linear_attn_backend=torch on CPU"
            )
        if not _fla_importable():
            if _HIDDEN_BY_DFLASH and "fla" in sys.modules and sys.modules["fla"] is None:
                raise ValueError(
                    "target.linear_attn_backend=fla, but this process already selected "
                    "the torch backend (fla is hidden from imports); the backend is bound "
                    "at import, so run the fla target in a fresh process"
                )
            raise ValueError(
                "target.linear_attn_backend=fla but flash-linear-attention is not "
                "installed; `pip install 'dflash[gpu]'` or use linear_attn_backend=torch"
            )
    already = [m for m in _GDN_MODULES if m in sys.modules]
    for mod in already:
        current = linear_attn_kind(linear_attn_report(sys.modules[mod]))
        if current in ("fla", "torch", "mixed") and current != backend:
            raise ValueError(
                f"target.linear_attn_backend: {mod} was imported with the {current} Gated-DeltaNet "
                f"kernels before dflash could select {backend!r}; select the backend before importing "
                "the model (use dflash.target.load_target) or start a fresh process"
            )
    if backend == "torch":
        _hide_gpu_kernels()
        quiet_fallback_warnings()
    return backend


_HIDDEN_BY_DFLASH = False


def _hide_gpu_kernels() -> None:
    """Make `import fla` / `import causal_conv1d` raise ImportError so transformers binds its
    torch fallbacks. If fla is already imported (by someone else), bind the GDN modeling modules
    now with fla hidden and then put fla back, so the rest of the process is untouched."""
    global _HIDDEN_BY_DFLASH
    if sys.modules.get("fla") is not None:
        saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
        for k in saved:
            del sys.modules[k]
        sys.modules["fla"] = None
        try:
            for m in _GDN_MODULES:
                importlib.import_module(m)
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
        return
    for name in ("fla", "causal_conv1d"):
        if name not in sys.modules:
            sys.modules[name] = None
            _HIDDEN_BY_DFLASH = True


def _fla_importable() -> bool:
    if "fla" in sys.modules:
        return sys.modules["fla"] is not None
    try:
        import importlib.util

        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        return False


def linear_attn_report(module=None) -> dict:
    """Which implementation each Gated-DeltaNet op of an imported modeling module is bound to.

    Values read "fla (<module.function>)", "causal_conv1d (...)", "hub kernel (...)" or
    "torch fallback (...)". With `module=None`, every imported GDN modeling module is reported
    (keys prefixed with the model type when more than one is imported)."""
    if module is not None:
        return _module_report(module)
    mods = [sys.modules[m] for m in _GDN_MODULES if sys.modules.get(m) is not None]
    if len(mods) == 1:
        return _module_report(mods[0])
    return {
        f"{m.__name__.rsplit('.', 1)[-1].removeprefix('modeling_')}.{k}": v
        for m in mods
        for k, v in _module_report(m).items()
    }


def linear_attn_summary(report: dict) -> str:
    """One line for a linear_attn_report: the implementation kind and its ops."""
    by_kind: dict[str, list[str]] = {}
    for op, impl in report.items():
        by_kind.setdefault(impl.split(" (", 1)[0], []).append(op)
    return "; ".join(f"{kind} ({', '.join(ops)})" for kind, ops in by_kind.items())


def quiet_fallback_warnings() -> None:
    """transformers warns once per Gated-DeltaNet op that it falls back to torch; when the torch
    backend is dflash's choice (and reported in one line) those four lines are noise. A user
    who sets TRANSFORMERS_VERBOSITY keeps transformers' own level."""
    if os.environ.get("TRANSFORMERS_VERBOSITY"):
        return
    import logging

    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)


def linear_attn_kind(report: dict) -> str:
    """ "fla", "torch", "mixed" or "none" (no GDN module imported) for a linear_attn_report."""
    kinds = {v.split(" (", 1)[0] for k, v in report.items() if "gated_delta_rule" in k}
    if not kinds:
        return "none"
    if kinds == {"fla"}:
        return "fla"
    if kinds == {"torch fallback"}:
        return "torch"
    return "mixed"


def _module_report(mod) -> dict:
    report = {}
    for op, names in _GDN_OPS.items():
        found = [getattr(mod, n) for n in names if hasattr(mod, n)]
        if not found:
            continue
        # A kernel anywhere wins (old layout: `kernel or torch_fn`; new: the wrapper's choice).
        impls = [_bound_implementation(fn) for fn in found if fn is not None]
        kernels = [f for f in impls if _impl_kind(f) != "torch fallback"]
        if kernels:
            report[op] = f"{_impl_kind(kernels[0])} ({_qualname(kernels[0])})"
        else:
            report[op] = f"torch fallback ({_qualname(impls[0]) if impls else 'inline torch code'})"
    return report


def _bound_implementation(fn, depth: int = 0):
    """Follow transformers' fallback wrapper (and any hub-kernel wrapper around it) to the
    function that actually runs."""
    code = getattr(fn, "__code__", None)
    cells = dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}
    if "implementation" in cells:
        try:
            return cells["implementation"].cell_contents
        except ValueError:  # empty cell
            pass
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None and depth < 8:
        return _bound_implementation(inner, depth + 1)
    return fn


def _impl_kind(fn) -> str:
    mod = getattr(fn, "__module__", "") or ""
    if mod.split(".")[0] == "fla":
        return "fla"
    if mod.split(".")[0] == "causal_conv1d":
        return "causal_conv1d"
    if mod.startswith("transformers.") or mod.startswith("torch"):
        return "torch fallback"
    return "hub kernel"


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"


def check_bound_backend(model: nn.Module, backend: str) -> str:
    """The Gated-DeltaNet implementation the loaded model really runs on ("fla"/"torch"), or
    "none" for a model without linear attention. transformers falls back to torch silently when
    fla fails to import; a run that asked for fla is refused instead of running slowly."""
    mod = sys.modules.get(type(model).__module__)
    if mod is None or mod.__name__ not in _GDN_MODULES:
        return "none"
    kind = linear_attn_kind(linear_attn_report(mod))
    if kind != backend:
        raise ValueError(
            f"target.linear_attn_backend={backend!r} but the Gated-DeltaNet ops are bound "
            f"to {kind}: {linear_attn_report(mod)} (fla failed to import, or the modeling "
            "module was imported before the backend was selected)"
        )
    return kind
