"""Ctrl-C during training: the first SIGINT lets the current step finish (then the loop saves when
train.save_on_interrupt and stops); a second one abandons the step at once. Either way the
launcher prints one line with the command that resumes the run, and exits 130."""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist


class Interrupted(Exception):
    """The train loop stopped on Ctrl-C after `step` (checkpoint: the saved step dir or None)."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


class StopRequest:
    """Context manager around the train loop: SIGINT sets `requested` instead of raising."""

    def __init__(self):
        self.requested = False
        self._prev = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\ninterrupt: finishing the current step (Ctrl-C again abandons it)",
            file=sys.stderr,
            flush=True,
        )


def agree_any(flags: list[bool], group=None, device: torch.device | None = None) -> list[bool]:
    """Each flag as true on every data-parallel rank if it is true on any (one all-reduce for
    all of them): every rank must stop after the same step (a rank that stopped alone would leave
    its peers waiting in the next all-reduce), whether its clock ran out or Ctrl-C reached it.
    On a gloo group the flags stay on the host: an NCCL all-reduce read back with .tolist() waits
    for the whole step's kernels (a sync a step); the train loop passes its gloo control group."""
    if group is None:
        return list(flags)
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [v > 0 for v in t.tolist()]
