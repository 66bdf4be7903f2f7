"""`train.time_budget_min`: a run that ends on the clock instead of at `train.steps`.

The budget is wall-clock time for the whole run, summed over resumes: loading the target,
regenerating the data, training, the in-loop evals, the final eval and the last save. Training
ends once what is left would only just fit one more step and the final eval and save (`reserve`:
the longest step, and the longest eval and save seen so far x 1.25), so the run finishes inside
the budget. The learning-rate schedule (warmup, cosine) follows the fraction of the training
window used instead of the step count, so a budgeted run always reaches the end of its schedule;
`train.steps` is then an upper bound.

The window opens when the first step has finished: that step compiles (torch.compile, flex
attention, the compiled capture: ~30 s on the GPU recipes), and counted in a 20-minute run it
used up the whole warmup, so training started at the peak learning rate. Its length is not kept
as a step's either (the reserve would hold 30 s for one more step). After each step the loop
agrees one progress over the data-parallel ranks (the furthest clock) and sets the learning rate
from it (`schedule`): each rank reading its own clock would give the replicas different learning
rates, and their weights would drift apart.

The clock starts when `dflash` is first imported (the launcher imports it first thing) and is
saved in every checkpoint: a resumed run counts the time its earlier part spent up to the
checkpoint (the minutes between the interruption and the resume are not counted; what ran after
the checkpoint is redone and counted again). A resume may change the budget: the schedule goes on
from the fraction it had reached and spreads the rest over what the new budget leaves, so the
learning rate continues without a jump; so does the first step of the resumed process, which
compiles again (counted as one step of the length seen before: 30 s moved a 20-minute schedule by
2.5 % in one step).
"""

from __future__ import annotations

import contextlib
import time

from .. import PROCESS_T0
from .losses import cosine_decay

RESERVE_FACTOR = 1.25  # margin on the longest eval + save seen
_RUN_T0: float | None = None  # set by the launcher: the run started with the process


def start_clock_at_process_start() -> None:
    """The launcher's first act: budgets count from when the process imported dflash. Without
    it (a run started from Python) a budget counts from the trainer's construction."""
    global _RUN_T0
    _RUN_T0 = PROCESS_T0


