"""The target-worker role of a split run: load the target, take this worker's share of the
schedule, run the clean target forward and send each micro-batch to its trainer."""

from __future__ import annotations

import os
import time

import torch

from ...common.comm import Outbox, RankContext
from ...common.interrupt import StopRequest
from ...config import RunConfig
from ...data.dataset import load_or_build_dataset
from ...data.stream import SampleStream
from ...eval.sets import build_eval_sets
from ..build import (
    build_target,
    check_same_samples,
    data_cache,
    data_record,
    make_batch,
    own_data_file,
    samples_digest,
)
from . import wire
from .heads import heads_fingerprint
from .schedule import Roles, Schedule


def _say(ctx: RankContext, role: str):
    def say(msg: str) -> None:
        print(f"[{role} rank {ctx.rank}] {msg}", flush=True)

    return say


def run_worker(cfg: RunConfig, run_dir: str, ctx: RankContext, roles: Roles) -> None:
    """Load the target, read this worker's share of the stream, send batches to the trainers."""
    say = _say(ctx, "worker")
    target = build_target(cfg, ctx.device)
    say(
        f"target {cfg.target.name}: {target.num_layers} layers, {target.dtype}, {target.device}, "
        f"linear-attn backend {target.backend}"
    )
    cache, own = data_cache(cfg, run_dir), own_data_file(cfg, run_dir)
    info = None
    if ctx.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=say, also=own)
        if cfg.eval.enabled:  # trainers have no target: they read this cache
            build_eval_sets(cfg, target, cache, log=say)
        info = {
            "num_samples": len(samples),
            "digest": samples_digest(samples),
            "heads": heads_fingerprint(target.embed_tokens.weight, target.lm_head.weight),
            "data": data_record(cfg, run_dir, samples, own),  # for the trainers' run_config.json
        }
    info = ctx.broadcast_object(info, src=0)
    if ctx.rank != 0:
        quiet = lambda *_: None  # noqa: E731
        samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=quiet, also=own)
        check_same_samples(samples, info["digest"], ctx.rank)
    start = ctx.broadcast_object(None, src=roles.trainer_rank(0))
    sched = Schedule.from_config(cfg, roles, start["step"], start["position"])
    # Ctrl-C / SIGTERM reach every rank: the trainers finish their step and save, so a worker
    # keeps producing (their step may still need its batches) and ends when they have gone
    with StopRequest("producing until the trainers have saved and stopped"):
        stats = produce(cfg, ctx, roles, sched, target, samples)
    wall = time.perf_counter() - stats.t0
    say(
        f"done: {stats.batches} micro-batches, {stats.tokens} tokens in {wall:.1f} s "
        f"({stats.tokens / max(wall, 1e-9):.0f} tokens/s produced; forward {stats.forward_s:.1f} s, "
        f"backpressure wait {stats.backpressure_s:.1f} s)"
    )


def produce(
    cfg: RunConfig, ctx: RankContext, roles: Roles, sched: Schedule, target, samples: list
) -> wire.WorkerStats:
    topo = cfg.topology
    outboxes = [
        Outbox(
            roles.trainer_rank(d),
            f"trainer rank {roles.trainer_rank(d)}",
            topo.window,
            topo.timeout_s,
            ctx.backend,
            ctx.device,
        )
        for d in range(roles.num_trainers)
    ]
    stream = SampleStream(len(samples), cfg.data.seed)
    stats = wire.WorkerStats()
    for step, j in sched.worker_items(ctx.rank):
        g = sched.global_index(step, j)
        t0 = time.perf_counter()
        stream.position = sched.position(step, j)
        tb = make_batch(target, samples, stream.take(sched.micro_batch_size), cfg)
        if ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # honest forward time
        stats.forward_s += time.perf_counter() - t0
        tb = wire.tap.produced(tb, step)
        stats.tokens += tb.num_tokens
        stats.batches += 1
        d, _ = sched.trainer_of(j)
        meta, tensors = wire.pack_batch(tb, g, step, j, stats.ints())
        stats.backpressure_s += outboxes[d].send(meta, tensors, f"micro-batch {g} (step {step})")
        stats.inflight_sum += len(outboxes[d].inflight)
        wire.tap.sent(g, tb, worker=ctx.rank, trainer=roles.trainer_rank(d), step=step, j=j)
    t0 = time.perf_counter()
    for ob in outboxes:
        ob.flush()
    stats.backpressure_s += time.perf_counter() - t0
    return stats
