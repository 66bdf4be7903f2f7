"""Target-worker throughput: one clean forward with K aux taps + argmax labels (what training
needs per batch), tokens/s and TFLOP/s against an in-process bf16 matmul peak.

  python benchmarks/bench_target.py --target qwen3_6_27b_random --seq 4096 --batch 1
"""

from __future__ import annotations

import argparse

import torch
from common import load_target_yaml, matmul_peak_tflops, profile_steps, report, timed


def forward_flops_per_token(cfg, seq: int) -> float:
    """2 * (non-embedding matmul params) + attention score/value flops (causal: ~seq/2 keys)."""
    H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * L
    hd = getattr(cfg, "head_dim", H // cfg.num_attention_heads)
    total = 0.0
    for t in types:
        total += 3 * H * I  # MLP
        if t == "full_attention":
            q = (
                cfg.num_attention_heads
                * hd
                * (2 if getattr(cfg, "model_type", "").startswith("qwen3_5") else 1)
            )
            kv = 2 * cfg.num_key_value_heads * hd
            total += H * (q + kv) + cfg.num_attention_heads * hd * H
            total += 2 * cfg.num_attention_heads * hd * seq / 2  # QK^T and PV, causal
        else:  # Gated DeltaNet projections (qkv, z, b, a, out); the recurrence itself is small
            kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            total += H * (2 * kd + 2 * vd + 2 * cfg.linear_num_value_heads) + vd * H
            total += (
                4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            )
    total += H * V  # lm_head for the argmax labels
    return 2 * total


def conv1d_fallback_timing(target, ids, iters: int) -> float | None:
    """Seconds a forward with transformers' torch conv1d fallback, where load_target bound fla's
    Triton conv1d instead (linear_attn.use_fla_conv1d); None where it did not."""
    import sys

    mod = sys.modules.get(type(target.model).__module__)
    bound = getattr(mod, "causal_conv1d_fn", None)
    fallback = getattr(getattr(bound, "__wrapped__", bound), "_dflash_replaced", None)
    if fallback is None:
        return None
    mod.causal_conv1d_fn = fallback
    try:
        return timed(lambda: target.capture(ids), target.device, iters)
    finally:
        mod.causal_conv1d_fn = bound


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny_qwen3_5")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--num-aux", type=int, default=5)
    ap.add_argument("--profile", default=None, help="directory: torch.profiler of 3 forwards")
    ap.add_argument(
        "--compile-layers",
        action="store_true",
        help="also time the forward with target.compile_layers, a Gated-DeltaNet layer's MLP "
        "compiled (compile_gdn=mlp) and the whole layer (layer), same process and input; the "
        "profile then covers the faster of the two",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dflash.target.linear_attn import linear_attn_report
    from dflash.target.load import load_target

    tcfg = load_target_yaml(args.target)
    tcfg.linear_attn_backend = args.backend
    target = load_target(tcfg, num_aux=args.num_aux)
    dev = target.device
    peak = matmul_peak_tflops(dev)
    ids = torch.randint(0, target.vocab_size - 1, (args.batch, args.seq), device=dev)
    s = timed(lambda: target.capture(ids), dev, args.iters)
    tokens = args.batch * args.seq
    fpt = forward_flops_per_token(target.model.config, args.seq)
    tflops = fpt * tokens / s / 1e12
    res = {
        "target": args.target,
        "backend": target.backend,
        "gdn_ops": linear_attn_report(),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "seq": args.seq,
        "batch": args.batch,
        "aux_layers": target.layer_ids,
        "s_per_forward": s,
        "tokens_per_s": tokens / s,
        "tflops": tflops,
        "matmul_peak_tflops": peak,
        "fraction_of_peak": tflops / peak,
        "floor_tokens_per_s_at_peak": peak * 1e12 / fpt,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }
    conv = conv1d_fallback_timing(target, ids, args.iters)
    if conv is not None:
        res |= {"s_per_forward_torch_conv1d": conv, "fla_conv1d_speedup": conv / s}
    if args.compile_layers:
        from dflash.target.graphs import CompiledLayers

        best = None
        for scope in ("mlp", "layer") if target.backend != "none" else ("layer",):
            torch._dynamo.reset()
            compiled = target.compiled_layers = CompiledLayers.of(target, True, scope)
            if compiled is None:  # CPU: eager
                break
            sc = timed(lambda: target.capture(ids), dev, args.iters)
            res |= {
                f"compiled_{scope}_failed": compiled.failed,  # True: it fell back to eager
                f"s_per_forward_compiled_{scope}": sc,
                f"tokens_per_s_compiled_{scope}": tokens / sc,
                f"fraction_of_peak_compiled_{scope}": fpt * tokens / sc / 1e12 / peak,
                f"compiled_{scope}_speedup": s / sc,
            }
            if best is None or sc < best[0]:
                best = (sc, scope, compiled)
        if best is not None:
            target.compiled_layers = best[2]
            res["compiled_best"] = best[1]
    report(res, args.out)
    if args.profile:
        profile_steps(args.profile, dev, lambda i: target.capture(ids), "target forward", n=3)


if __name__ == "__main__":
    main()
