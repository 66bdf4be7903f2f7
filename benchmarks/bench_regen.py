"""Regeneration throughput: the static-cache, graph-replayed greedy decoder (dflash.regen)
against HF `generate` on the same prompts in the same process, with the token agreement.

  python benchmarks/bench_regen.py --target smollm2_135m --batch 256 --new 128

Random-weight stand-ins as in bench_loop (no EOS: every row decodes --new tokens).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_loop import build_target
from common import report, sync


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2_135m")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="float32 for bit-identity checks")
    ap.add_argument("--compile", action="store_true", help="also time the compiled step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dflash.regen import StaticGreedyDecoder, cut_at_eos, hf_greedy_batch, left_pad

    target, weights = build_target(args.target, "auto")
    if args.dtype == "float32":
        target.model.float()
    dev = target.device
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g)
    prompts = [
        torch.randint(0, target.vocab_size - 1, (int(n),), generator=g).tolist() for n in lens
    ]
    pad = target.mask_token_id

    def static(ps, compile=False):
        ids, att = left_pad(ps, pad)
        dec = StaticGreedyDecoder(target.model, compile=compile)
        out = cut_at_eos(dec.run(ids.to(dev), att.to(dev), args.new, None), None)
        return out, dec.graph_used

    def timed(fn):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        return out, time.perf_counter() - t

    hf_greedy_batch(target, prompts[:4], 8, pad, None)  # warm-up (kernels, allocator)
    static(prompts[:4])
    ref, t_hf = timed(lambda: hf_greedy_batch(target, prompts, args.new, pad, None))
    (got, graph), t_st = timed(lambda: static(prompts))
    extra = {}
    if args.compile:  # first call compiles (same shapes as the timed one), second is timed
        (_, _), t_first = timed(lambda: static(prompts, True))
        (got_c, _), t_c = timed(lambda: static(prompts, True))
        extra = {
            "static_compiled_first_call_s": t_first,
            "static_compiled_s": t_c,
            "static_compiled_tokens_per_s": sum(len(r) for r in got_c) / t_c,
            "speedup_compiled": t_hf / t_c,
            "identical_rows_compiled": f"{sum(a == b for a, b in zip(got_c, ref))}/{len(ref)}",
        }
    same = sum(a == b for a, b in zip(got, ref))
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, ref)
    ]
    diffs = [d for d in first_diff if d is not None]
    tok = sum(len(r) for r in ref)
    res = {
        "target": args.target,
        "weights": weights,
        "dtype": str(next(target.model.parameters()).dtype),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "batch": args.batch,
        "new_tokens": args.new,
        "cuda_graph": graph,
        "hf_generate_s": t_hf,
        "hf_generate_tokens_per_s": tok / t_hf,
        "static_s": t_st,
        "static_tokens_per_s": tok / t_st,
        "speedup": t_hf / t_st,
        "identical_rows": f"{same}/{len(ref)}",
        "first_divergence_min": min(diffs) if diffs else None,
        **extra,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }
    report(res, args.out)


if __name__ == "__main__":
    main()
