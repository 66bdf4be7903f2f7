"""Shared helpers for benchmark scripts: timing with CUDA sync and an in-process matmul peak."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, iters: int, warmup: int = 1) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def alternating(fns: dict, rounds: int, measure, device) -> tuple[dict, dict]:
    """A/B timing: `measure(fn)` seconds of each fn, in alternating order over `rounds` (no
    order bias). Returns each one's median seconds and peak memory in GiB (None on CPU)."""
    cuda = torch.device(device).type == "cuda"
    times: dict = {name: [] for name in fns}
    mem: dict = {}
    for r in range(rounds):
        for name, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times[name].append(measure(fn))
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            mem[name] = max(mem.get(name) or 0.0, peak) if cuda else None
    return {name: statistics.median(ts) for name, ts in times.items()}, mem


def matmul_peak_tflops(device, dtype=torch.bfloat16, n: int = 8192, iters: int = 10) -> float:
    """The baseline every ratio is taken against: a large dense matmul in this process."""
    if torch.device(device).type != "cuda":  # a CPU figure means little: keep it quick
        n, dtype = 512, torch.float32  # (a bf16 1024^3 matmul takes seconds on a CPU)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = timed(lambda: a @ b, device, iters, warmup=3)
    return 2 * n**3 / s / 1e12


def load_target_yaml(name: str):
    from omegaconf import OmegaConf

    from dflash.config import TargetConfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raw = OmegaConf.to_container(
        OmegaConf.load(os.path.join(root, "conf", "target", f"{name}.yaml")), resolve=True
    )
    return TargetConfig(**raw)


def report(res: dict, out=None) -> None:
    """Print the figures one per line and optionally write them as JSON."""
    import json

    w = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:>{w}}: {v:.4g}" if isinstance(v, float) else f"{k:>{w}}: {v}")
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)


def profile_steps(path: str, dev, fn, what: str, n: int = 5) -> None:
    """dflash.common.profiling.StepProfiler over n calls of fn, after n calls timed without it: into
    directory `path` the tables by device and host time and a Chrome trace; printed: the
    unprofiled wall per call, the GPU's busy time (union of kernel intervals) and its share,
    and the trainer's phases (`dflash.*` ranges: host and device ms per call)."""
    from dflash.common.profiling import StepProfiler

    fn(0)
    sync(dev)
    prof = StepProfiler(n + 2, n, dev, path)
    for s in range(2 * n + 1):
        prof.before(s)
        fn(s)
        prof.after(s + 1)
        if prof.result is not None:
            break
    res = prof.result
    print(f"# {what}: " + StepProfiler.summary(res, path))
    for k, (host, device) in res["phases_ms_per_step"].items():
        print(f"#   {k}: host {host:.2f} ms, device {device:.2f} ms per call")
    with open(os.path.join(path, "summary.json"), "a") as f:
        f.write(json.dumps({"what": what} | res) + "\n")
