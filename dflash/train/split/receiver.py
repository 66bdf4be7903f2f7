"""A split trainer's batch source: a receiver thread takes this trainer's micro-batches from the
workers in schedule order, and the pipe/* metrics of the stream."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from ...common.comm import EXIT_PIPELINE, PeerError, RankContext, die, recv_message
from ...common.interrupt import stop_signal
from ...config import RunConfig
from ...data.batch import TargetBatch
from ...data.stream import SampleStream
from ..build import screen_batch
from . import wire
from .schedule import Roles, Schedule


class StreamedBatchSource:
    """Trainer side of the pipeline: a receiver thread takes this trainer's micro-batches in
    schedule order (whatever order they are produced in) into a queue of `topology.window`
    batches; next_batches() hands grad_accum of them to train_step. Also the pipe/* metrics."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: RankContext,
        roles: Roles,
        sched: Schedule,
        d: int,
        stream: SampleStream,
        dp_group,
    ):
        self.cfg, self.ctx, self.roles, self.sched, self.d = cfg, ctx, roles, sched, d
        self.stream, self.dp_group = stream, dp_group
        self.q: queue.Queue = queue.Queue(maxsize=max(1, cfg.topology.window))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._receive_all, name="dflash-recv", daemon=True)
        self.bad_total = 0
        self.workers_prev = torch.zeros(
            roles.num_workers, len(wire.WorkerStats.FIELDS), dtype=torch.float64
        )
        self.workers_now = self.workers_prev.clone()
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.t_last = time.perf_counter()
        self.wait_s = self.tokens = self.samples = self.depth_sum = self.depth_n = self.steps = 0.0

    # ---------------------------------------------------------------- receiver thread
    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join(timeout=self.cfg.topology.timeout_s)

    def _receive_all(self) -> None:
        ctx, topo = self.ctx, self.cfg.topology
        w = None
        try:
            side = None
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)  # the current device is per thread
                side = torch.cuda.Stream(ctx.device)
            with torch.cuda.stream(side) if side is not None else nullcontext():
                for step, j in self.sched.trainer_items(self.d):
                    g, w = self.sched.global_index(step, j), self.sched.worker_of(step, j)
                    meta, tensors = recv_message(
                        w,
                        f"worker rank {w}",
                        ctx.device,
                        ctx.backend,
                        topo.timeout_s,
                        f"micro-batch {g} (step {step})",
                    )
                    if side is not None:
                        side.synchronize()
                    tb, head = wire.unpack_batch(meta, tensors)
                    if head["g"] != g:
                        raise PeerError(
                            f"worker rank {w} sent micro-batch {head['g']} where {g} was due: "
                            "do all ranks run the same config?"
                        )
                    wire.tap.received(g, tb, worker=w, trainer=ctx.rank, step=step, j=j)
                    self.q.put((g, w, tb, head, tensors))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread, or below
            peer = (
                f" from worker rank {w}" if w is not None else ""
            )  # irecv itself can raise when the peer is gone
            self.error = (
                e if isinstance(e, PeerError) else PeerError(f"receiving{peer} failed: {e!r}")
            )
            if ctx.root_cause is None:
                ctx.root_cause = self.error
            if stop_signal() is not None:  # the workers end with a stop: the loop is saving
                return
            # The main thread raises it at its next next_batches(); if it is blocked elsewhere
            # (a collective with another trainer), end the process from here.
            time.sleep(min(5.0, topo.timeout_s))
            die(
                f"[rank {ctx.rank} trainer] pipeline stopped: {ctx.explain(self.error)}",
                EXIT_PIPELINE,
            )

    def _get(self):
        while True:
            if self.error is not None:
                raise self.error
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                continue

    # ---------------------------------------------------------------- main thread
    def next_batches(self) -> list[TargetBatch]:
        t0 = time.perf_counter()
        out = []
        for _ in range(self.cfg.train.grad_accum):
            self.depth_sum += self.q.qsize()
            self.depth_n += 1
            g, w, tb, head, raw = self._get()
            if self.ctx.device.type == "cuda":
                for t in raw:  # allocated on the receiver's stream, used on this one
                    t.record_stream(torch.cuda.current_stream())
            self.workers_now[w] = torch.maximum(
                self.workers_now[w], torch.tensor(head["stats"], dtype=torch.float64)
            )
            tb, bad = screen_batch(
                tb, self.cfg.topology.on_bad_batch, origin=f"micro-batch {g} from worker rank {w}"
            )
            self.bad_total += len(bad)
            self.tokens += tb.num_tokens
            self.samples += int(tb.sample_ids.numel())
            out.append(tb)
        self.wait_s += time.perf_counter() - t0
        self.steps += 1
        self.stream.position += self.sched.per_step * self.sched.micro_batch_size
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def step_metrics(self, target_s: float, drafter_s: float) -> dict:
        return {}

    def interval_metrics(self) -> dict:
        """pipe/* over the interval since the last call; a collective over the trainers."""
        dev = self.ctx.device
        local = torch.tensor(
            [
                time.perf_counter() - self.t_last,
                self.wait_s,
                self.tokens,
                self.samples,
                self.depth_sum,
                self.depth_n,
                self.steps,
                self.bad_total,
            ],
            dtype=torch.float64,
            device=dev,
        )
        workers = self.workers_now.to(dev)
        if self.roles.num_trainers > 1:
            dist.all_reduce(local, group=self.dp_group)
            dist.all_reduce(workers, op=dist.ReduceOp.MAX, group=self.dp_group)
        local, workers = local.cpu().tolist(), workers.cpu()
        out = pipe_metrics(local, workers - self.workers_prev, self.roles.num_trainers)
        self.workers_now = workers.clone()
        self.workers_prev = workers
        self._reset_interval()
        return out


def pipe_metrics(trainers: list, workers_delta: torch.Tensor, num_trainers: int) -> dict:
    """trainers: summed [wall, wait, tokens, samples, depth_sum, depth_n, steps(x D), bad];
    workers_delta: per-worker increments of WorkerStats.FIELDS over the interval."""
    wall, wait, tokens, samples, depth_sum, depth_n, steps, bad = trainers
    D = num_trainers
    mean_wall, steps = max(wall / D, 1e-9), max(steps / D, 1.0)
    busy = max(mean_wall - wait / D, 1e-9)
    out = {
        "pipe/trainer_tokens_per_s": tokens / mean_wall,
        "pipe/samples_per_s": samples / mean_wall,
        "pipe/trainer_wait_s": wait / D / steps,
        "pipe/trainer_wait_frac": wait / max(wall, 1e-9),
        "pipe/queue_depth": depth_sum / max(depth_n, 1.0),
        "pipe/trainer_capacity_tokens_per_s": tokens / D / busy,
        "pipe/bad_samples": bad,
    }
    tok, batches, fwd, bp, elapsed, inflight = (
        workers_delta[:, i] for i in range(len(wire.WorkerStats.FIELDS))
    )
    seen = elapsed > 0
    if bool(seen.any()):
        el, fwd_s, bp_s = elapsed[seen] / 1e6, fwd[seen] / 1e6, bp[seen] / 1e6
        out.update(
            {
                "pipe/worker_tokens_per_s": float((tok[seen] / el).sum()),
                "pipe/worker_busy_frac": float((fwd_s / el).mean()),
                "pipe/worker_backpressure_frac": float((bp_s / el).mean()),
                "pipe/worker_backpressure_s": float(bp_s.mean()) / steps,
                "pipe/worker_inflight": float(
                    inflight[seen].sum() / batches[seen].sum().clamp(min=1)
                ),
                "pipe/worker_capacity_tokens_per_s": float(
                    (tok[seen] / fwd_s.clamp(min=1e-9)).mean()
                ),
            }
        )
        out["pipe/suggested_workers_per_trainer"] = out["pipe/trainer_capacity_tokens_per_s"] / max(
            out["pipe/worker_capacity_tokens_per_s"], 1e-9
        )
    return out
