"""Plots a person can look at without wandb (`python -m dflash.tools.plot RUN_DIR`; every run
writes RUN_DIR/metrics.png at its end).

Reads <run_dir>/metrics.jsonl (written by every run) and draws training loss / accuracy, eval
streak / tau / DDTree acceptance, and throughput against the step; `plot_curves` draws the eval
tau of several runs against their training minutes (`python -m dflash.tools.compare --plot`)."""

from __future__ import annotations

import bisect
import json
import math
import os

from .loggers import eval_key


def load_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; pass a run directory (outputs/<run>)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict], key: str):
    pts = [
        (r["step"], r[key])
        for r in rows
        if key in r
        and r[key] is not None
        and not (isinstance(r[key], float) and math.isnan(r[key]))
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def eval_set_keys(rows: list[dict], metric: str) -> list[str]:
    """eval/<set>/<metric> of every named eval set in the rows."""
    return sorted(
        {k for r in rows for k in r if (e := eval_key(k)) and e[0] is not None and e[1] == metric}
    )


def plot_run(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = run_figure(load_metrics(run_dir))
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_figure(rows: list[dict]):
    """Loss, accuracy, tau (per eval set, with its largest DDTree budget) and tokens/s by step."""
    import matplotlib.pyplot as plt

    def line(ax, key, **kw):  # a series only where the run logged it (no empty legend entries)
        xs, ys = series(rows, key)
        return ax.plot(xs, ys, **kw)[0].get_color() if xs else None

    def legend(ax, **kw):  # a panel with nothing logged (no eval yet) stays without one
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**kw)

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    line(ax, "train/loss", label="train loss (hard CE)")
    ax.set_xlabel("step"), ax.set_title("loss"), legend(ax)
    ax = axes[0, 1]
    line(ax, "train/acc", label="train acc (weighted)")
    for k in sorted(
        {k for r in rows for k in r if k.startswith("eval/acc_pos_")},
        key=lambda k: int(k.rsplit("_", 1)[1]),
    )[:4]:
        line(ax, k, marker="o", label=k)
    for k in eval_set_keys(rows, "acc_pos_1"):  # eval.sets: block position 1 per set
        line(ax, k, marker="o", label=f"{k.split('/')[1]} acc_pos_1")
    ax.set_xlabel("step"), ax.set_title("accuracy"), legend(ax, fontsize=7)
    ax = axes[1, 0]
    line(ax, "eval/tau", marker="o", label="tau (chain)")
    for k in sorted(
        {k for r in rows for k in r if k.startswith("eval/tau@")},
        key=lambda k: int(k.split("@")[1]),
    ):
        line(ax, k, marker=".", label=k)
    for k in eval_set_keys(rows, "tau"):  # eval.sets: chain tau and the largest DDTree budget
        name = k.split("/")[1]
        color = line(ax, k, marker="o", label=f"tau {name}")
        trees = {t for r in rows for t in r if t.startswith(f"eval/{name}/tau@")}
        if trees:
            top = max(trees, key=lambda t: int(t.split("@")[1]))
            label = f"{name} {top.split('/')[2]}"
            line(ax, top, marker=".", linestyle="--", color=color, label=label)
    (
        ax.set_xlabel("step"),
        ax.set_title("acceptance length (greedy, exact offline)"),
        legend(ax, fontsize=7),
    )
    ax = axes[1, 1]
    line(ax, "perf/tokens_per_s", label="tokens/s")
    ax.set_xlabel("step"), ax.set_title("throughput"), legend(ax)
    return fig


def run_minutes(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, minutes) of a run's rows, by step: the budget clock (time/run_min, budgeted runs:
    training time with the start-up phases it counts), else the logger's wall clock (`time`)."""
    key = "time/run_min" if any("time/run_min" in r for r in rows) else "time"
    scale = 1.0 if key == "time/run_min" else 1 / 60
    return sorted((r["step"], r[key] * scale) for r in rows if r.get(key) is not None)


def minutes_at(points: list[tuple[int, float]], step: int) -> float | None:
    """A step's minutes, linear between the nearest rows that have a clock (None: no clock);
    `points` sorted by step (run_minutes)."""
    if not points:
        return None
    i = bisect.bisect_right(points, (step, math.inf))  # first point after the step
    if i == 0:
        return points[0][1]
    (s0, m0) = points[i - 1]
    if s0 == step or i == len(points):
        return m0
    (s1, m1) = points[i]
    return m0 + (m1 - m0) * (step - s0) / (s1 - s0)


def eval_curve(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(minutes, value) of an eval metric over a run."""
    clock = run_minutes(rows)
    steps, values = series(rows, key)
    out = [(minutes_at(clock, s), v) for s, v in zip(steps, values)]
    out = [(m, v) for m, v in out if m is not None]
    return [m for m, _ in out], [v for _, v in out]


def plot_curves(runs: list[tuple[str, list[dict]]], out: str, metric: str = "tau") -> str:
    """Eval `metric` (chain tau; each eval set's too) of (label, rows) runs against minutes of
    training, one line per run and set: what more GPU time buys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in runs:
        keys = eval_set_keys(rows, metric) or [f"eval/{metric}"]
        for key in keys:
            xs, ys = eval_curve(rows, key)
            name = label if key == f"eval/{metric}" else f"{label} {key.split('/')[1]}"
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("minutes of training (budget clock)")
    ax.set_ylabel(metric)
    ax.set_title(f"eval {metric} against training time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
