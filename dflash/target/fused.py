"""The target's short elementwise chains in a decode step (RMSNorm, RoPE, the SwiGLU gate;
dflash.common.chains) as one compiled kernel each, for the static greedy decoder
(`data.regen_fuse`). A one-token step of a small model is mostly such kernels: Qwen2.5-0.5B's is
~1,030 kernels, ~680 of them in these chains, which fused are ~100 (a CPU count of its aten ops).
Only modules whose eager math is exactly the fused function's are swapped (checked per class),
and only within `fused_decoding`."""

from __future__ import annotations

import contextlib
import sys

import torch

from ..common.chains import rms_norm, rope, silu_gate

FUSE_BACKEND = "inductor"  # tests swap in "eager" (the same patching without a C++/Triton build)
_COMPILED: dict = {}


# module attributes (tests spy on them): the shared chains, RoPE with transformers' signature
_rms_norm = rms_norm
_silu_mul = silu_gate


def _rope(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rope(q, cos, sin), rope(k, cos, sin)


def _compiled_fn(fn):
    """fn torch.compiled once per process and backend (dynamic shapes: every batch size, cache
    length and layer reuse the one graph). Inductor rounds to bf16 where eager does
    (`emulate_precision_casts`): left to itself it keeps a chain's intermediates in float32 and
    rounds once, which changed ~26-34 % of the bf16 outputs of each chain (CPU, 2026-12-05) and
    75 of 512 regenerated rows on the H200 bench. With it RoPE and the SiLU gate give the eager
    bits; RMSNorm sums its float32 mean in another order, so ~4 in 10^6 bf16 outputs are one
    step off (CPU, 3.7M outputs)."""
    key = (fn, FUSE_BACKEND)
    if key not in _COMPILED:
        opts = {"emulate_precision_casts": True} if FUSE_BACKEND == "inductor" else None
        _COMPILED[key] = torch.compile(fn, dynamic=True, backend=FUSE_BACKEND, options=opts)
    return _COMPILED[key]


def _tensors(out) -> tuple:
    """A chain's output as a tuple of tensors (RoPE returns two)."""
    return (out,) if torch.is_tensor(out) else tuple(out)


def _close(a, b) -> bool:
    """Equal up to the rounding of their dtype (torch.testing's default tolerances)."""
    try:
        for x, y in zip(_tensors(a), _tensors(b), strict=True):
            torch.testing.assert_close(y, x)
    except (AssertionError, ValueError):
        return False
    return True


class _Checked:
    """A chain's compiled function that checks its first call outside a CUDA graph capture
    against the eager function (equal up to rounding: `_close`), on the decoder's own inputs. A
    compile error (at any call) or another result puts the chain back on the eager function for
    good, said once. Only that first result is compared: a later graph (the one-token step's)
    is trusted once it compiles."""

    def __init__(self, eager):
        self.eager, self.compiled, self.state = eager, _compiled_fn(eager), "unchecked"

    def __call__(self, *args):
        if self.state == "eager":
            return self.eager(*args)
        try:
            out = self.compiled(*args)
        except Exception as e:  # a compile error: the eager chain instead
            return self._fail(f"compiling failed ({type(e).__name__}: {str(e)[:200]})", args)
        if self.state == "unchecked" and not _capturing(out):
            if not _close(self.eager(*args), out):
                return self._fail("its compiled result differs from eager beyond rounding", args)
            self.state = "checked"
        return out

    def _fail(self, why: str, args):
        self.state = "eager"
        print(
            f"warning: data.regen_fuse: {self.eager.__name__}: {why}; regeneration runs the "
            "eager chain",
            file=sys.stderr,
            flush=True,
        )
        return self.eager(*args)


_CHECKED: dict = {}


def _checked(fn) -> _Checked:
    """One checked chain per function and backend, like the compiled ones."""
    key = (fn, FUSE_BACKEND)
    if key not in _CHECKED:
        _CHECKED[key] = _Checked(fn)
    return _CHECKED[key]


def _capturing(out) -> bool:
    t = _tensors(out)[0]
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


def fusable_parts(model):
    """(RMSNorm modules, SwiGLU MLP modules, the modeling module whose apply_rotary_pos_emb it
    calls or None) whose eager math is exactly `_rms_norm` / down(`_silu_mul`) / `_rope`:
    checked on a small random input per class (a norm with another formula, e.g. 1 + weight,
    or another activation keeps its own forward)."""
    norms, mlps, checked = [], [], {}
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        cls = type(m)
        w = getattr(m, "weight", None)
        if cls.__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and w is not None:
            if cls not in checked:
                x = torch.randn(2, w.shape[-1], generator=g).to(w)
                with torch.no_grad():
                    checked[cls] = _same(m(x), _rms_norm(x, w, m.variance_epsilon))
            if checked[cls]:
                norms.append(m)
        elif all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            cls = (cls, type(m.act_fn))  # the activation is a submodule: per kind of it
            if cls not in checked:
                x = torch.randn(2, m.gate_proj.in_features, generator=g).to(m.gate_proj.weight)
                with torch.no_grad():
                    ref = m.down_proj(_silu_mul(m.gate_proj(x), m.up_proj(x)))
                    checked[cls] = _same(m(x), ref)
            if checked[cls]:
                mlps.append(m)
    mod = None
    attn = next((m for m in model.modules() if hasattr(m, "q_proj")), None)
    cand = sys.modules.get(type(attn).__module__) if attn is not None else None
    if cand is not None and callable(getattr(cand, "apply_rotary_pos_emb", None)):
        q, k = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 1, 4, 8, generator=g)
        cos, sin = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
        if _same(cand.apply_rotary_pos_emb(q, k, cos, sin), _rope(q, k, cos, sin)):
            mod = cand
    return norms, mlps, mod


@contextlib.contextmanager
def fused_decoding(model, enabled: bool = True):
    """Within (`data.regen_fuse`): the target's RMSNorms, the SwiGLU gate of its MLPs and its
    RoPE each one compiled kernel (`fusable_parts`: only where the eager math is the same). A
    one-token decode step of a small model is mostly such short kernels: Qwen2.5-0.5B's step is
    ~1,030 kernels, ~680 of them in these chains (~100 once fused). Restored on exit."""
    if not enabled:
        yield
        return
    norms, mlps, mod = fusable_parts(model)
    rms, silu_mul, rope = (_checked(f) for f in (_rms_norm, _silu_mul, _rope))
    for m in norms:
        m.forward = lambda x, m=m: rms(x, m.weight, m.variance_epsilon)
    for m in mlps:
        m.forward = lambda x, m=m: m.down_proj(silu_mul(m.gate_proj(x), m.up_proj(x)))
    eager_rope = mod.apply_rotary_pos_emb if mod is not None else None
    if mod is not None:
        mod.apply_rotary_pos_emb = rope
    try:
        yield
    finally:
        for m in (*norms, *mlps):
            vars(m).pop("forward", None)
        if mod is not None:
            mod.apply_rotary_pos_emb = eager_rope
