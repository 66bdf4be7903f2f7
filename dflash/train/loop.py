"""The train loop: loop { step; maybe log; maybe eval; maybe save }, over any `BatchSource`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Protocol

import torch
from tqdm.auto import tqdm

from ..common.interrupt import Interrupted, StopRequest, agree_max
from ..common.loggers import Logger, eval_key, progress_bars_off
from ..common.profiling import StepClock, StepProfiler
from ..config import RunConfig
from ..data.batch import TargetBatch, agreement_warning
from ..data.stream import SampleStream
from .budget import EpochForecast, phase_done, report_start
from .resume import BestCheckpoint, save_checkpoint
from .step import DrafterTrainer


class BatchSource(Protocol):
    """Where a trainer rank's micro-batches come from: its own target forward (colocated) or the
    stream from the target workers (split)."""

    stream: SampleStream  # position and epoch of the sample order (saved in checkpoints)

    def next_batches(self) -> list[TargetBatch]:
        """This rank's grad_accum micro-batches of the next step."""
        ...

    def step_metrics(self, target_s: float, drafter_s: float) -> dict:
        """Cheap, local figures of the step just taken (every step)."""
        ...

    def interval_metrics(self) -> dict:
        """Figures over the interval since the last log step; every trainer rank calls it at the
        same steps (it may be a collective)."""
        ...

    def state_dict(self) -> dict: ...


def train_loop(
    cfg: RunConfig,
    trainer: DrafterTrainer,
    source: BatchSource,
    evaluator,
    logger: Logger,
    run_dir: str,
    stop_at: int | None = None,
    writer: bool = True,
) -> dict:
    """Only the writer rank saves. stop_at: end after that step as if interrupted."""
    tc, budget = cfg.train, trainer.budget
    fresh = budget is not None and budget.train_t0 is None
    best = BestCheckpoint(run_dir, tc.keep_best, trainer.step, writer) if tc.keep_best else None
    if best is not None and evaluator is not None:  # a resume too: before any training
        if (removed := best.start(evaluator.prefixes())) is not None:
            logger.info(removed)
    first_eval = _step_zero_eval(cfg, trainer, evaluator, logger, best)
    if fresh:
        logger.info(report_start(budget))
    bar = tqdm(
        total=tc.steps if budget is None else None,  # a budgeted run ends on the clock
        initial=trainer.step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=progress_bars_off() or not writer,
    )
    loop = _Loop(cfg, trainer, source, evaluator, logger, run_dir, writer, best, bar)
    rank_dir = f"rank{torch.distributed.get_rank()}" if trainer.dp_world > 1 else ""
    prof_dir = os.path.join(run_dir, "profile", rank_dir)
    prof = StepProfiler(tc.profile_at, tc.profile_steps, trainer.device, prof_dir, logger)
    interrupted = None
    with loop.stop:
        while trainer.step < tc.steps:
            prof.before(trainer.step)
            interrupted, final = _step(loop)
            ending = final or interrupted is not None
            ending = ending or (stop_at is not None and trainer.step >= stop_at)
            prof.after(trainer.step, last=ending)
            if loop.first:
                loop.first = False
                _report_first_step(loop, fresh)
            if ending:
                break
    bar.close()
    return _finish(loop, interrupted, first_eval)


@dataclasses.dataclass
class _Loop:
    """What the steps of one train_loop share."""

    cfg: RunConfig
    trainer: DrafterTrainer
    source: BatchSource
    evaluator: object
    logger: Logger
    run_dir: str
    writer: bool
    best: BestCheckpoint | None
    bar: object
    last: dict = dataclasses.field(default_factory=dict)  # the latest figures of every kind
    stop: StopRequest = dataclasses.field(default_factory=StopRequest)
    first: bool = True  # this process's first step: kernels compile there (flex, compile)
    epochs: EpochForecast = dataclasses.field(default_factory=EpochForecast)  # said once

    def __post_init__(self):
        self.clock = StepClock(self.trainer.device)
        self.health = Health(self.trainer.device, self.cfg.train.lr)


