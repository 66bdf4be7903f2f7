"""Metric sinks behind one small interface: console, wandb, none. Every run also appends its
metrics to <run_dir>/metrics.jsonl, so plots never need wandb (`python -m dflash.tools.plot`)."""

from __future__ import annotations

import json
import os
import time
import uuid

from ..config import LoggerConfig


def progress_bars_off() -> bool:
    """DFLASH_NO_PROGRESS=1 turns every tqdm bar off (CI, the device scripts, log files)."""
    return os.environ.get("DFLASH_NO_PROGRESS") == "1"


class Logger:
    def __init__(self, run_dir: str | None, rank0: bool = True):
        self.rank0 = rank0
        self.jsonl = (
            open(os.path.join(run_dir, "metrics.jsonl"), "a") if run_dir and rank0 else None
        )
        self.t0 = time.time()

    def log(self, metrics: dict, step: int) -> None:
        if self.jsonl:
            self.jsonl.write(
                json.dumps({"step": step, "time": round(time.time() - self.t0, 3), **metrics})
                + "\n"
            )
            self.jsonl.flush()
        self._log(metrics, step)

    def _log(self, metrics: dict, step: int) -> None:
        pass

    def info(self, msg: str) -> None:
        if self.rank0:
            print(msg, flush=True)

    def summary(self, metrics: dict) -> None:
        pass

    def log_eval(self, reports: list, step: int, name: str = "") -> None:
        """Per-prompt eval reports (dflash.eval.metrics.PromptReport) of the eval at `step`, of
        the eval set `name` ("" for the one unnamed set)."""

    def log_checkpoint(self, path: str, step: int) -> None:
        """A checkpoint directory just written at `step`."""

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()


def eval_key(key: str) -> tuple[str | None, str] | None:
    """The one grammar of eval metric keys: eval/<metric> -> (None, metric) for the unnamed set,
    eval/<set>/<metric> -> (set, metric) for a named one (eval.sets); any other key -> None."""
    parts = key.split("/")
    if parts[0] != "eval" or len(parts) not in (2, 3):
        return None
    return (parts[1] if len(parts) == 3 else None, parts[-1])


class ConsoleLogger(Logger):
    KEYS = ("train/loss", "train/acc", "train/lr", "eval/streak", "eval/tau", "perf/tokens_per_s")

    def _log(self, metrics: dict, step: int) -> None:
        if not self.rank0:
            return
        parts = [f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in self.KEYS if k in metrics]
        # the named eval sets (eval.sets): eval/<set>/tau as <set>.tau
        named = {k: eval_key(k) for k in metrics}
        parts += [
            f"{e[0]}.{e[1]}={metrics[k]:.4g}"
            for k, e in named.items()
            if e is not None and e[0] is not None and e[1] in ("streak", "tau")
        ]
        if parts:
            print(f"step {step:>6d} | " + " ".join(parts), flush=True)


def _wandb_id(run_dir: str) -> str:
    """One wandb run per run directory: the id is kept in <run_dir>/wandb_id, so a resumed run
    continues the same wandb run (its charts go on from the checkpoint's step)."""
    path = os.path.join(run_dir, "wandb_id")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:12]  # wandb ids: [a-z0-9], unique per project
    with open(path + ".tmp", "w") as f:
        f.write(run_id + "\n")
    os.replace(path + ".tmp", path)
    return run_id


class WandbLogger(ConsoleLogger):
    """wandb as its users expect: the resolved config, metrics by namespace on a trainer/step
    axis, a per-prompt eval table and an acceptance-length histogram per eval, and (opt-in,
    logger.log_checkpoints) the serving checkpoints as model artifacts. The dashboard layout is
    docs/wandb_workspace.json (applied with `python -m dflash.tools.wandb_workspace`)."""

    NAMESPACES = ("train", "eval", "perf", "pipe", "data")

    @staticmethod
    def wandb_key(key: str) -> str:
        """A named eval set's figures get a panel section of their own: wandb groups panels by
        the first segment of a key, so eval/<set>/tau is logged as eval-<set>/tau."""
        parts = key.split("/")
        return (
            f"eval-{parts[1]}/{'/'.join(parts[2:])}"
            if parts[0] == "eval" and len(parts) > 2
            else key
        )

    def __init__(
        self, cfg: LoggerConfig, run_dir: str, run_name: str, config: dict, rank0: bool = True
    ):
        super().__init__(run_dir, rank0)
        self.run, self.log_checkpoints = None, cfg.log_checkpoints
        if not rank0:
            return
        import wandb

        mode = cfg.mode
        if mode == "auto":
            has_key = bool(os.environ.get("WANDB_API_KEY")) or os.path.exists(
                os.path.expanduser("~/.netrc")
            )
            mode = "online" if has_key else "offline"
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=run_name,
            id=_wandb_id(run_dir),
            dir=run_dir,
            config=config,
            mode=mode,
            tags=list(cfg.tags),
            resume="allow",
        )
        self.run.define_metric("trainer/step")
        for prefix in self.NAMESPACES:
            self.run.define_metric(f"{prefix}/*", step_metric="trainer/step")
        self.run.define_metric("eval-*", step_metric="trainer/step")
        self.info(
            f"wandb: {mode} run in {run_dir}/wandb"
            + (" (sync later: `wandb sync`)" if mode == "offline" else "")
        )

    def _log(self, metrics: dict, step: int) -> None:
        super()._log(metrics, step)
        if self.run is not None:
            self.run.log(
                {"trainer/step": step, **{self.wandb_key(k): v for k, v in metrics.items()}}
            )

    def log_eval(self, reports: list, step: int, name: str = "") -> None:
        if self.run is None or not reports:
            return
        from .wandb_media import acceptance_histogram, eval_table

        section = f"eval-{name}" if name else "eval"
        self.run.log(
            {
                "trainer/step": step,
                f"{section}/prompts": eval_table(reports, step),
                f"{section}/accepted_hist": acceptance_histogram(reports),
            }
        )

    def log_checkpoint(self, path: str, step: int) -> None:
        if self.run is None or not self.log_checkpoints:
            return
        from .wandb_media import checkpoint_artifact

        self.run.log_artifact(
            checkpoint_artifact(self.run.name, path, step), aliases=[f"step_{step}", "latest"]
        )

    def summary(self, metrics: dict) -> None:
        if self.run is not None:
            self.run.summary.update({self.wandb_key(k): v for k, v in metrics.items()})

    def close(self) -> None:
        super().close()
        if self.run is not None:
            self.run.finish()


def make_logger(
    cfg: LoggerConfig, run_dir: str, run_name: str, config: dict, rank0: bool = True
) -> Logger:
    if cfg.kind == "wandb":
        return WandbLogger(cfg, run_dir, run_name, config, rank0)
    if cfg.kind == "console":
        return ConsoleLogger(run_dir, rank0)
    return Logger(run_dir, rank0)
