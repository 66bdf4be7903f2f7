"""Drafter training-step throughput at a given shape, on synthetic target outputs (no target
model needed): tokens/s and anchors/s of DrafterTrainer.train_step, peak memory.

  python benchmarks/bench_train_step.py --shape qwen3_6_27b --seq 3072 --anchors 512
  ... --compile --fuse --label-sampling both   # every label vs labels kept by weight, same run
"""

from __future__ import annotations

import argparse

import torch
from common import alternating, matmul_peak_tflops, report, timed

SHAPES = {  # hidden, vocab, target layers, drafter yaml name
    "qwen3_6_27b": (5120, 248320, 64, "qwen3_6_27b"),
    "tiny": (128, 512, 8, "tiny"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="train.compile")
    ap.add_argument("--attn-kernel", default="auto", help="train.attn_kernel")
    ap.add_argument("--fuse", action="store_true", help="train.fuse")
    ap.add_argument(
        "--variant", default="dflash", help="drafter.variant (dflash2: the drafter yaml's selector)"
    )
    ap.add_argument(
        "--label-sampling",
        default="all",
        choices=["all", "by_weight", "both"],
        help="train.label_sampling; both: each timed in alternating rounds, same trainer",
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds (--label-sampling both)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import os

    from omegaconf import OmegaConf

    from dflash.config import DrafterConfig, TrainConfig
    from dflash.data.batch import TargetBatch
    from dflash.drafter.model import num_params
    from dflash.drafter.spec import resolve_spec
    from dflash.drafter.variants import build_model
    from dflash.target.shape import Heads, TargetShape
    from dflash.train.step import DrafterTrainer

    H, V, L, dname = SHAPES[args.shape]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dcfg = DrafterConfig(
        **OmegaConf.to_container(OmegaConf.load(f"{root}/conf/drafter/{dname}.yaml")),
        variant=args.variant,
    )
    heads_n = dcfg.num_attention_heads or 8
    inter = dcfg.intermediate_size or 17408 if H == 5120 else 256
    ids = tuple(dcfg.target_layer_ids or ())
    shape = TargetShape(L, H, V, inter, heads_n, 8, torch.bfloat16, V - 250, ids)
    spec = resolve_spec(dcfg, shape)
    drafter = build_model(spec)
    drafter.init_weights(0.02)
    tdtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    embed = torch.nn.Embedding(V, H).to(dev, tdtype).requires_grad_(False)
    lm_head = torch.nn.Linear(H, V, bias=False).to(dev, tdtype).requires_grad_(False)
    tr = DrafterTrainer(
        drafter,
        Heads(embed, lm_head),
        TrainConfig(
            max_anchors=args.anchors,
            steps=100,
            compile=args.compile,
            attn_kernel=args.attn_kernel,
            fuse=args.fuse,
            label_sampling="all" if args.label_sampling == "all" else "by_weight",
        ),
        dev,
    )
    N, T, F = args.batch, args.seq, spec.num_aux * H
    tb = TargetBatch(
        input_ids_NT=torch.randint(0, V - 300, (N, T), device=dev),
        position_ids_NT=torch.arange(T, device=dev)[None].expand(N, T).contiguous(),
        segment_ids_NT=torch.zeros(N, T, dtype=torch.long, device=dev),
        loss_mask_NT=torch.ones(N, T, dtype=torch.bool, device=dev),
        sample_ids=torch.arange(N),
        row_seeds=list(range(N)),
        aux_NTF=torch.randn(N, T, F, device=dev, dtype=tdtype),
        next_token_NT=torch.randint(0, V - 300, (N, T), device=dev),
    )
    peak = matmul_peak_tflops(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    modes = ["all", "by_weight"] if args.label_sampling == "both" else [args.label_sampling]
    keep = {"all": None, "by_weight": tr.keep_p_k}  # the trainer's labels kept by weight

    def measure(mode):
        tr.keep_p_k = keep[mode]
        return timed(lambda: tr.train_step([tb]), dev, args.iters, warmup=2)

    med, mem = alternating(
        {m: m for m in modes}, args.rounds if len(modes) > 1 else 1, measure, dev
    )
    s = med[modes[-1]]
    res = {
        "shape": args.shape,
        "variant": args.variant,
        "drafter_params_M": num_params(drafter) / 1e6,
        "seq": T,
        "anchors": args.anchors,
        "batch": N,
        "block_size": spec.block_size,
        "attn_kernel": tr.attn_kernel,
        "compile": args.compile,
        "fuse": args.fuse,
        "label_sampling": modes[-1],
        "s_per_step": s,
        "tokens_per_s": N * T / s,
        "anchors_per_s": N * args.anchors / s,
        "matmul_peak_tflops": peak,
        "peak_mem_gib": mem.get(modes[-1]),
    }
    if len(modes) > 1:
        res |= {
            "s_per_step_all_labels": med["all"],
            "tokens_per_s_all_labels": N * T / med["all"],
            "peak_mem_gib_all_labels": mem.get("all"),
            "by_weight_speedup": med["all"] / med["by_weight"],
        }
    report(res, args.out)


if __name__ == "__main__":
    main()