def _step_zero_eval(cfg, trainer, evaluator, logger, best) -> dict | None:
    """The untrained drafter's figures (a fresh run only): the curves' first point."""
    if not (cfg.eval.enabled and trainer.step == 0):
        return None
    drafter = trainer.drafter_for_io()  # every rank: a collective when weights are sharded
    if evaluator is None:
        return None
    clock = _clock(trainer.budget)
    with _timed(trainer.budget, "eval"):
        first_eval = evaluator.run(drafter, trainer.heads)
    logger.log({**first_eval, **clock}, step=0)
    _log_reports(logger, evaluator, 0)
    if best is not None:  # an unknown figure stops the run here, before any training
        best.check(first_eval)
    phase_done("step-0 eval")
    return first_eval


def _report_first_step(loop: _Loop, fresh: bool) -> None:
    """train.log's line on the first step: its time (compiles) and the labels' greedy share."""
    last, cfg = loop.last, loop.cfg
    loop.logger.info(
        f"first step: {last['perf/target_s'] + last['perf/drafter_s']:.1f} s "
        f"(target {last['perf/target_s']:.1f} s, drafter {last['perf/drafter_s']:.1f} s)"
        f"; {last['train/greedy_agreement']:.2%} of its response tokens are the "
        "target's greedy tokens"
    )
    warning = agreement_warning(
        last["train/greedy_agreement"], cfg.data.answers == "given", cfg.target.enable_thinking
    )
    if warning is not None:
        loop.logger.info(warning)
    if fresh:
        loop.logger.info(loop.trainer.budget.window_line(cfg.train.warmup_ratio))


def _finish(loop: _Loop, interrupted, first_eval: dict | None) -> dict:
    budget, last, logger, best = loop.trainer.budget, loop.last, loop.logger, loop.best
    if budget is not None:
        last["time/run_min"] = budget.elapsed() / 60.0
        logger.info(
            f"time budget: {'stopped' if interrupted is None else 'interrupted'} at step "
            f"{loop.trainer.step} after {budget.elapsed() / 60:.1f} of {budget.total_s / 60:g} min"
        )
    if loop.writer and interrupted is None:
        _plot(loop.run_dir, logger)
    if loop.writer and best is not None and best.step is not None:
        logger.info(f"best: {best.path} ({best.metric} {best.value:.4f} at step {best.step})")
    _summarize(logger, last, first_eval)
    if interrupted is not None:
        raise interrupted
    return last


# steps in a row with a gradient norm of exactly 0 before the run warns that nothing is learned
ZERO_GRAD_STEPS = 10


class TrainingDiverged(ValueError):
    """The loss or the gradient norm went NaN / inf: the run stops before it saves or evaluates."""


class Health:
    """NaN / inf in the loss or gradient norm, and steps without any gradient, tracked on the
    device (no host sync a step) and read where the loop syncs anyway: at log, eval and save
    steps. Every data-parallel rank sees the same all-reduced figures, so all stop together."""

    def __init__(self, device: torch.device, lr: float):
        # [first step with a non-finite loss or gradient norm (0: none), steps in a row whose
        # gradient norm was exactly 0]
        self.state = torch.zeros(2, device=device)
        self.lr, self.warned = lr, False

    def track(self, figures, step: int) -> None:
        loss, grad_norm = figures.stats[0], figures.stats[-1]
        first, zeros = self.state[0], self.state[1]
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        first = torch.where(bad & (first == 0), float(step), first)
        zeros = torch.where(grad_norm == 0, zeros + 1, torch.zeros_like(zeros))
        self.state = torch.stack([first, zeros])

    def check(self, step: int) -> str | None:
        """Raise TrainingDiverged naming the first non-finite step since the start; return a
        warning line (once per stretch) after ZERO_GRAD_STEPS steps without any gradient."""
        first, zeros = (int(x) for x in self.state.tolist())
        if first:
            raise TrainingDiverged(
                f"step {first}: the loss or the gradient norm is NaN or inf; the run stops "
                f"without saving or evaluating these weights (train.lr={self.lr:g}: lower it, or "
                "check the data); checkpoints saved before are intact"
            )
        if zeros < ZERO_GRAD_STEPS:
            self.warned = False
            return None
        if self.warned:
            return None
        self.warned = True
        return (
            f"warning: the gradient norm has been exactly 0 for the last {zeros} steps (to step "
            f"{step}): the drafter is not learning (saturated logits after a too high "
            f"train.lr={self.lr:g}?)"
        )


