"""DFlash2's candidates: `torch.topk` against `dflash.drafter.topk.tiled_topk` over the rows of one
lm_head chunk, in alternating rounds in one process, with the values checked equal.

  python benchmarks/bench_topk.py                                  # the Qwen2.5 recipe's chunk
  python benchmarks/bench_topk.py --rows 2048 --vocab 248320       # Qwen3.6's vocabulary
  python benchmarks/bench_topk.py --device cpu --rows 256 --dtype float32
  python benchmarks/bench_topk.py --compile inductor     # + tiled_topk through torch.compile
  python benchmarks/bench_topk.py --head                 # the fused head's whole pass: row vs tile stats

The default shape is what the fused DFlash2 head takes a top-16 of per chunk in the 0.5B recipe
(`train.lm_head_chunk` 2048 rows of the 151,936-token vocabulary, bf16). In the 2026-12-06 H100
profile of that step, `torch.topk` was 7.0 ms of its 33.7 ms of kernels (20.6 %). With
tiled_topk (2.2x on an H100) the tile maxima (eager `aten::amax`) read the chunk at ~0.9 TB/s, a
quarter of the bandwidth; `--compile` times the same function compiled (dynamic shapes, as the
step's chunks vary) to see what a generated max would give before the step takes it: 1.05x on
an H100 (2026-12-06), so the step kept the eager function. `--head` times what the fused head does
with a chunk (the CE stats and the top-16, the stats compiled as on CUDA): `rows`, the CE stats
over each row then `tiled_topk`'s own pass for the tile maxima, against `tiles`
(`train.fused_head=tiles`), the CE stats tile by tile, which hand `tiled_topk` the tile maxima
from their one pass; the loss, correct count, gradient and top-16 checked equal.
"""

from __future__ import annotations

import argparse

import torch
from common import alternating, report, sync, timed

from dflash.drafter.topk import TILE, tiled_topk
from dflash.train.fused_ce import _ce_stats, _ce_stats_tiled, _top_k


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
    ap.add_argument("--head", action="store_true", help="the fused head's pass: row vs tile stats")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.rows, a.vocab, device=a.device).to(getattr(torch, a.dtype)) * 3
    if a.head:
        return head(a, x)
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


def head(a, x: torch.Tensor) -> None:
    """The fused head's pass over one chunk of logits, row stats + tiled_topk vs tile stats
    handing tiled_topk their maxima; both stats compiled (Inductor, dynamic) unless on CPU."""
    backend = a.compile or ("inductor" if a.device == "cuda" else None)
    rows_fn, tiles_fn = _ce_stats, _ce_stats_tiled
    if backend:
        rows_fn = torch.compile(_ce_stats, backend=backend, dynamic=True)
        tiles_fn = torch.compile(_ce_stats_tiled, backend=backend, dynamic=True)
    labels = torch.randint(0, a.vocab, (a.rows,), device=a.device)
    w = torch.rand(a.rows, device=a.device)

    def rows():
        loss, correct, grad = rows_fn(x, labels, w, w, 1.0, None)
        return loss, correct, grad, _top_k(x, a.k, 1.0, None)

    def tiles():
        loss, correct, grad, tmax = tiles_fn(x, labels, w, w, 1.0, None)
        return loss, correct, grad, _top_k(x, a.k, 1.0, None, tmax)

    fns = {"rows": rows, "tiles": tiles}
    want, got = rows(), tiles()  # compiles here, untimed
    sync(a.device)
    times, peaks = alternating(fns, a.rounds, lambda f: timed(f, a.device, a.iters), a.device)
    res = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows x vocab, k": f"{a.rows} x {a.vocab}, {a.k} ({a.dtype}, tiles of {TILE})",
        "compile_backend": backend,
        "loss_rel_diff": float((want[0] - got[0]).abs() / want[0].abs()),
        "correct_equal": bool(torch.equal(want[1], got[1])),
        "grad_max_abs_diff": float((want[2].float() - got[2].float()).abs().max()),
        "topk_values_equal": bool(torch.equal(want[3][0], got[3][0])),
        "rows_ms": times["rows"] * 1e3,
        "tiles_ms": times["tiles"] * 1e3,
        "tiles_speedup": times["rows"] / times["tiles"],
        "gbytes_read_per_pass": x.numel() * x.element_size() / 1e9,
    }
    if peaks.get("rows") is not None:
        res |= {"peak_mem_rows_gib": peaks["rows"], "peak_mem_tiles_gib": peaks["tiles"]}
    report(res, a.out)
    if res["loss_rel_diff"] > 1e-4 or not res["correct_equal"] or not res["topk_values_equal"]:
        raise SystemExit("the tile stats differ from the row stats")


if __name__ == "__main__":
    main()