class TimeBudget:
    def __init__(self, minutes: float, now=None):
        """now: the clock (time.monotonic; tests pass their own)."""
        self.total_s = float(minutes) * 60.0
        self._now = now or time.monotonic
        self._t0 = _RUN_T0 if (_RUN_T0 is not None and now is None) else self._now()
        self.prior_s = 0.0  # spent by earlier parts of the run (from the checkpoint)
        self.train_t0: float | None = None  # run time when training started
        self._longest: dict[str, float] = {}  # longest eval / save seen
        # (run time, progress) where a resume changed the budget: progress continues from there
        self._rebase: tuple[float, float] | None = None
        self.schedule = 0.0  # the progress the learning rate follows, agreed by every rank

    def now(self) -> float:
        return self._now()

    def elapsed(self) -> float:
        return self.prior_s + self._now() - self._t0

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def start_training(self) -> None:
        """The training window opens (the loop calls it when the first step has finished)."""
        if self.train_t0 is None:
            self.train_t0 = self.elapsed()

    def first_step_done(self, took: float) -> None:
        """This process's first step finished after `took` s: it compiled. A fresh run opens its
        window now; a resumed one goes on with its schedule as if the step had taken as long as
        its longest step before, so the compile moves neither the learning rate nor the reserve
        (the rest of the schedule spreads over what the budget leaves)."""
        if self.train_t0 is None:
            self.start_training()
            return
        before = self.elapsed() - took
        as_if = self._progress_at(before + min(took, self._longest.get("step", 0.0)))
        self._rebase = (self.elapsed(), as_if)

    def window_line(self, warmup_ratio: float) -> str:
        """train.log's line when the training window opens (after the first step)."""
        window = self.total_s - self.reserve_s - self.train_t0
        if window <= 0:
            return "time budget: spent by the first step; the run ends with it"
        return (
            f"time budget: {window / 60:.1f} min of training from here; the lr warms up over the "
            f"first {warmup_ratio * window:.0f} s of them (train.warmup_ratio={warmup_ratio:g})"
        )

    @contextlib.contextmanager
    def timed(self, kind: str):
        """Time an eval or a save on the run's clock and keep room for one more of it."""
        t0 = self._now()
        yield
        self.note(kind, self._now() - t0)

    def note(self, kind: str, seconds: float) -> None:
        """An eval, a save or a step (`kind`) took `seconds`: keep room for one more of each at
        the end (the clock is read after a step, so the step that would cross the line is never
        started)."""
        self._longest[kind] = max(self._longest.get(kind, 0.0), float(seconds))

    @property
    def reserve_s(self) -> float:
        """Room kept at the end: one more eval and save (x RESERVE_FACTOR) and one more step."""
        step = self._longest.get("step", 0.0)
        return RESERVE_FACTOR * (sum(self._longest.values()) - step) + step

    def progress(self) -> float:
        """Fraction of the training window used: 0 when training starts, 1 when it must end."""
        return self._progress_at(self.elapsed())

    def _progress_at(self, elapsed: float) -> float:
        t0 = self.train_t0 if self.train_t0 is not None else elapsed
        p0 = 0.0
        if self._rebase is not None:
            t0, p0 = self._rebase
        window = self.total_s - self.reserve_s - t0
        if window <= 0 or p0 >= 1.0:
            return 1.0
        return min(1.0, max(0.0, p0 + (1.0 - p0) * (elapsed - t0) / window))

    def done(self) -> bool:
        return self.progress() >= 1.0

    def state_dict(self) -> dict:
        return {
            "elapsed_s": self.elapsed(),
            "train_t0": self.train_t0,
            "longest": dict(self._longest),
            "total_s": self.total_s,
            "rebase": self._rebase,
            "schedule": self.schedule,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the clock of a checkpoint (this process's own time, loading and cached data
        included, keeps counting on top)."""
        self.prior_s = float(state["elapsed_s"])
        self.train_t0 = state["train_t0"]
        self._longest = {k: float(v) for k, v in state["longest"].items()}
        self._rebase = tuple(state["rebase"]) if state.get("rebase") else None
        saved_total = float(state.get("total_s", self.total_s))
        if saved_total != self.total_s:  # train.time_budget_min changed on resume
            mine, self.total_s = self.total_s, saved_total
            reached = self.progress()  # where the checkpoint's own budget had got to
            self.total_s = mine
            self._rebase = (self.prior_s, reached)
        # the progress the checkpoint's next learning rate was set from (older ones: the clock's)
        self.schedule = float(state.get("schedule", self.progress()))


_PHASES: list[tuple[str, float]] = []  # this run's (phase, monotonic time it ended)


def start_phases() -> None:
    """A run starts in this process: its phases count from the process start (the first run) or
    from now (a later run of a multirun or a test session)."""
    _PHASES[:] = [("", time.monotonic() if _PHASES else PROCESS_T0)]


def phase_done(name: str) -> None:
    """A startup phase of this run ended now (target load, data, ...): train.log's "spent before
    training" line lists them."""
    if _PHASES:
        _PHASES.append((name, time.monotonic()))


def startup_phases() -> str:
    """'data 140 s, ...': each phase's seconds since the previous one ended, in order."""
    return ", ".join(f"{n} {t - t0:.0f} s" for (_, t0), (n, t) in zip(_PHASES, _PHASES[1:]))


def report_start(budget: TimeBudget) -> str:
    """How much of the budget went before the first step (target load, data, eval set, step-0
    eval), and a warning when that leaves training less than half."""
    spent, total = budget.elapsed(), budget.total_s
    msg = f"time budget: {spent / 60:.1f} of {total / 60:g} min spent before training"
    if phases := startup_phases():
        msg += f" ({phases})"
    if spent > total / 2:
        msg += (
            f"; training gets {max(total - spent, 0) / 60:.1f} min: raise train.time_budget_min, "
            "lower data.num_samples, or reuse a data cache (data.cache_dir)"
        )
    return msg


class EpochForecast:
    """train.log's line, once 5 % of the training window has run, with the epochs of the data
    the budget will read at this pace (from this process's first step: a resumed run's too). A
    budget that reads the same samples many times buys little: the Qwen recipe's tau stopped
    rising at 15 epochs (the 60-minute run, 2026-12-07), SmolLM2's at 17, while training
    accuracy kept climbing."""

    AFTER = 0.05  # of the window, since the first observation
    MANY = 15  # epochs

    def __init__(self):
        self.start: tuple[float, float] | None = None
        self.said = False

    def update(self, progress: float, epoch: float, num_samples: int) -> str | None:
        if self.said:
            return None
        if self.start is None:
            self.start = (progress, epoch)
            return None
        p0, e0 = self.start
        if progress - p0 < self.AFTER:
            return None
        self.said = True
        end = e0 + (epoch - e0) / (progress - p0) * (1.0 - p0)
        msg = (
            f"time budget: at this pace the run reads each of its {num_samples:,} samples "
            f"~{end:.0f} times ({end:.1f} epochs by the end)"
        )
        if end > self.MANY:
            msg += (
                "; in the recipes measured tau stopped rising at 15-17 epochs while training "
                "accuracy kept climbing (docs/performance.md): more distinct prompts "
                "(data.num_samples) would use this budget better"
            )
        return msg


def budget_lr(progress: float, warmup_ratio: float, min_ratio: float) -> float:
    """LR multiplier against the fraction of the training window: linear warmup over the first
    warmup_ratio of it, then cosine to min_ratio at the end (the step schedule of loss.cosine_lr,
    with time for steps)."""
    if warmup_ratio > 0 and progress < warmup_ratio:
        return max(progress / warmup_ratio, 1e-3)
    return cosine_decay((progress - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio), min_ratio)
