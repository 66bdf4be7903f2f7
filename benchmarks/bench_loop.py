"""The colocated training loop on one GPU, in one process: target capture alone, the drafter
step alone, and the loop (capture + step), each as tokens/s and TFLOP/s (from the model shapes)
against a bf16 matmul peak measured in the same run, with peak memory, and the loop's ratio to
the ideal 1 / (1/capture + 1/step).

  python benchmarks/bench_loop.py --target smollm2_135m
  python benchmarks/bench_loop.py --target qwen3_6_27b_random --rows 1 --seq 3072 --anchors 512

Real weights are used when present locally (smollm2_135m, qwen2_5_coder_0_5b); otherwise the
same config with random bf16 weights (reported as `weights: random`): throughput does not depend
on the weights. Synthetic samples: lengths uniform in [seq/2, seq], the first quarter prompt.
DFLASH_ROOT=<checkout> runs the same benchmark against another checkout's dflash package.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("DFLASH_ROOT"):
    sys.path.insert(0, os.path.abspath(os.environ["DFLASH_ROOT"]))

import argparse
import dataclasses
import time

import torch
from bench_target import forward_flops_per_token
from common import alternating, matmul_peak_tflops, profile_steps, report, sync

if os.environ.get("DFLASH_ROOT"):  # common.py put this checkout first: undo for dflash
    sys.path.insert(0, os.path.abspath(os.environ["DFLASH_ROOT"]))

# Published configs (random-weight stand-ins when the weights are not on this machine).
HF_CONFIGS = {
    "smollm2_135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "qwen2_5_coder_0_5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}
TARGETS = {  # name -> (target yaml, drafter yaml or None = 3 full-attention layers, mask id)
    "tiny": ("tiny_llama", "tiny", None),
    "smollm2_135m": ("smollm2_135m", None, 16),
    "qwen2_5_coder_0_5b": ("qwen2_5_coder_0_5b", None, 151662),
    "qwen3_6_27b_random": ("qwen3_6_27b_random", "qwen3_6_27b", None),
}


def build_target(name: str, backend: str):
    from dflash.config import TargetConfig
    from dflash.target.load import load_conf, load_target

    yaml_name, _, mask_id = TARGETS[name]
    raw = load_conf("target", yaml_name)
    weights = "random" if raw.get("config") else "real"
    if name in HF_CONFIGS:
        path = os.path.expanduser(str(raw.get("path", "")))
        if not os.path.exists(os.path.join(path, raw.get("gguf_file") or "config.json")):
            raw = {"name": name, "config": HF_CONFIGS[name], "mask_token_id": mask_id}
            weights = "random"
    raw.update(device="cuda" if torch.cuda.is_available() else "cpu", dtype="auto")
    raw["linear_attn_backend"] = backend
    fields = {f.name for f in dataclasses.fields(TargetConfig)}
    tcfg = TargetConfig(**{k: v for k, v in raw.items() if k in fields})
    return load_target(tcfg, num_aux=3 if TARGETS[name][1] != "qwen3_6_27b" else 5), weights


def build_drafter(name: str, target, layers: int | None = None, variant: str = "dflash"):
    from dflash.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.target.load import load_conf

    dname = TARGETS[name][1]
    raw = load_conf("drafter", dname) if dname else dict(num_layers=3, block_size=16)
    raw["target_layer_ids"] = list(target.layer_ids)
    if layers:
        raw["num_layers"], raw["layer_types"] = layers, None
    if variant != "dflash":  # DFlash2's selector codebooks of 64, as the recipe runs it
        raw["variant"], raw["selector_rank"] = variant, 64
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    dcfg = DrafterConfig(**{k: v for k, v in raw.items() if k in fields})
    try:  # current layout
        from dflash.drafter.spec import resolve_spec

        spec = resolve_spec(dcfg, target.shape)
    except ImportError:  # checkouts before the restructure (the recorded main baseline)
        from dflash.train.step import resolve_spec

        mc = target.model.config
        spec = resolve_spec(
            dcfg,
            target.num_layers,
            target.hidden_size,
            target.vocab_size,
            int(mc.intermediate_size),
            int(mc.num_attention_heads),
            int(getattr(mc, "num_key_value_heads", 0) or 0),
            target.mask_token_id,
        )
    if variant != "dflash":
        from dflash.drafter.variants import build_model

        d = build_model(spec)
    else:
        d = DFlashDrafter(spec)
    d.init_weights(0.02, torch.Generator().manual_seed(0))
    return d


def make_samples(n: int, seq: int, vocab: int, mask_id: int, seed: int, min_len=None):
    from dflash.data.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(min_len or seq // 2, seq + 1, (1,), generator=g))
        ids = torch.randint(0, vocab - 1, (L,), generator=g)
        ids[ids == mask_id] = (mask_id + 1) % vocab
        lm = torch.zeros(L, dtype=torch.bool)
        lm[L // 4 :] = True
        out.append(Sample(i, ids, lm))
    return out


def run_samples(path: str, n: int, seq: int, vocab: int, seed: int = 0) -> list:
    """n samples of a run's dataset cache in a seeded order (as the run draws them), each no
    longer than seq (the run's data.max_length) and within this target's vocabulary."""
    from dflash.data.dataset import load_samples

    pool = [s for s in load_samples(path) if s.input_ids.numel() <= seq]
    if len(pool) < n:
        raise SystemExit(f"error: {path} has {len(pool)} samples of <= {seq} tokens; need {n}")
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:n]
    out = []
    for i, j in enumerate(order.tolist()):
        s = pool[j]
        out.append(dataclasses.replace(s, sample_id=i, input_ids=s.input_ids.clamp(max=vocab - 2)))
    print(
        f"samples: {n} of {len(pool)} from {path}, mean {sum(s.input_ids.numel() for s in out) / n:.0f}"
        f" tokens, {sum(int(s.loss_mask.sum()) for s in out) / n:.0f} trained on"
    )
    return out


def drafter_step_flops(spec, tb, prepared) -> float:
    """Model FLOPs of one train step (forward x 3), counting only visible attention pairs."""
    if isinstance(prepared, tuple):  # before the restructure
        blocks, lvalid = prepared[0], prepared[2]
    else:
        blocks, lvalid = prepared.blocks, prepared.label_valid_NAK
    H, L, h, kv, d = (
        spec.hidden_size,
        spec.num_hidden_layers,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    )
    B, V, I = spec.block_size, spec.vocab_size, spec.intermediate_size
    ctx_tokens = int((tb.segment_ids_NT >= 0).sum())
    valid = blocks.valid_NA
    nq = int(valid.sum()) * B
    apos = tb.position_ids_NT.gather(1, blocks.anchors_NA)[valid].double()
    vis = 0.0
    for t in spec.layer_types:
        ctx = apos.clamp(max=spec.sliding_window) if t == "sliding_attention" else apos
        blk = B * (B + 1) / 2 if t == "sliding_attention" else B * B
        vis += float(ctx.sum()) * B + blk * apos.numel()
    fwd = ctx_tokens * (spec.num_aux * H * H + L * 2 * H * kv * d)
    fwd += nq * L * (2 * H * h * d + 2 * H * kv * d + 3 * H * I)
    fwd += vis * h * d * 2
    # the frozen lm_head: forward + input gradient (no weight gradient), on the labels the step
    # keeps (train.label_sampling=by_weight keeps a sample of them)
    labels = getattr(prepared, "num_labels", None)
    head = (int(lvalid.sum()) if labels is None else labels) * H * V
    return 3 * 2 * fwd + 2 * 2 * head


def throughput(fn, n: int, warmup: int, dev) -> float:
    """Seconds per call over n back-to-back calls (one sync at the end, as in a real loop)."""
    for i in range(warmup):
        fn(i)
    sync(dev)
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    sync(dev)
    return (time.perf_counter() - t) / n


def pair(key_a: str, s_a, key_b: str, s_b, ratio: str) -> dict:
    """An A/B pair's figures (ms each, and a / b), or nothing when it was not timed."""
    if not s_a or not s_b:
        return {}
    return {key_a: s_a * 1e3, key_b: s_b * 1e3, ratio: s_a / s_b}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny", choices=sorted(TARGETS))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=None, help="shortest sample (default seq/2)")
    ap.add_argument(
        "--samples",
        default=None,
        help="a run's regenerated dataset (<run>/data/*.pt): its samples (lengths, loss masks, "
        "tokens) instead of synthetic ones, in a seeded order; --seq: the run's data.max_length",
    )
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ab-rounds", type=int, default=4, help="alternating rounds of each A/B pair")
    ap.add_argument("--attn-kernel", default="auto", help="train.attn_kernel (this branch)")
    ap.add_argument("--compile", action="store_true", help="train.compile (this branch)")
    ap.add_argument("--fuse", action="store_true", help="train.fuse (the loop and the profile)")
    ap.add_argument(
        "--compile-target",
        action="store_true",
        help="target.compile_layers: each decoder layer compiled for the capture",
    )
    ap.add_argument("--layers", type=int, default=None, help="drafter layers (default: 3)")
    ap.add_argument(
        "--variant", default="dflash", help="drafter.variant (dflash2: selector rank 64)"
    )
    ap.add_argument(
        "--head-ab",
        action="store_true",
        help="the step with the fused lm_head + CE (CUDA's default; DFlash2's selection "
        "included) vs the checkpointed plain head, same process",
    )
    ap.add_argument(
        "--label-sampling",
        default="all",
        choices=["all", "by_weight"],
        help="train.label_sampling of the loop (the step is also timed both ways)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="directory: torch.profiler tables + traces of the step alone and the loop",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="skip the fused/eager and every-label/by-weight step A/Bs",
    )
    ap.add_argument(
        "--cudagraph-ab",
        action="store_true",
        help="with --compile: the loop with the drafter compiled as now vs "
        'mode="reduce-overhead" (CUDA graphs of its forward and backward), same process '
        "(2026-12-04, H200, torch 2.11: an unspecified launch failure; the A/B reports it)",
    )
    ap.add_argument(
        "--capture-only",
        action="store_true",
        help="time (and with --profile, profile) the target capture alone, then stop",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import dflash.data.batch as dbatch
    from dflash.config import TrainConfig
    from dflash.drafter.model import num_params
    from dflash.train.step import DrafterTrainer

    try:
        from dflash.target.shape import Heads
    except ImportError:  # before the restructure
        from dflash.train.step import Heads

    target, weights = build_target(args.target, args.backend)
    dev = target.device
    if args.compile_target:  # target.compile_layers: per layer, only inside the capture
        from dflash.target.graphs import CompiledLayers

        target.compiled_layers = CompiledLayers.of(target, True)
    drafter = build_drafter(args.target, target, args.layers, args.variant)
    tc = dict(
        max_anchors=args.anchors,
        steps=10_000,
        attn_kernel=args.attn_kernel,
        compile=args.compile,
        fuse=args.fuse,
        label_sampling=args.label_sampling,
    )
    tc = {k: v for k, v in tc.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}}
    tr = DrafterTrainer(drafter, Heads(target.embed_tokens, target.lm_head), TrainConfig(**tc), dev)
    peak = matmul_peak_tflops(dev)
    nb = 8  # distinct micro-batches, rotated
    if args.samples:  # the real run's length and loss-mask distribution
        samples = run_samples(args.samples, nb * args.rows, args.seq, target.vocab_size)
    else:
        samples = make_samples(
            nb * args.rows, args.seq, target.vocab_size, target.mask_token_id, 0, args.min_len
        )
    cpu_batches = [
        dbatch.collate(
            samples[i * args.rows : (i + 1) * args.rows],
            pad_id=target.mask_token_id,
            **({"pad_to": args.seq} if args.compile else {}),  # static shapes, as train.py
        )
        for i in range(nb)
    ]
    tokens = [
        sum(s.input_ids.numel() for s in samples[i * args.rows : (i + 1) * args.rows])
        for i in range(nb)
    ]
    new_api = hasattr(dbatch, "sample_spans")  # this branch: spans read on the host

    def capture(i):
        b = cpu_batches[i % nb]
        return dbatch.target_forward(target, b if new_api else b.to(dev))

    tbs = [capture(i) for i in range(nb)]
    seq_mean = sum(tokens) / (nb * args.rows)
    cap_flops = [forward_flops_per_token(target.model.config, seq_mean) * t for t in tokens]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    mem = {}

    def measure(name, fn, flops):
        torch.cuda.reset_peak_memory_stats() if dev.type == "cuda" else None
        s = throughput(fn, args.steps, args.warmup, dev)
        mem[name] = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
        return s, mean(tokens) / s, mean(flops) / s / 1e12

    # Capture alone in each way the target can run it (same batches): one sample per row, packed
    # rows (eager), packed rows replayed from CUDA graphs; the loop runs the default (the last).
    graphs = getattr(target, "capture_graphs", None)
    modes = {"rows": (False, None), "packed": (True, None), "graphs": (True, graphs)}
    if not getattr(target, "packs_capture", False):
        modes = {"rows": (False, None)}
    elif graphs is None:
        del modes["graphs"]
    per_mode = {}
    for mode, (packs, g) in modes.items():
        target.packs_capture, target.capture_graphs = packs, g
        target.pack_check_pending = False
        for i in range(nb):  # a graph bucket is captured the first time it is seen
            capture(i)
        per_mode[mode] = measure(f"capture_{mode}", capture, cap_flops)
    s_cap, tps_cap, tf_cap = per_mode[mode]
    if args.capture_only:
        res = {"target": args.target, "weights": weights, "rows": args.rows, "seq": args.seq,
               "tokens_per_batch": mean(tokens), "peak_tflops": peak}  # fmt: skip
        for m, (sm, tps, tf) in per_mode.items():
            res |= {f"capture_{m}_ms": sm * 1e3, f"capture_{m}_tokens_per_s": tps,
                    f"capture_{m}_frac_peak": tf / peak}  # fmt: skip
        report(res, args.out)
        if args.profile:
            profile_steps(f"{args.profile}/capture", dev, capture, f"capture alone ({mode})")
        return
    step_flops = [
        drafter_step_flops(drafter.spec, tbs[i], tr.prepare(tbs[i], 0)) for i in range(nb)
    ]
    # the loop's step queues its kernels and leaves its figures on the device (read at log
    # steps); train_step reads them back every step (one sync): both timed, same batches
    step_fn = getattr(tr, "step_async", tr.train_step)
    try:  # the drafter's elementwise chains fused (dflash.drafter.fuse) or eager, same process
        from dflash.drafter import fuse
    except ImportError:
        fuse = None

    def fused(on, fn):
        def run(i):
            if fuse is not None:
                fuse.ENABLED = on
            return fn(i)

        return run

    def ab(names, *fns, rounds=args.ab_rounds):
        """Median seconds per call of each fn, timed in alternating order (no order bias);
        their peak memory under mem[name]."""
        med, peaks = alternating(
            dict(zip(names, fns)),
            rounds,
            lambda fn: throughput(fn, args.steps, args.warmup, dev),
            dev,
        )
        for name, gib in peaks.items():
            mem[name] = None if gib is None else max(mem.get(name) or 0.0, gib)
        return tuple(med[n] for n in names)

    on = fuse is not None and fuse.ENABLED
    one = lambda i: step_fn([tbs[i % nb]])  # noqa: E731
    s_fz = s_eager = None
    if fuse is not None and not args.quick:  # fused and eager chains, alternating rounds
        s_fz, s_eager = ab(("step_fused", "step_eager"), fused(True, one), fused(False, one))
        s_step = s_fz if on else s_eager
    else:
        s_step = throughput(one, args.steps, args.warmup, dev)
    # every label vs labels kept by weight (train.label_sampling), the loop's mode restored after
    s_all = s_lw = None
    if hasattr(tr, "keep_p_k") and not args.quick:
        from dflash.train.losses import position_weights

        w = position_weights(drafter.spec.block_size, tr.cfg.gamma)
        mode_p = tr.keep_p_k

        def keep(p, fn):
            def run(i):
                tr.keep_p_k = p
                return fn(i)

            return run

        s_all, s_lw = ab(
            ("step_all_labels", "step_by_weight"),
            fused(on, keep(None, one)),
            fused(on, keep(w / w.max(), one)),
        )
        tr.keep_p_k = mode_p
    # the fused head (dflash.train.fused_ce) vs the checkpointed plain one, the default restored;
    # DFlash2 also with its CE stats tile by tile (train.fused_head=tiles)
    s_head_f = s_head_p = s_head_t = None
    obj = getattr(tr, "objective", None)
    if args.head_ab and hasattr(obj, "fused"):
        head_default = obj.fused, obj.tiles

        def head(on, fn, tiles=False):
            def run(i):
                obj.fused, obj.tiles = on, tiles
                return fn(i)

            return run

        names = ("step_fused_head", "step_plain_head")
        arms = [fused(on, head(True, one)), fused(on, head(False, one))]
        if obj.selector is not None:
            names += ("step_tiles_head",)
            arms.append(fused(on, head(True, one, tiles=True)))
        s_head_f, s_head_p, *tiled = ab(names, *arms)
        s_head_t = tiled[0] if tiled else None
        obj.fused, obj.tiles = head_default
    tps_step, tf_step = mean(tokens) / s_step, mean(step_flops) / s_step / 1e12
    loop_flops = [a + b for a, b in zip(cap_flops, step_flops)]
    loop = fused(on, lambda i: step_fn([capture(i)]))
    if args.quick:
        s_loop, s_rd = throughput(loop, args.steps, args.warmup, dev), None
    else:
        s_loop, s_rd = ab(
            ("loop", "loop_read"), loop, fused(on, lambda i: tr.train_step([capture(i)]))
        )
    tps_loop, tf_loop = mean(tokens) / s_loop, mean(loop_flops) / s_loop / 1e12
    # the colocated source (dflash.train.colocated) capturing in step vs one step ahead on a side
    # stream (topology.overlap_capture); both sources walk the same sample order
    s_src = s_ovl = None
    try:
        from dflash.config import RunConfig
        from dflash.train.colocated import LocalBatchSource

        def source(overlap):
            cfg = RunConfig()
            cfg.train.micro_batch_size, cfg.topology.overlap_capture = args.rows, overlap
            # the same padded rows as the batches above (one static compiled drafter graph)
            cfg.train.compile, cfg.data.max_length = args.compile, args.seq
            return LocalBatchSource(target, samples, cfg)

        if hasattr(RunConfig().topology, "overlap_capture"):
            src = {ov: source(ov) for ov in (False, True)}
            s_src, s_ovl = ab(
                ("loop_source", "loop_source_overlap"),
                fused(on, lambda i: step_fn(src[False].next_batches())),
                fused(on, lambda i: step_fn(src[True].next_batches())),
            )
    except ImportError:
        pass
    # the drafter compiled as train.compile does vs mode="reduce-overhead": its forward and
    # backward replayed as CUDA graphs (cudagraph trees), a step marked before each call
    s_c = s_cg = None
    if args.cudagraph_ab and args.compile:
        compiled = tr.model
        graphed = torch.compile(tr.par.model, dynamic=False, mode="reduce-overhead")

        def with_model(m):
            def run(i):
                tr.model = m
                if m is graphed:
                    torch.compiler.cudagraph_mark_step_begin()
                return step_fn([capture(i)])

            return run

        try:
            s_c, s_cg = ab(
                ("loop_compiled", "loop_cudagraphs"), with_model(compiled), with_model(graphed)
            )
        except Exception as e:  # noqa: BLE001 -- reported; the other figures still count
            print(f"cudagraph A/B failed: {type(e).__name__}: {e}", file=sys.stderr)
        tr.model = compiled
    ideal = 1 / (1 / tps_cap + 1 / tps_step)
    res = {
        "target": args.target,
        "weights": weights,
        "dflash": os.path.dirname(os.path.dirname(dbatch.__file__)),  # the package (DFLASH_ROOT)
        "attn_kernel": getattr(tr, "attn_kernel", "sdpa (main)"),
        "compile": bool(tc.get("compile")),
        "compile_target": args.compile_target,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows x seq (max)": f"{args.rows} x {args.seq}",
        "samples": args.samples or "synthetic",
        "tokens_per_step": mean(tokens),
        "anchors_per_row": args.anchors,
        "drafter_variant": args.variant,
        "drafter_params_M": num_params(drafter) / 1e6,
        "matmul_peak_tflops": peak,
        **{f"capture_{m}_ms": v[0] * 1e3 for m, v in per_mode.items()},
        "capture_mode": mode,
        "capture_ms": s_cap * 1e3,
        "capture_tokens_per_s": tps_cap,
        "capture_tflops": tf_cap,
        "capture_frac_peak": tf_cap / peak,
        "step_ms": s_step * 1e3,
        "step_tokens_per_s": tps_step,
        "step_tflops": tf_step,
        "step_frac_peak": tf_step / peak,
        **({"fuse_default": on} if s_fz else {}),
        **pair("step_eager_ms", s_eager, "step_fused_ms", s_fz, "step_fused_speedup"),
        **pair(
            "step_plain_head_ms", s_head_p, "step_fused_head_ms", s_head_f, "fused_head_speedup"
        ),
        **pair("step_fused_head_ms", s_head_f, "step_tiles_head_ms", s_head_t, "tiles_speedup"),
        **({"label_sampling": args.label_sampling} if s_all else {}),
        **pair("step_all_labels_ms", s_all, "step_by_weight_ms", s_lw, "by_weight_speedup"),
        "loop_ms": s_loop * 1e3,
        "loop_tokens_per_s": tps_loop,
        "loop_tflops": tf_loop,
        "loop_frac_peak": tf_loop / peak,
        **pair("loop_read_each_step_ms", s_rd, "loop_ms", s_loop, "loop_over_read_each_step"),
        **pair("loop_compiled_ms", s_c, "loop_cudagraphs_ms", s_cg, "cudagraphs_speedup"),
        **pair("loop_source_ms", s_src, "loop_source_overlap_ms", s_ovl, "overlap_speedup"),
        "ideal_tokens_per_s": ideal,
        "loop_over_ideal": tps_loop / ideal,
        **{f"peak_mem_{k}_gib": v for k, v in mem.items()},
    }
    report(res, args.out)
    if args.profile:
        profile_steps(f"{args.profile}/step", dev, one, "drafter step alone")
        profile_steps(f"{args.profile}/loop", dev, lambda i: step_fn([capture(i)]), "loop")


if __name__ == "__main__":
    main()