def _clock(budget) -> dict:
    """An eval row's place on the budget clock (the drafter it scores had this much time):
    `python -m dflash.tools.compare --at / --plot` read tau against minutes from it."""
    return {"time/run_min": budget.elapsed() / 60.0} if budget is not None else {}


def _timed(budget, kind: str):
    return budget.timed(kind) if budget is not None else contextlib.nullcontext()


def _plot(run_dir: str, logger: Logger) -> None:
    """metrics.png in the run dir: the learning curve without wandb (dflash.common.plot)."""
    try:
        from ..common.plot import plot_run

        logger.info(f"plots: {plot_run(run_dir)}")
    except ImportError as e:
        logger.info(f"plots: skipped ({e}; pip install 'dflash[plots]')")


def _step(loop: _Loop):
    """One step: train; maybe log, eval (and keep the best), save. Returns (Interrupted when
    Ctrl-C asked to stop, whether this was the last step: train.steps reached or the time budget
    spent)."""
    tc, trainer, budget = loop.cfg.train, loop.trainer, loop.trainer.budget
    figures = _train(loop)
    step = trainer.step
    progress, interrupted = agree_max(  # one progress for every rank's learning rate
        [budget.progress() if budget is not None else 0.0, float(loop.stop.requested)],
        (trainer.ctrl_group or trainer.dp_group) if trainer.dp_world > 1 else None,
        trainer.device,
    )
    out_of_time, interrupted = progress >= 1.0, interrupted > 0
    final = step == tc.steps or out_of_time
    metrics = {"data/epoch": loop.source.stream.epoch}
    if budget is not None:
        trainer.follow_budget(progress)
        metrics["time/run_min"] = budget.elapsed() / 60.0
        metrics["time/budget_progress"] = progress
        stream = loop.source.stream
        epochs = loop.epochs.update(progress, stream.epoch, stream.num_samples)
        if epochs is not None and loop.writer:
            loop.logger.info(epochs)
    loop.bar.update(1)
    log = step % tc.log_every == 0 or final
    if log or loop.first:  # the first step is read for its timing line (kernels compile there)
        loop.clock.read(figures, metrics)
    if log:
        _log_step(loop, metrics, step)
    loop.last.update(metrics)
    periodic = step % tc.save_every == 0 or final
    evaluate = loop.cfg.eval.enabled and (step % tc.eval_every == 0 or final)
    save = periodic or (interrupted and tc.save_on_interrupt)
    if log or evaluate or save:  # NaN / inf stops the run here: never evaluated, never saved
        if (warning := loop.health.check(step)) is not None:
            loop.logger.info(warning)
    drafter = trainer.drafter_for_io() if evaluate or save else None  # every rank (collective)
    ev = _evaluate(loop, drafter, step) if evaluate else None
    if save:
        ended = "steps" if step == tc.steps else "budget" if out_of_time else None
        _save(loop, drafter, step, ended)
    if loop.best is not None and ev is not None:  # after the save: never costs it
        with _timed(budget, "save"):
            if loop.best.offer(step, ev, drafter) and loop.writer:
                loop.logger.info(f"best {loop.best.metric} so far: {loop.best.value:.4f}; kept")
    if interrupted:
        saved = loop.last.get("checkpoint") if periodic or tc.save_on_interrupt else None
        return Interrupted(step, saved), final
    return None, final


def _train(loop: _Loop):
    """The step itself, its kernels queued (no host sync): its figures, still on the device."""
    trainer, budget, clock = loop.trainer, loop.trainer.budget, loop.clock
    b0 = budget.now() if budget is not None else None
    t0 = time.perf_counter()
    clock.marks = []
    clock.mark()
    batches = loop.source.next_batches()
    clock.mark()
    figures = trainer.step_async(batches)
    loop.health.track(figures, trainer.step)
    clock.mark()
    clock.busy_s += time.perf_counter() - t0
    if budget is not None and loop.first:  # it compiled: not warmup, nor a step's length
        budget.first_step_done(budget.now() - b0)
    elif budget is not None:
        budget.note("step", budget.now() - b0)
    return figures


