"""DFlash2's candidates: `torch.topk` against `dflash.drafter.topk.tiled_topk` over the rows of one
lm_head chunk, in alternating rounds in one process, with the values checked equal.

  python benchmarks/bench_topk.py                                  # the Qwen2.5 recipe's chunk
  python benchmarks/bench_topk.py --rows 2048 --vocab 248320       # Qwen3.6's vocabulary
  python benchmarks/bench_topk.py --device cpu --rows 256 --dtype float32
  python benchmarks/bench_topk.py --compile inductor     # + tiled_topk through torch.compile

The default shape is what the fused DFlash2 head takes a top-16 of per chunk in the 0.5B recipe
(`train.lm_head_chunk` 2048 rows of the 151,936-token vocabulary, bf16). In the 2026-12-06 H100
profile of that step, `torch.topk` was 7.0 ms of its 33.7 ms of kernels (20.6 %). With
tiled_topk (2.2x on an H100) the tile maxima (eager `aten::amax`) read the chunk at ~0.9 TB/s, a
quarter of the bandwidth; `--compile` times the same function compiled (dynamic shapes, as the
step's chunks vary) to see what a generated max would give before the step takes it.
"""

from __future__ import annotations

import argparse

import torch
from common import alternating, report, sync, timed

from dflash.drafter.topk import TILE, tiled_topk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compile", default=None, help="also tiled_topk under torch.compile(backend=)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.rows, a.vocab, device=a.device).to(getattr(torch, a.dtype)) * 3
    fns = {"torch_topk": lambda: x.topk(a.k, dim=-1), "tiled_topk": lambda: tiled_topk(x, a.k)}
    if a.compile:
        compiled = torch.compile(tiled_topk, backend=a.compile, dynamic=True)
        fns["tiled_topk_compiled"] = lambda: compiled(x, a.k)
    want, got = fns["torch_topk"](), fns["tiled_topk"]()
    got_c = fns["tiled_topk_compiled"]() if a.compile else got  # compiles here, untimed
    sync(a.device)
    times, _ = alternating(fns, a.rounds, lambda f: timed(f, a.device, a.iters), a.device)
    res = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows x vocab, k": f"{a.rows} x {a.vocab}, {a.k} ({a.dtype}, tiles of {TILE})",
        "values_equal": bool(torch.equal(want.values, got[0])),
        "indices_equal": bool(torch.equal(want.indices, got[1])),
        "torch_topk_ms": times["torch_topk"] * 1e3,
        "tiled_topk_ms": times["tiled_topk"] * 1e3,
        "speedup": times["torch_topk"] / times["tiled_topk"],
    }
    if a.compile:
        res |= {
            "compile_backend": a.compile,
            "compiled_values_equal": bool(torch.equal(want.values, got_c[0])),
            "tiled_topk_compiled_ms": times["tiled_topk_compiled"] * 1e3,
            "compiled_speedup": times["tiled_topk"] / times["tiled_topk_compiled"],
        }
    report(res, a.out)
    if not res["values_equal"] or not res.get("compiled_values_equal", True):
        raise SystemExit("tiled_topk's values differ from torch.topk's")


if __name__ == "__main__":
    main()
