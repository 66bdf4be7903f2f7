"""wandb objects built from eval reports and checkpoints (imported only when wandb logs)."""

from __future__ import annotations

import os
import re

import numpy as np
import wandb

TABLE_COLUMNS = ["step", "prompt", "rounds", "streak", "tau", "matches"]


def eval_table(reports: list, step: int) -> wandb.Table:
    """One row per eval prompt: streak, tau, dds@b and the per-round match strings
    ('✓✓✗' = two drafted tokens accepted, then a miss)."""
    budgets = sorted(reports[0].trees) if reports else []
    table = wandb.Table(columns=TABLE_COLUMNS + [f"dds@{b}" for b in budgets])
    for r in reports:
        d = r.to_dict()
        table.add_data(
            step,
            str(d["prompt_id"]),
            d["num_rounds"],
            d["streak"],
            d["tau"],
            " ".join(d["matches"]),
            *[d.get(f"dds@{b}") for b in budgets],
        )
    return table


def acceptance_histogram(reports: list) -> wandb.Histogram:
    """Accepted drafted tokens per verify round, over all prompts: one bin per length 0..D."""
    accepted = [a for r in reports for a in r.chain.accepted]
    D = max((int(r.pos_totals.numel()) for r in reports), default=1)
    return wandb.Histogram(np_histogram=np.histogram(accepted, bins=np.arange(D + 2) - 0.5))


def checkpoint_artifact(run_name: str | None, path: str, step: int) -> wandb.Artifact:
    """The serving files of a checkpoint (no optimizer state) as a model artifact."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{run_name or 'dflash'}-drafter")
    art = wandb.Artifact(name, type="model", metadata={"step": step, "path": path})
    for f in ("config.json", "model.safetensors"):
        art.add_file(os.path.join(path, f), name=f)
    return art
