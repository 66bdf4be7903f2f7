"""An ablation table from run directories: `python -m dflash.tools.compare RUN_DIR... [--out T.md]`.

For each run: the config keys that differ between the runs (the ablated settings), its last
step, its wall time (budgeted runs), its final eval (tau, the largest DDTree budget's tau@b),
its last training accuracy and its median training throughput, as one markdown table. Runs of a
sweep (`python train.py -m +exp=NAME drafter.num_layers=2,4 ...`) or any runs side by side.
`--at 20,40,60`: each run's tau at those minutes of training too (its last eval by then);
`--plot FILE.png`: every run's eval tau against its minutes of training, on one plot.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

from ..common.layout import read_run_config
from ..common.loggers import eval_key
from ..common.plot import eval_curve, eval_set_keys, load_metrics, plot_curves
from ..config import EVAL_BEFORE_THE_KEY, EVAL_NOT_IN_SET_KEY


def flat_config(run_dir: str) -> dict:
    path = os.path.join(run_dir, "run_config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; pass run directories (outputs/<run>)")
    cfg = read_run_config(run_dir)
    if isinstance(cfg.get("eval"), dict):  # a run saved before a key: what it ran with
        cfg["eval"] = {**EVAL_BEFORE_THE_KEY, **cfg["eval"]}
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", cfg)
    return out


_NOT_SETTINGS = ("run_name", "out_root", "resume", "ckpt", "out", "eval_dir", "data.cache_dir")


def differing_keys(configs: list[dict]) -> list[str]:
    keys = sorted({k for c in configs for k in c})
    return [
        k
        for k in keys
        if not k.startswith(_NOT_SETTINGS)
        and len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1
    ]


def eval_set_keys_differ(keys: list[str]) -> list[str]:
    """Of the differing settings, those that change the eval set: such runs' tau are scored on
    other text (`eval.near_tie_rounds` 0 cuts each completion at its first bf16 near-tie, 4
    scores it whole) and do not compare."""
    return [k for k in keys if k.startswith("eval.") and k.split(".")[1] not in EVAL_NOT_IN_SET_KEY]


def summarize(rows: list[dict]) -> dict:
    evals = [r for r in rows if any((e := eval_key(k)) and e[1] == "tau" for k in r)]
    train = [r for r in rows if "train/loss" in r]
    last_eval = evals[-1] if evals else {}
    budgets = sorted(int(k.split("@")[1]) for k in last_eval if k.startswith("eval/tau@"))
    out = {
        "step": max((r["step"] for r in rows), default=0),
        "minutes": max((r.get("time/run_min", 0.0) for r in rows), default=0.0) or None,
        "tau": last_eval.get("eval/tau"),
        # eval.sets: each set's tau
        "set_tau": {k.split("/")[1]: last_eval[k] for k in eval_set_keys([last_eval], "tau")},
        "tree": (budgets[-1], last_eval[f"eval/tau@{budgets[-1]}"]) if budgets else None,
        "acc": train[-1]["train/acc"] if train else None,
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in train) if train else None,
        "epochs": train[-1].get("data/epoch") if train else None,
    }
    return out


def tau_by(rows: list[dict], minutes: float) -> dict[str, float]:
    """set name ('' for the unnamed set) -> tau of the last eval at or before `minutes` of
    training."""
    out = {}
    for key in eval_set_keys(rows, "tau") or ["eval/tau"]:
        xs, ys = eval_curve(rows, key)
        done = [y for x, y in zip(xs, ys) if x <= minutes + 1e-9]
        if done:
            out[key.split("/")[1] if key.count("/") == 2 else ""] = done[-1]
    return out


def label(run_dir: str, config: dict, keys: list[str]) -> str:
    """A run's name and its differing settings (for plot legends)."""
    name = os.path.basename(os.path.normpath(run_dir))
    return name + (" (" + ", ".join(f"{k}={config.get(k)}" for k in keys) + ")" if keys else "")


def load_runs(run_dirs: list[str]) -> list[tuple[str, dict, list[dict]]]:
    """(run dir, flat config, metrics rows) of each run, read once for the table and the plot."""
    return [(d, flat_config(d), load_metrics(d)) for d in run_dirs]


def table(run_dirs: list[str], at: list[float] = (), runs=None) -> str:
    runs = runs if runs is not None else load_runs(run_dirs)
    keys = differing_keys([c for _, c, _ in runs])
    head = ["run", *keys, "steps", "min", "epochs", "train acc", "tokens/s", "tau", "DDTree tau@b"]
    head += [f"tau @{m:g} min" for m in at]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d, c, rows in runs:
        s = summarize(rows)
        cells = [os.path.basename(os.path.normpath(d))]
        cells += [json.dumps(c.get(k)) if not isinstance(c.get(k), str) else c[k] for k in keys]
        cells += [
            str(s["step"]),
            _f(s["minutes"], 1),
            _f(s["epochs"], 2),
            _f(s["acc"], 3),
            _f(s["tokens_per_s"], 0),
            _f(s["tau"], 3)
            if not s["set_tau"]
            else ", ".join(f"{n} {v:.3f}" for n, v in sorted(s["set_tau"].items())),
            f"{s['tree'][1]:.3f} @{s['tree'][0]}" if s["tree"] else "-",
        ]
        for m in at:
            by = tau_by(rows, m)
            cells.append(", ".join(f"{n} {v:.3f}".strip() for n, v in sorted(by.items())) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    apart = eval_set_keys_differ(keys)
    if apart:
        lines.append(
            f"\nThe runs' evals score different sets ({', '.join(apart)}): their tau and DDTree"
            " columns do not compare. Score each checkpoint on one set: `python eval.py"
            " ckpt=RUN` with the same settings (e.g. eval.near_tie_rounds=4)."
        )
    return "\n".join(lines) + "\n"


def _f(x, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def run_dirs(patterns: list[str]) -> list[str]:
    """The run directories the patterns name; each one left out is said on stderr (a folder
    without run_config.json, such as a device call's res/ with metrics.jsonl alone, or a
    pattern that matches nothing), so no run drops out of a table unseen."""
    dirs = []
    for pat in patterns:
        found = [d for d in sorted(glob.glob(pat)) if os.path.isdir(d)]
        if not found:
            print(f"skipped {pat}: no such directory", file=sys.stderr)
        for d in found:
            if os.path.isfile(os.path.join(d, "run_config.json")):
                dirs.append(d)
            else:
                print(
                    f"skipped {d}: no run_config.json (a run directory has one; for a folder with"
                    " metrics.jsonl alone, copy its run's run_config.json next to it)",
                    file=sys.stderr,
                )
    if not dirs:
        raise SystemExit(f"error: no run directories (with run_config.json) in {patterns}")
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (globs allowed)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument(
        "--at", default="", help="comma-separated minutes: each run's tau by then (e.g. 20,40,60)"
    )
    ap.add_argument("--plot", default=None, help="PNG: every run's eval tau against minutes")
    a = ap.parse_args()
    dirs = run_dirs(a.runs)
    at = [float(m) for m in a.at.split(",") if m.strip()]
    runs = load_runs(dirs)
    text = table(dirs, at, runs)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.plot:
        keys = differing_keys([c for _, c, _ in runs])
        curves = [(label(d, c, keys), rows) for d, c, rows in runs]
        print(f"plot: {plot_curves(curves, a.plot)}")


if __name__ == "__main__":
    main()