def _log_step(loop: _Loop, metrics: dict, step: int) -> None:
    interval = loop.trainer.interval_counts()
    metrics["perf/tokens_per_s"] = interval["tokens"] / max(loop.clock.busy_s, 1e-9)
    loop.clock.busy_s = 0.0
    source = loop.source
    metrics.update(source.step_metrics(metrics["perf/target_s"], metrics["perf/drafter_s"]))
    metrics.update(source.interval_metrics())
    metrics.update(_compiled())
    loop.logger.log(metrics, step)
    post = {"loss": f"{metrics['train/loss']:.3f}", "acc": f"{metrics['train/acc']:.3f}"}
    if (budget := loop.trainer.budget) is not None:
        post["left"] = f"{max(budget.left(), 0) / 60:.1f}m"
    loop.bar.set_postfix(post)


def _evaluate(loop: _Loop, drafter, step: int) -> dict | None:
    if loop.evaluator is None:  # a rank that does not evaluate (it took part in drafter_for_io)
        return None
    at = _clock(loop.trainer.budget)
    with _timed(loop.trainer.budget, "eval"):
        ev = loop.evaluator.run(drafter, loop.trainer.heads)
    loop.logger.log({**ev, **at}, step)
    _log_reports(loop.logger, loop.evaluator, step)
    loop.last.update(ev, eval_step=step)  # the summary says which step its figures are from
    return ev


def _save(loop: _Loop, drafter, step: int, ended: str | None) -> None:
    trainer, tc = loop.trainer, loop.cfg.train
    shards = trainer.par if trainer.par.shards_optimizer else None  # every rank saves its part
    if not (loop.writer or shards is not None):
        return
    with _timed(trainer.budget, "save"):
        saved = save_checkpoint(
            loop.run_dir,
            step,
            drafter,
            trainer.state_dict(),
            tc.keep_last,
            extra={"source": loop.source.state_dict()},
            shards=shards,
            writer=loop.writer,
            run_info={"ended": ended, "time_budget_min": tc.time_budget_min} if ended else None,
        )
    if loop.writer:
        loop.last["checkpoint"] = saved
        loop.logger.log_checkpoint(saved, step)


def _log_reports(logger: Logger, evaluator, step: int) -> None:
    for name, reports in evaluator.reports_by_set.items():
        logger.log_eval(reports, step, name)


def _compiled() -> dict:
    """Graphs torch.compile has built in this process so far: a step in this figure marks an
    interval that paid a (re)compile (train.fuse, train.compile, the fused CE)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"perf/compiled_graphs": float(counters["stats"]["unique_graphs"])}


def _summarize(logger: Logger, last: dict, first_eval: dict | None) -> None:
    # eval (the unnamed set) and eval/<set>: the prefixes of the tau keys
    sets = sorted({k[: -len("/tau")] for k in last if (e := eval_key(k)) and e[1] == "tau"})
    if first_eval is not None:
        for p in sets:
            last[p.replace("eval", "eval0", 1) + "/streak"] = first_eval.get(p + "/streak")
            last[p.replace("eval", "eval0", 1) + "/tau"] = first_eval.get(p + "/tau")
    logger.summary({k: v for k, v in last.items() if isinstance(v, (int, float))})
    if "checkpoint" in last:
        logger.info(f"checkpoint: {last['checkpoint']}")
    for p in sets:  # eval (the unnamed set) or eval/<set>
        label = "eval" + (f" {p[5:]}" if p != "eval" else "")
        msg = f"{label}: streak {last[p + '/streak']:.3f}  tau {last[p + '/tau']:.3f}"
        msg += f"  at step {last['eval_step']}" if "eval_step" in last else ""
        if first_eval is not None and p + "/tau" in first_eval:
            msg += (
                f"  (at step 0: streak {first_eval[p + '/streak']:.3f}, "
                f"tau {first_eval[p + '/tau']:.3f})"
            )
        logger.info(msg)
    logger.close()
