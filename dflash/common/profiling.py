"""`train.profile_at=N`: torch.profiler over train.profile_steps steps of the real loop, from
step N on, into RUN/profile/: the operator tables (by device time and by host time), a Chrome
trace, and one line in train.log that says whether the GPU or the host bounds the loop.

The device's busy time is the union of its kernels' intervals (two streams running at once count
once). The profiler slows the host (it records every op), so the share of the wall the GPU
computed is taken against the wall time of the same number of steps just before the profile,
timed without it (when profile_at leaves room for them). Profile away from eval and save steps:
their time lands in the windows too.

StepClock: the loop's own step timing at every log step (target and drafter parts, tokens/s),
without the profiler."""

from __future__ import annotations

import json
import os
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def phase_times(avgs, n: int) -> dict[str, list[float]]:
    """{dflash.* range: [host ms, device ms] per step} from key_averages. On CUDA a range is
    listed twice (its host span, and its span on the GPU timeline): the larger of each is kept."""
    phases: dict[str, list[float]] = {}
    for e in avgs:
        if e.key.startswith("dflash."):
            host, dev = e.cpu_time_total / 1e3 / n, getattr(e, "device_time_total", 0) / 1e3 / n
            old = phases.get(e.key, [0.0, 0.0])
            phases[e.key] = [max(old[0], host), max(old[1], dev)]
    return phases


class StepProfiler:
    """Profiles steps [first, first + count) of this process; `before` and `after` bracket each
    step of the loop. Inactive (two integer compares a step) when train.profile_at is 0."""

    def __init__(self, first: int, count: int, device: torch.device, out_dir: str, logger=None):
        if first < 0:
            raise ValueError(f"train.profile_at must be >= 0 (0: off), got {first}")
        self.first, self.count, self.device = first, count, device
        self.out_dir, self.logger = out_dir, logger
        self.prof = None
        self.t0 = None  # start of the window being timed (the baseline, then the profile)
        self.steps = 0
        self.baseline_ms: float | None = None
        self.result: dict | None = None

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def before(self, step: int) -> None:
        """step: the trainer's step count before the step (the step taken is step + 1)."""
        if self.first <= 0 or self.prof is not None or self.result is not None:
            return
        if self.t0 is None and self.first - self.count <= step + 1 < self.first:
            self.t0, self.steps = self._sync(), 0  # the unprofiled baseline window
        if step + 1 < self.first:
            return
        if self.t0 is not None and self.steps:
            self.baseline_ms = (self._sync() - self.t0) * 1e3 / self.steps
        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0, self.steps, self.start_step = self._sync(), 0, step + 1

    def after(self, step: int, last: bool = False) -> None:
        if self.t0 is None:
            return
        self.steps += 1
        if self.prof is None or (self.steps < self.count and not last):
            return
        wall_s = self._sync() - self.t0
        self.prof.__exit__(None, None, None)
        self.result = self._write(wall_s, step)
        self.prof = None

    def _write(self, wall_s: float, step: int) -> dict:
        os.makedirs(self.out_dir, exist_ok=True)
        name = f"steps_{self.start_step}-{step}"
        events = self.prof.events()
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == DeviceType.CUDA
        ]
        n = self.steps
        res = {
            "steps": [self.start_step, step],
            "wall_ms_per_step_profiled": wall_s * 1e3 / n,
            "wall_ms_per_step": self.baseline_ms or wall_s * 1e3 / n,
            "wall_unprofiled": self.baseline_ms is not None,
            "device_kernels_per_step": len(kernels) / n,
        }
        if kernels:
            busy = busy_union_us(kernels) / 1e3 / n
            res |= {
                "device_busy_ms_per_step": busy,
                "device_busy_frac": busy / res["wall_ms_per_step"],
            }
        avgs = self.prof.key_averages()
        res["phases_ms_per_step"] = phase_times(avgs, n)
        by = "self_device_time_total" if kernels else "self_cpu_time_total"
        with open(os.path.join(self.out_dir, f"{name}.txt"), "w") as f:
            f.write(json.dumps(res, indent=2) + "\n\n")
            f.write(avgs.table(sort_by=by, row_limit=40) + "\n")
            if kernels:
                f.write(avgs.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
        self.prof.export_chrome_trace(os.path.join(self.out_dir, f"{name}.trace.json"))
        if self.logger is not None:
            self.logger.info(self.summary(res, os.path.join(self.out_dir, f"{name}.txt")))
        return res

    @staticmethod
    def summary(res: dict, path: str) -> str:
        a, b = res["steps"]
        msg = f"profile of steps {a}-{b}: {res['wall_ms_per_step']:.1f} ms a step"
        msg += " (timed unprofiled just before)" if res["wall_unprofiled"] else " (profiled)"
        if "device_busy_frac" in res:
            frac = res["device_busy_frac"]
            msg += (
                f", GPU kernels busy {res['device_busy_ms_per_step']:.1f} ms ({frac:.0%}) in "
                f"{res['device_kernels_per_step']:.0f} kernels: "
                + ("GPU-bound" if frac >= 0.9 else "the GPU waits on the host part of the time")
            )
        return msg + f" ({path}, trace next to it)"


class StepClock:
    """Where the steps' time goes, read at log steps only (reading waits for the GPU).

    A step queues its kernels without waiting for them, so host wall times per step measure
    launches: on CUDA the target and drafter times are the GPU time between events recorded
    around each part of the logged step; on CPU they are wall times. Throughput counts the
    interval since the last log step: its steps' host time plus the wait for the GPU to catch
    up at the read (eval and checkpoint time left out)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.marks: list = []
        self.busy_s = 0.0  # host time of the steps since the last log step, and the final wait

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def parts(self) -> tuple[float, float]:
        """(target, drafter) seconds of the step just marked (start, batches, step)."""
        m0, m1, m2 = self.marks[-3:]
        if self.cuda:
            m2.synchronize()
            return m0.elapsed_time(m1) / 1e3, m1.elapsed_time(m2) / 1e3
        return m1 - m0, m2 - m1

    def read(self, figures, metrics: dict) -> None:
        """The step's figures and its parts' times into metrics: the interval's one host sync."""
        t_read = time.perf_counter()
        metrics.update(figures.read())
        metrics["perf/target_s"], metrics["perf/drafter_s"] = self.parts()
        self.busy_s += time.perf_counter() - t_read
