"""The colocated run: every rank runs target + drafter on its device (one process, or data
parallel over all ranks of a torch.distributed job)."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..common.comm import RankContext
from ..common.layout import write_run_config
from ..common.loggers import Logger
from ..config import RunConfig
from ..data.stream import SampleStream
from ..target.capture import Target
from ..target.linear_attn import linear_attn_report, linear_attn_summary
from .budget import phase_done, start_phases
from .build import (
    build_target,
    data_cache,
    data_record,
    dataset_for_rank,
    make_batch,
    own_data_file,
    samples_digest,
    screen_batch,
)
from .loop import train_loop
from .resume import resume
from .session import open_session


class LocalBatchSource:
    """This process runs the target on its share of the sample stream.

    topology.overlap_capture: the next step's batches are captured ahead, on a side CUDA stream,
    so the GPU runs that capture beside the drafter step (on CPU: still one step ahead, in
    order). The stream position saved in checkpoints is what the trainer consumed."""

    def __init__(
        self,
        target: Target,
        samples: list,
        cfg: RunConfig,
        dp_rank: int = 0,
        dp_world: int = 1,
        origin: str = "",
    ):
        """origin: where the samples are cached (named when a resume finds other samples)."""
        self.target, self.samples, self.cfg = target, samples, cfg
        self.stream = SampleStream(len(samples), cfg.data.seed, samples_digest(samples), origin)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.bad_samples: list[int] = []
        self.pending: list = []  # screen_batch checks not read back yet
        self.ahead = None  # overlap_capture: (batches, their checks, ready event) of the next step
        self.side = None
        if cfg.topology.overlap_capture and target.device.type == "cuda":
            self.side = torch.cuda.Stream(target.device)

    def _capture(self, idx_all: list[int]) -> tuple[list, list]:
        mb, n = self.cfg.train.micro_batch_size, self.cfg.train.micro_batch_size * self.dp_world
        out, checks = [], []
        for k in range(self.cfg.train.grad_accum):
            idx = idx_all[k * n : (k + 1) * n][self.dp_rank * mb : (self.dp_rank + 1) * mb]
            # no device sync per step: flagged samples are zeroed on the device now and reported
            # (or stop the run under on_bad_batch=stop) at the next log step
            with record_function("dflash.capture"):  # collate + the target forward
                tb = make_batch(self.target, self.samples, idx, self.cfg)
            tb, pending = screen_batch(tb, self.cfg.topology.on_bad_batch, defer=True)
            out.append(tb)
            checks.append(pending)
        return out, checks

    def _capture_ahead(self, idx_all: list[int]):
        if self.side is None:
            return (*self._capture(idx_all), None)
        with torch.cuda.stream(self.side):
            batches, checks = self._capture(idx_all)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return batches, checks, ready

    def next_batches(self) -> list:
        n = self.cfg.train.micro_batch_size * self.dp_world * self.cfg.train.grad_accum
        if not self.cfg.topology.overlap_capture:
            out, checks = self._capture(self.stream.take(n))
            self.pending += checks
            return out
        if self.ahead is None:  # the first step of this process (after any resume)
            self.ahead = self._capture_ahead(self.stream.peek(n))
        out, checks, ready = self.ahead
        self.stream.take(n)
        if ready is not None:  # the drafter's stream waits for the capture, and owns its outputs
            now = torch.cuda.current_stream(self.target.device)
            now.wait_event(ready)
            for t in _tensors(out, checks):
                t.record_stream(now)
        self.pending += checks
        self.ahead = self._capture_ahead(self.stream.peek(n))
        return out

    def step_metrics(self, target_s: float, drafter_s: float) -> dict:
        # target vs drafter time per step = target GPUs per drafter GPU in a split run (not
        # when capturing ahead: target_s is then only the wait for a capture that overlapped)
        if self.side is not None:
            return {}
        return {"pipe/suggested_workers_per_trainer": target_s / max(drafter_s, 1e-9)}

    def interval_metrics(self) -> dict:
        for pending in self.pending:
            self.bad_samples += pending.read()
        self.pending = []
        out = {"pipe/bad_samples": float(len(self.bad_samples))}
        graphs = getattr(self.target, "capture_graphs", None)
        if graphs is not None and graphs.graphs:  # a new bucket marks an interval that captured one
            out["perf/capture_graphs"] = float(len(graphs.graphs))
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}


def _tensors(batches: list, checks: list):
    """The CUDA tensors held by target batches and their pending screen checks."""
    for obj in (*batches, *checks):
        yield from (x for x in vars(obj).values() if isinstance(x, torch.Tensor) and x.is_cuda)


def run_colocated(
    cfg: RunConfig,
    run_dir: str,
    logger: Logger | None = None,
    stop_at: int | None = None,
    ctx: RankContext | None = None,
) -> dict:
    """stop_at: end after that step as if interrupted (tests of resume). ctx makes it data
    parallel over all ranks: each rank runs target + drafter on its device and its slice of
    every micro-batch; rank 0 writes metrics, evaluations and checkpoints."""
    writer = ctx is None or ctx.rank == 0
    multi = ctx is not None and ctx.world > 1
    start_phases()
    torch.manual_seed(cfg.train.seed)
    target = build_target(cfg, ctx.device if ctx is not None else None)
    describe = []
    if ctx is not None:
        describe.append(
            f"topology: colocated, {ctx.world} ranks (data parallel), backend {ctx.backend}"
        )
    gdn = linear_attn_report() if target.backend != "none" else {}
    describe.append(
        f"target: {cfg.target.name} | {target.num_layers} layers, H={target.hidden_size}, "
        f"V={target.vocab_size}, {target.dtype}, {target.device}"
        + (f", Gated-DeltaNet: {linear_attn_summary(gdn)}" if gdn else "")
    )
    session = open_session(
        cfg, run_dir, target.shape, writer=writer, describe=describe, logger=logger
    )
    phase_done("start and target load")
    own = own_data_file(cfg, run_dir)  # a resumed run's data cache file
    samples = dataset_for_rank(cfg, target, run_dir, session.logger.info, ctx, own)
    phase_done("data")
    trainer, evaluator = session.start(
        target,
        target.device,
        dp_group=ctx.world_group if multi else None,
        ctrl_group=ctx.ctrl if multi else None,  # gloo over the same ranks: host-side flags
    )
    phase_done("trainer and eval set")
    source = LocalBatchSource(
        target,
        samples,
        cfg,
        ctx.rank if multi else 0,
        ctx.world if multi else 1,
        origin=data_cache(cfg, run_dir),
    )
    resume(cfg, run_dir, trainer, source.stream, session.logger, ctx if multi else None)
    if writer:
        write_run_config(cfg, run_dir, data_record(cfg, run_dir, samples, own))
    return train_loop(
        cfg, trainer, source, evaluator, session.logger, run_dir, stop_at, writer=writer
    )
