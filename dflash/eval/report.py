"""Eval reports for people: a per-prompt table, a summary, and JSON."""

from __future__ import annotations

import json
import math
import os
import re

from rich.console import Console
from rich.table import Table

from .speed import is_speed_key, speed_table


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def print_report(
    reports, summary: dict, budgets, show_rounds: int = 2, console: Console | None = None
) -> None:
    console = console or Console(width=160)
    t = Table(title="per prompt (greedy, exact offline simulation)")
    for col in [
        "prompt",
        "rounds",
        "streak",
        "tau",  # tau_t{T} is a summary figure only: rows carry no per-prompt value for it
        *[f"dds@{b}" for b in budgets],
        "first rounds",
    ]:
        t.add_column(col, justify="left" if col == "first rounds" else "right")
    for r in reports:
        d = r.to_dict()
        t.add_row(
            str(d["prompt_id"]),
            str(d["num_rounds"]),
            _fmt(d["streak"]),
            _fmt(d["tau"]),
            *[_fmt(d.get(f"dds@{b}", float("nan"))) for b in budgets],
            " ".join(d["matches"][:show_rounds]),
        )
    console.print(t)
    s = Table(title="summary (micro-average over rounds)")
    s.add_column("metric")
    s.add_column("value", justify="right")
    keys = [
        "num_prompts",
        "num_rounds",
        "streak",
        "tau",
        *sorted(k for k in summary if k.startswith("tau_t")),
        # the greedy decoding figures get their own table below
        *sorted(k for k in summary if k.startswith("decode_") and not is_speed_key(k)),
        *[f"dds@{b}" for b in budgets],
        *[f"tau@{b}" for b in budgets],
        *[k for k in summary if k.startswith("rule/") and "/tau@" in k],
        *sorted(
            (k for k in summary if k.startswith("acc_pos_")), key=lambda k: int(k.rsplit("_", 1)[1])
        ),
    ]
    for k in keys:
        if k in summary:
            s.add_row(label(k), _fmt(summary[k]))
    console.print(s)
    speed = speed_table(summary)
    if speed is not None:
        console.print(speed)


def label(key: str) -> str:
    """How a summary figure is named where it is shown: the offline figures at T > 0 bound the
    exact expected tau from above and below (dflash.decoding.rejection)."""
    m = re.fullmatch(r"(?:decode_offline_)?tau_t([0-9.e+-]+)(_lower)?", key)
    if m is None or float(m.group(1)) == 0:
        return key
    return f"{key} (lower bound)" if m.group(2) else f"{key} (upper estimate)"


def _finite(x):
    """NaN/inf (e.g. a budget with no rounds) -> null: strict JSON for any reader."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str, reports, summary: dict, meta: dict, sets: dict | None = None) -> None:
    """sets (eval.sets): name -> (reports, summary); the top-level summary then holds every
    set's figures as <set>/<figure>."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"meta": meta, "summary": summary, "prompts": [r.to_dict() for r in reports]}
    if sets:
        payload["sets"] = {
            n: {"summary": s, "prompts": [r.to_dict() for r in reps]}
            for n, (reps, s) in sets.items()
        }
    payload = _finite(payload)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str, allow_nan=False)
    os.replace(tmp, path)
