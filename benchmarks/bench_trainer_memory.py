"""Memory per trainer rank for each train.dist mode at a drafter shape, on synthetic target
outputs (no target model): ddp vs deepspeed ZeRO-1/2/3 vs fsdp.

  python benchmarks/bench_trainer_memory.py --shape qwen3_6_27b --seq 2048 --anchors 256 --ranks 8

Each mode runs in its own process as rank 0 of a world of --ranks N on this machine's one GPU:
the process group is torch's "fake" backend (collectives return at once, nothing is sent), so
DeepSpeed and FSDP partition for N ranks and allocate exactly rank 0's shards, buffers and
activations: the measured figures are what one rank of N holds, without N GPUs. The numbers the
fake collectives leave in the tensors are not meaningful; the allocations are. --ranks 1 runs a
real world of one (nccl/gloo), and so does ddp, which replicates everything. On CPU (e.g.
--shape tiny) only the analytic figures are printed: it checks that every mode runs. Measured: the peak memory of two training steps and
the memory held between steps (weights + gradients + optimizer state + the frozen
embedding/lm_head). Analytic, for --ranks N: weights 4P, gradients 4P and AdamW 8P (fp32, P
drafter parameters) divided over the ranks as each mode shards them, plus the frozen heads
every trainer holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

MODES = {  # name: (train.dist, zero_stage, which of weights/grads/optimizer are sharded)
    "ddp": ("ddp", 1, ()),
    "zero1": ("deepspeed", 1, ("optimizer",)),
    "zero2": ("deepspeed", 2, ("optimizer", "grads")),
    "zero3": ("deepspeed", 3, ("optimizer", "grads", "weights")),
    "fsdp": ("fsdp", 1, ("optimizer", "grads", "weights")),
}
SHAPES = {"qwen3_6_27b": (5120, 248320, 64, "qwen3_6_27b"), "tiny": (128, 512, 8, "tiny")}
GIB = 2**30


def analytic_bytes(params: int, head_bytes: int, sharded: tuple, ranks: int) -> int:
    per = {"weights": 4 * params, "grads": 4 * params, "optimizer": 8 * params}
    return head_bytes + sum(b // ranks if k in sharded else b for k, b in per.items())


def run_mode(args) -> dict:
    import torch.distributed as dist

    from dflash.config import TrainConfig
    from dflash.data.batch import TargetBatch
    from dflash.drafter.model import DFlashDrafter, num_params
    from dflash.target.shape import Heads
    from dflash.train.step import DrafterTrainer

    dist_mode, stage, _ = MODES[args.mode]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # DDP replicates everything, so one rank of N holds what a world of one holds (its C++
    # reducer also needs real collectives): DDP always runs as a real world of one.
    world = 1 if dist_mode == "ddp" else args.ranks
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
    )
    if world > 1:  # rank 0 of `world`: the libraries shard for `world`, nothing is sent
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    spec, H, V = drafter_spec(args.shape)
    tdtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):  # built and initialised where it trains (1.7B on a host CPU: minutes)
        drafter = DFlashDrafter(spec)
        drafter.init_weights(0.02)
        embed = torch.nn.Embedding(V, H, dtype=tdtype).requires_grad_(False)
        lm_head = torch.nn.Linear(H, V, bias=False, dtype=tdtype).requires_grad_(False)
    cfg = TrainConfig(max_anchors=args.anchors, steps=100, dist=dist_mode, zero_stage=stage)
    tr = DrafterTrainer(drafter, Heads(embed, lm_head), cfg, dev, dp_group=dist.group.WORLD)
    N, T, F = 1, args.seq, spec.num_aux * H
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
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        tr.train_step([tb])
    P_ = num_params(drafter) if args.mode not in ("zero3", "fsdp") else spec_params(spec)
    head_bytes = 2 * V * H * (2 if tdtype == torch.bfloat16 else 4)
    res = {
        "mode": args.mode,
        "drafter_params_M": P_ / 1e6,
        "world": world,
        "measured_peak_gib_per_rank": torch.cuda.max_memory_allocated() / GIB
        if dev.type == "cuda"
        else None,
        "measured_held_gib_per_rank": torch.cuda.memory_allocated() / GIB
        if dev.type == "cuda"
        else None,
        f"analytic_gib_per_rank_at_{args.ranks}": analytic_bytes(
            P_, head_bytes, MODES[args.mode][2], args.ranks
        )
        / GIB,
    }
    dist.destroy_process_group()
    return res


def drafter_spec(shape_name: str):
    from omegaconf import OmegaConf

    from dflash.config import DrafterConfig
    from dflash.drafter.spec import resolve_spec
    from dflash.target.shape import TargetShape

    H, V, L, dname = SHAPES[shape_name]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dcfg = DrafterConfig(
        **OmegaConf.to_container(OmegaConf.load(f"{root}/conf/drafter/{dname}.yaml"))
    )
    inter = dcfg.intermediate_size or (17408 if H == 5120 else 256)
    shape = TargetShape(
        L,
        H,
        V,
        inter,
        dcfg.num_attention_heads or 8,
        8,
        torch.bfloat16,
        V - 250,
        tuple(dcfg.target_layer_ids or ()),
    )
    return resolve_spec(dcfg, shape), H, V


def analytic_rows(args) -> list[dict]:
    spec, H, V = drafter_spec(args.shape)
    P = spec_params(spec)
    head_bytes = 2 * V * H * 2  # bf16 embedding + lm_head on every trainer
    return [
        {
            "mode": m,
            "drafter_params_M": P / 1e6,
            f"analytic_gib_per_rank_at_{args.ranks}": analytic_bytes(P, head_bytes, sh, args.ranks)
            / GIB,
        }
        for m, (_, _, sh) in MODES.items()
    ]


def spec_params(spec) -> int:
    from dflash.drafter.model import DFlashDrafter, num_params

    with torch.device("meta"):
        return num_params(DFlashDrafter(spec))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_6_27b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mode")
    ap.add_argument("--analytic-only", action="store_true", help="no training: the formula only")
    args = ap.parse_args()
    if args.analytic_only:
        for row in analytic_rows(args):
            print(json.dumps(row))
        return
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return
    rows = []
    for i, mode in enumerate(args.modes.split(",")):
        cmd = [sys.executable, __file__, "--mode", mode, "--port", str(args.port + i)]
        cmd += [
            "--shape",
            args.shape,
            "--seq",
            str(args.seq),
            "--anchors",
            str(args.anchors),
            "--ranks",
            str(args.ranks),
        ]
        env = {**os.environ}
        env.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            rows.append({"mode": mode, "error": f"timed out after {args.timeout} s (--timeout)"})
        else:
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                err = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
                rows.append({"mode": mode, "error": err})
            else:
                rows.append(json.loads(line[0][7:]))
        rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
