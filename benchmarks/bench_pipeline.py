"""Split (target workers -> drafter trainers) vs colocated throughput on a tiny target.

    python benchmarks/bench_pipeline.py                       # CPU, gloo: 1 worker + 1 trainer vs colocated
    python benchmarks/bench_pipeline.py --workers 2 --trainers 1 --steps 60 --target tiny_qwen3_5
    python benchmarks/bench_pipeline.py --backend nccl        # GPUs: needs workers + trainers devices

Each rank is a fresh process started with torchrun's environment (dflash.tools.testing.launch_local) that
builds its RunConfig from the conf/ group files (no Hydra, so it also runs where Hydra is not
installed) and calls dflash.run.launcher.run_distributed (split) or dflash.train.colocated.run_colocated
(colocated, one process). Figures come from each run's metrics.jsonl, averaged over the logged
steps after the first (warm-up), plus the workers' own summary lines.

Reading the table: trainer wait >> 0 and worker backpressure ~ 0 means the trainers starve (add
target workers); backpressure >> 0 with wait ~ 0 means the workers are throttled (add trainers).
`suggested workers/trainer` = trainer capacity / worker capacity (tokens per busy second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ----------------------------------------------------------------------------- child (one rank)
def load_group(group: str, name: str) -> dict:
    import yaml

    return yaml.safe_load((REPO / "conf" / group / f"{name}.yaml").read_text()) or {}


def typed(cls, values: dict):
    """PyYAML reads `3e-3` as a string (YAML 1.1); cast float fields like Hydra would."""
    import dataclasses

    kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    return cls(
        **{
            k: float(v) if isinstance(v, str) and "float" in kinds.get(k, "") else v
            for k, v in values.items()
        }
    )


def child(spec_path: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from dflash.config import (
        DataConfig,
        DrafterConfig,
        EvalConfig,
        LoggerConfig,
        RunConfig,
        TargetConfig,
        TopologyConfig,
        TrainConfig,
    )

    spec = json.loads(Path(spec_path).read_text())
    train = dict(load_group("train", "smoke"), **spec["train"])
    cfg = RunConfig(
        exp_name="bench",
        run_name=spec["name"],
        out_root=spec["out_root"],
        target=typed(TargetConfig, load_group("target", spec["target"])),
        drafter=typed(DrafterConfig, load_group("drafter", "tiny")),
        data=typed(DataConfig, dict(load_group("data", "selfgen"), **spec["data"])),
        train=typed(TrainConfig, train),
        eval=EvalConfig(enabled=False),
        logger=LoggerConfig(kind="none"),
        topology=TopologyConfig(**spec["topology"]),
    ).validate()
    run_dir = os.path.join(spec["out_root"], spec["name"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.topology.mode == "split" or world > 1:
        from dflash.run.launcher import run_distributed
        from dflash.train.split.schedule import Roles

        run_distributed(cfg, run_dir, Roles.from_topology(cfg.topology, world))
    else:
        from dflash.train.colocated import run_colocated

        run_colocated(cfg, run_dir)


# ----------------------------------------------------------------------------- parent
def run(args, name: str, mode: str, nproc: int, root: Path) -> dict:
    from dflash.tools.testing import launch_local, wait_all

    spec = {
        "name": name,
        "out_root": str(root / "runs"),
        "target": args.target,
        "train": {
            "steps": args.steps,
            "micro_batch_size": args.mb,
            "grad_accum": args.grad_accum,
            "log_every": args.log_every,
            "save_every": 10**9,
            "max_anchors": args.max_anchors,
        },
        "data": {
            "num_samples": args.samples,
            "response_len": args.response_len,
            "cache_dir": str(root / "data"),
        },
        "topology": {
            "mode": mode,
            "num_target_ranks": args.workers if mode == "split" else 0,
            "window": args.window,
            "backend": args.backend,
            "timeout_s": 120.0,
        },
    }
    path = root / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = {
        "OMP_NUM_THREADS": str(args.threads),
        "DFLASH_NO_PROGRESS": "1",
        "PYTHONUNBUFFERED": "1",
        "NCCL_NVLS_ENABLE": "0",
    }
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(path)]
    t0 = time.perf_counter()
    procs = launch_local(
        argv, nproc, env=env, cwd=str(REPO), log_dir=str(root / "logs" / name), run_id=name
    )
    codes = wait_all(procs, args.timeout)
    wall = time.perf_counter() - t0
    if codes != [0] * nproc:
        for r in range(nproc):
            print(
                f"--- {name} rank {r} (exit {codes[r]})\n"
                + (root / "logs" / name / f"rank{r}.err").read_text()[-3000:]
            )
        raise SystemExit(f"{name}: failed")
    rows = [
        json.loads(line)
        for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    workers = [
        line
        for r in range(nproc)
        for line in (root / "logs" / name / f"rank{r}.out").read_text().splitlines()
        if line.startswith("[worker") and "done:" in line
    ]
    return {"rows": rows, "wall": wall, "workers": workers}


def summarize(res: dict, global_batch: int) -> dict:
    rows = res["rows"]
    steady = rows[1:] if len(rows) > 1 else rows
    mean = {
        k: sum(r[k] for r in steady if k in r) / max(1, sum(k in r for r in steady))
        for k in {k for r in steady for k in r}
    }
    # samples/s from the logger clock over the steady part (includes everything the loop does)
    if len(rows) > 1:
        mean["samples_per_s_wall"] = (
            (rows[-1]["step"] - rows[0]["step"])
            * global_batch
            / max(rows[-1]["time"] - rows[0]["time"], 1e-9)
        )
    return mean


def fmt(x, unit="") -> str:
    return "-" if x is None else f"{x:,.1f}{unit}" if abs(x) >= 10 else f"{x:.3f}{unit}"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--target", default="tiny_qwen3_5")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--mb", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-anchors", type=int, default=48)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--response-len", type=int, default=48)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="work dir (default: a temp dir)")
    p.add_argument("--only", choices=["colocated", "split"], default=None, help="run one side only")
    args = p.parse_args()
    if args.child:
        return child(args.child)
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_pipeline_"))
    root.mkdir(parents=True, exist_ok=True)
    W, D = args.workers, args.trainers
    print(
        f"target {args.target}, {args.steps} steps, micro-batch {args.mb} x grad_accum {args.grad_accum}, "
        f"backend {args.backend}, {args.threads} thread(s)/process, work dir {root}"
    )
    # colocated with the same global batch (D trainers x mb x ga) in one process
    colo_args = argparse.Namespace(**{**vars(args), "grad_accum": args.grad_accum * D})
    empty = {
        "rows": [{"step": 0, "time": 0.0, "train/loss": float("nan")}],
        "wall": None,
        "workers": [],
    }
    colo = run(colo_args, "colocated", "colocated", 1, root) if args.only != "split" else empty
    split = (
        run(args, f"split-{W}w{D}t", "split", W + D, root) if args.only != "colocated" else empty
    )
    gb = D * args.mb * args.grad_accum
    c, s = summarize(colo, gb), summarize(split, gb)
    print(f"\n{'':38s}{'colocated (1 process)':>24s}{f'split {W} worker(s) + {D} trainer(s)':>34s}")
    table = [
        (
            "samples/s (wall clock, steady)",
            c.get("samples_per_s_wall"),
            s.get("samples_per_s_wall"),
        ),
        (
            "tokens/s consumed by trainers",
            c.get("perf/tokens_per_s"),
            s.get("pipe/trainer_tokens_per_s"),
        ),
        ("tokens/s produced by workers", None, s.get("pipe/worker_tokens_per_s")),
        ("target forward s/step (colocated)", c.get("perf/target_s"), None),
        ("drafter step s/step", c.get("perf/drafter_s"), s.get("perf/drafter_s")),
        ("trainer wait for data s/step", None, s.get("pipe/trainer_wait_s")),
        ("trainer wait fraction", None, s.get("pipe/trainer_wait_frac")),
        ("worker backpressure s/step", None, s.get("pipe/worker_backpressure_s")),
        ("worker backpressure fraction", None, s.get("pipe/worker_backpressure_frac")),
        ("worker busy (forward) fraction", None, s.get("pipe/worker_busy_frac")),
        ("trainer queue depth (ready batches)", None, s.get("pipe/queue_depth")),
        ("worker in-flight sends", None, s.get("pipe/worker_inflight")),
        ("worker capacity tokens/s (per busy s)", None, s.get("pipe/worker_capacity_tokens_per_s")),
        (
            "trainer capacity tokens/s (per busy s)",
            None,
            s.get("pipe/trainer_capacity_tokens_per_s"),
        ),
        (
            "suggested workers per trainer",
            c.get("pipe/suggested_workers_per_trainer"),
            s.get("pipe/suggested_workers_per_trainer"),
        ),
        ("whole job wall s (incl. startup)", colo["wall"], split["wall"]),
    ]
    for name, a, b in table:
        print(f"{name:38s}{fmt(a):>24s}{fmt(b):>34s}")
    for line in split["workers"]:
        print(line)
    if args.only is None:
        loss_c, loss_s = colo["rows"][-1]["train/loss"], split["rows"][-1]["train/loss"]
        print(
            f"final loss: colocated {loss_c:.4f}, split {loss_s:.4f} (same data and global batch)"
        )


if __name__ == "__main__":
    main()
