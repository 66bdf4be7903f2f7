"""Stop requests: Ctrl-C (SIGINT) and SIGTERM (preemption, `scancel`, Kubernetes, torchrun
passing a stop on). During training the first one lets the current step finish (then the loop
saves when train.save_on_interrupt and stops); a second one abandons the step at once. Either
way the launcher prints one line with the command that resumes the run, and exits 128 + the
signal's number: 130 for SIGINT, 143 for SIGTERM. Outside the train loop a stop signal ends the
process at once, as Ctrl-C does (KeyboardInterrupt), with the same exit code."""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals this process got, in order


class Interrupted(Exception):
    """The train loop stopped on a stop signal after `step` (checkpoint: the saved step dir or
    None); `signum`: the signal that asked."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint
        self.signum = stop_signal() or signal.SIGINT


def stop_signal() -> int | None:
    """The first stop signal this process received (None: none)."""
    return _received[0] if _received else None


def exit_code(signum: int | None) -> int:
    return 128 + int(signum or signal.SIGINT)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum or signal.SIGINT).name


def stop_at_once() -> dict:
    """Outside the train loop: SIGTERM ends the process as Ctrl-C does (a KeyboardInterrupt the
    launcher turns into its one line and exit code), instead of killing it where it stands.
    Returns the handlers it replaced (for `restore`). A run starts here: earlier signals (of an
    earlier run in this process) are forgotten."""
    _received.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame):
        _received.append(signum)
        raise KeyboardInterrupt

    return {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}


def restore(handlers: dict) -> None:
    for s, h in handlers.items():
        signal.signal(s, h)


class StopRequest:
    """Context manager around the train loop (and a split worker's production): a stop signal
    sets `requested` instead of raising; a second one raises KeyboardInterrupt."""

    def __init__(self, what: str = "finishing the current step"):
        self.requested = False
        self.what = what
        self._prev: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._prev = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, prev in self._prev.items():
            signal.signal(s, prev)

    def _on_signal(self, signum, frame) -> None:
        _received.append(signum)
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        again = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
        print(
            f"\n{'interrupt' if signum == signal.SIGINT else signal_name(signum)}: {self.what} "
            f"({again} again abandons it)",
            file=sys.stderr,
            flush=True,
        )


def agree_max(values: list[float], group=None, device: torch.device | None = None) -> list[float]:
    """Each value's maximum over the data-parallel ranks, in one all-reduce: the train loop's
    stop flags (every rank must stop after the same step: a rank that stopped alone would leave
    its peers waiting in the next all-reduce, whether its clock ran out or Ctrl-C reached it) and
    the budget's progress (every rank's learning rate is set from the furthest clock). On a gloo
    group the values stay on the host: an NCCL all-reduce read back with .tolist() waits for the
    whole step's kernels (a sync a step); the train loop passes its gloo control group."""
    if group is None:
        return list(values)
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
