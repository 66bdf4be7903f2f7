"""Regeneration throughput: the static-cache, graph-replayed greedy decoder (dflash.target.regen) with
and without compaction (ended rows leaving the batch), and HF `generate`, on the same prompts in
the same process, with the token agreement.

  python benchmarks/bench_regen.py --target smollm2_135m --batch 512 --new 256
  python benchmarks/bench_regen.py --target tiny --batch 64 --new 64 --check-every 8 --min-rows 8
  python benchmarks/bench_regen.py --target qwen2_5_coder_0_5b --batch 512 --new 256 --profile DIR

Random-weight stand-ins as in bench_loop (real weights where bench_loop finds them: their
tokenizer's EOS then). A random model rarely emits any one token, so with random weights --eos
auto forces EOS at pseudo-random steps of each row (see synthetic_eos), --end-frac of --new
tokens per row on average (0.67: the real recipe's ~171 of 256). --eos none: every row decodes
--new tokens (no compaction); --eos ID: that id as the model gives it. Compacted and uncompacted tokens must be the same
after the EOS cut (asserted in float32; in bf16 a smaller batch may run other kernels and flip
near-ties, so the agreement is reported).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_loop import build_target
from common import report, sync


def synthetic_eos(target, new: int, frac: float, pad: int):
    """A random model rarely emits any one token, so a forward hook makes EOS the greedy token
    of a row when a hash of the row's (position, input token) falls under p: rows end at spread
    steps (geometric, p set for a mean of frac * new tokens, at most new). The decision reads
    only the row's own state, so compaction and `generate` see the same ends; the model's
    computation is otherwise untouched. Returns (eos, p, the hook's handle)."""
    tok = target.tokenizer
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    V = target.model.get_output_embeddings().weight.shape[0]
    if eos is None or eos == pad:
        eos = V - 2 if V - 2 != pad else V - 3
    lo, hi = 1e-6, 1.0  # mean length (1 - (1 - p)^new) / p decreases with p
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if (1 - (1 - p) ** new) / p > frac * new else (lo, p)

    def hook(module, args, kwargs, out):
        ids, pos = kwargs["input_ids"][:, -1], kwargs["position_ids"][:, -1]
        x = (pos * 40503 + ids * 2654435761) % 2147483647
        x = (x * 48271) % 2147483647  # one Lehmer step: < 2^47, no overflow
        logits = out.logits[:, -1]
        end = x < int(p * 2147483647)
        logits[:, eos] = torch.where(end, torch.finfo(logits.dtype).max, logits[:, eos])

    return eos, p, target.model.register_forward_hook(hook, with_kwargs=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2_135m", help="a bench_loop target (tiny: CPU)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--eos", default="auto", help="auto | none | a token id")
    ap.add_argument("--end-frac", type=float, default=0.67, help="--eos auto: mean length/new")
    ap.add_argument("--check-every", type=int, default=32, help="steps between EOS checks")
    ap.add_argument("--min-rows", type=int, default=64, help="batches this small stay")
    ap.add_argument("--shrink", type=float, default=0.75, help="compact at <= this live share")
    ap.add_argument("--repeat", type=int, default=2, help="static timings: best of this many")
    ap.add_argument("--dtype", default="auto", help="float32 for bit-identity checks")
    ap.add_argument("--compile", action="store_true", help="also time the compiled step")
    ap.add_argument(
        "--skip-hf", action="store_true", help="no HF generate reference (its ~25 s at batch 512)"
    )
    ap.add_argument(
        "--fuse", action="store_true", help="also time data.regen_fuse (fused norm/RoPE/gate)"
    )
    ap.add_argument(
        "--profile", default=None, help="DIR: profile the static decode (no compaction)"
    )
    ap.add_argument("--profile-new", type=int, default=32, help="--profile: tokens per decode")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dflash.target.regen import StaticGreedyDecoder, cut_at_eos, hf_generate_batch, left_pad

    target, weights = build_target(args.target, "auto")
    if args.dtype == "float32":
        target.model.float()
    fp32 = next(target.model.parameters()).dtype == torch.float32
    dev = target.device
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g)
    prompts = [
        torch.randint(0, target.vocab_size - 1, (int(n),), generator=g).tolist() for n in lens
    ]
    pad = target.mask_token_id
    kw = dict(check_every=args.check_every, min_rows=args.min_rows, shrink=args.shrink)

    def static(ps, eos, compact=True, compile=False, fuse=False):
        ids, att = left_pad(ps, pad)
        dec = StaticGreedyDecoder(target.model, compile=compile, compact=compact, fuse=fuse, **kw)
        return cut_at_eos(dec.run(ids.to(dev), att.to(dev), args.new, eos), eos), dec

    def timed(fn):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        return out, time.perf_counter() - t

    hf_generate_batch(target, prompts[:4], 8, pad, None)  # warm-up (kernels, allocator)
    static(prompts[:4], None)
    eos, p_end = None, None
    if args.eos == "auto" and weights == "random":
        eos, p_end, _ = synthetic_eos(target, args.new, args.end_frac, pad)
    elif args.eos == "auto":
        eos = target.tokenizer.eos_token_id
    elif args.eos != "none":
        eos = int(args.eos)
    ref, t_hf = None, float("nan")
    if not args.skip_hf:
        ref, t_hf = timed(lambda: hf_generate_batch(target, prompts, args.new, pad, eos))

    def agree(a_rows, b_rows):
        same = sum(a == b for a, b in zip(a_rows, b_rows))
        first_diff = [
            next(
                (i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)),
            )
            for a, b in zip(a_rows, b_rows)
        ]
        diffs = [d for d in first_diff if d is not None]
        return same, min(diffs) if diffs else None

    t_st = t_c = float("inf")
    for _ in range(args.repeat):  # alternated, best of --repeat: the same warm state for both
        (plain, dec_p), t = timed(lambda: static(prompts, eos, compact=False))
        t_st = min(t_st, t)
        (got, dec_c), t = timed(lambda: static(prompts, eos))
        t_c = min(t_c, t)
    extra = {}
    if args.compile:  # the first call compiles (dynamic shapes: once), the others are timed
        (_, _), t_first = timed(lambda: static(prompts, eos, compact=False, compile=True))
        (got_k, _), t_k = timed(lambda: static(prompts, eos, compact=False, compile=True))
        (got_kc, dec_kc), t_kc = timed(lambda: static(prompts, eos, compile=True))
        extra = {
            "static_compiled_first_call_s": t_first,
            "static_compiled_s": t_k,
            "static_compiled_tokens_per_s": sum(len(r) for r in got_k) / t_k,
            "compile_speedup": t_st / t_k,  # against the graph-only step, no compaction
            "speedup_compiled": t_hf / t_k,
            "identical_rows_compiled": f"{agree(got_k, ref)[0]}/{len(ref)}" if ref else None,
            "static_compiled_compact_s": t_kc,
            "compile_compact_speedup": t_st / t_kc,
            "compiled_compact_batches": "/".join(str(b) for b, _ in dec_kc.stretches),
            "identical_rows_compiled_compact_vs_compiled": (
                f"{sum(a == b for a, b in zip(got_kc, got_k))}/{len(got_k)}"
            ),
        }

    if args.fuse:  # the first call compiles the three small functions (prefill and step shapes)
        (_, _), t_fuse_first = timed(lambda: static(prompts, eos, compact=False, fuse=True))
        t_f = t_fc = float("inf")
        for _ in range(args.repeat):
            (got_f, _), t = timed(lambda: static(prompts, eos, compact=False, fuse=True))
            t_f = min(t_f, t)
            (got_fc, _), t = timed(lambda: static(prompts, eos, fuse=True))
            t_fc = min(t_fc, t)
        extra |= {
            "static_fused_first_call_s": t_fuse_first,
            "static_fused_s": t_f,
            "static_fused_tokens_per_s": sum(len(r) for r in got_f) / t_f,
            "fuse_speedup": t_st / t_f,  # against the plain graph step, no compaction
            "static_fused_compact_s": t_fc,  # both: against the plain step too
            "fuse_compact_speedup": t_st / t_fc,
            "identical_rows_fused_compact_vs_compact": (
                f"{sum(a == b for a, b in zip(got_fc, got))}/{len(got)}"
            ),
        }

    same, first_div = agree(plain, ref) if ref else (None, None)
    same_c, first_div_c = agree(got, plain)
    tok = sum(len(r) for r in plain)
    steps = sum(n for _, n in dec_p.stretches)
    res = {
        "target": args.target,
        "weights": weights,
        "dtype": str(next(target.model.parameters()).dtype),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "batch": args.batch,
        "new_tokens": args.new,
        "eos": eos,
        "mean_response_len": tok / len(plain),
        "synthetic_eos_p": p_end,
        "rows_ended": sum(eos is not None and r[-1] == eos for r in plain),
        "cuda_graph": dec_c.graph_used,
        "hf_generate_s": t_hf,
        "hf_generate_tokens_per_s": tok / t_hf,
        "static_s": t_st,
        "static_tokens_per_s": tok / t_st,
        "static_compact_s": t_c,
        "static_compact_tokens_per_s": tok / t_c,
        "compact_speedup": t_st / t_c,
        "speedup": t_hf / t_st,
        "speedup_compact_vs_hf": t_hf / t_c,
        "compact_batches": "/".join(str(b) for b, _ in dec_c.stretches),
        "compact_steps": "/".join(str(n) for _, n in dec_c.stretches),
        "compact_row_steps_frac": sum(b * n for b, n in dec_c.stretches) / (args.batch * steps),
        "identical_rows": f"{same}/{len(ref)}" if ref else None,
        "first_divergence_min": first_div,
        "identical_rows_compact_vs_static": f"{same_c}/{len(plain)}",
        "first_divergence_compact_min": first_div_c,
        **extra,
        **(
            {"identical_rows_fused_vs_static": f"{agree(got_f, plain)[0]}/{len(plain)}"}
            if args.fuse
            else {}
        ),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }
    report(res, args.out)
    if args.profile:  # where a decode step's time goes: the graph replays' kernels, by kernel
        from common import profile_steps

        def decode(fuse: bool):
            def run(_):
                ids, att = left_pad(prompts, pad)
                StaticGreedyDecoder(target.model, compact=False, fuse=fuse, **kw).run(
                    ids.to(dev), att.to(dev), args.profile_new, None
                )

            return run

        for fuse in (False, True) if args.fuse else (False,):
            what = f"static decode, {'fused, ' if fuse else ''}{args.profile_new} tokens"
            path = args.profile + ("_fused" if fuse else "")
            profile_steps(path, dev, decode(fuse), what, n=2)
    if fp32:
        assert got == plain, "compacted tokens differ from the uncompacted decoder's"
    elif got != plain:
        print(f"warning: {len(plain) - same_c} rows differ after compaction ({res['dtype']})")


if __name__ == "__main__":
    main()
