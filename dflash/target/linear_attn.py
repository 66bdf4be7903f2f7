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
    if getattr(fn, "_dflash_kernel", None):
        return fn._dflash_kernel
    mod = getattr(fn, "__module__", "") or ""
    if mod.split(".")[0] == "fla":
        return "fla"
    if mod.split(".")[0] == "causal_conv1d":
        return "causal_conv1d"
    if mod.startswith("transformers.") or mod.startswith("torch"):
        return "torch fallback"
    return "hub kernel"


def _qualname(fn) -> str:
    if getattr(fn, "_dflash_kernel", None):
        return fn._dflash_kernel_name
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


# The ops of a Gated-DeltaNet layer that run a fla (or causal_conv1d) kernel: module globals the
# layer's forward looks up at each call.
_KERNEL_GLOBALS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def conv1d_on_fla(kernel):
    """transformers' `causal_conv1d_fn` contract (x [B, D, T] -> [B, D, T], weight [D, W], bias,
    activation) on fla's Triton `causal_conv1d` (x [B, T, D] -> (y [B, T, D], final state)).
    transformers' x is the transpose of the in-projection's [B, T, D] output, so the kernel reads
    it without a copy, and the [B, D, T] view returned is transposed back the same way. `kernel` is
    a parameter so the CPU tests can hold a torch function to fla's contract."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        y, _ = kernel(
            hidden_states.transpose(1, 2),
            weight,
            bias,
            activation=activation,
            cu_seqlens=kwargs.get("cu_seq_lens_q"),
        )
        return y.transpose(1, 2)

    causal_conv1d_fn._dflash_kernel = "fla"
    causal_conv1d_fn._dflash_kernel_name = (
        f"{getattr(kernel, '__module__', '?')}.{getattr(kernel, '__name__', '?')}"
    )
    return causal_conv1d_fn


def use_fla_conv1d(mod, kernel=None) -> bool:
    """Bind fla's Triton causal conv1d in a Gated-DeltaNet modeling module whose
    `causal_conv1d_fn` fell back to torch (transformers looks for the `causal_conv1d` package
    only; fla ships the same op). The torch fallback is a grouped `F.conv1d` on a transposed copy:
    25 ms of each 4k-token forward of the 27B target (H200 profile, 2026-12-04). Returns whether
    it bound (False: a kernel is bound already, or fla has no conv1d)."""
    current = getattr(mod, "causal_conv1d_fn", None)
    if current is None or _impl_kind(_bound_implementation(current)) != "torch fallback":
        return False
    if kernel is None:
        try:
            from fla.modules.causal_conv1d import causal_conv1d as kernel
        except ImportError:
            return False
    bound = conv1d_on_fla(kernel)
    bound._dflash_replaced = current  # the fallback, for benchmarks that time both
    mod.causal_conv1d_fn = bound
    return True


def kernels_outside_compile(mod) -> list[str]:
    """Make the kernel ops of a Gated-DeltaNet modeling module opaque to `torch.compile`: a
    compiled layer breaks its graph around them and calls them as the eager forward does, so
    compiling a whole Gated-DeltaNet layer fuses the norms, gates and MLP around the kernels
    without tracing into them (compiled whole before, the 27B layers ran transformers' torch
    fallback: 0.58x eager on an H200, 2026-12-05). Torch-fallback ops stay traceable. Idempotent;
    returns the ops made opaque."""
    done = []
    for name in _KERNEL_GLOBALS:
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        if getattr(fn, "_dflash_opaque", False):
            done.append(name)
            continue
        if _impl_kind(_bound_implementation(fn)) == "torch fallback":
            continue
        opaque = torch.compiler.disable(fn)
        opaque._dflash_opaque = True
        setattr(mod, name, opaque)
        done.append(name)
    return done


def prepare_fla_kernels(model: nn.Module) -> None:
    """For a target bound to fla: fla's conv1d where transformers fell back to torch, and the
    kernel ops opaque to torch.compile (`target.compile_layers` may then compile whole layers)."""
    mod = sys.modules.get(type(model).__module__)
    if mod is None or mod.__name__ not in _GDN_MODULES:
        return
    use_fla_conv1d(mod)
    kernels_outside_compile(mod)
