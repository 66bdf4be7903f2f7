"""The drafter's elementwise chains (RMSNorm, RoPE, the SwiGLU gate) as one fused kernel each on
CUDA: `torch.compile` of the small function alone, with dynamic shapes (one compile per variant:
training, no-grad eval), the same math eager elsewhere. In eager mode each chain is 4-10 kernels
over [N, Q, H] activations and their float32 copies (~15 % of a Qwen2.5-0.5B drafter step on an
H200 in a torch profile)."""

from __future__ import annotations

import functools

import torch

# Set by the trainer from train.fuse (off by default: on the H200 it made the Qwen2.5-0.5B
# drafter step 1.21x faster and the SmolLM2-135M one 0.81x, docs/performance.md); tests and
# bench_loop switch it per call.
ENABLED = False


def fused(fn):
    compiled = None

    @functools.wraps(fn)
    def run(x, *args):
        nonlocal compiled
        if not (ENABLED and x.is_cuda) or torch.compiler.is_compiling():
            return fn(x, *args)  # inside a compiled model it is traced as is
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args)

    return run
