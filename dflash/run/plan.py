"""Which run directory a training run writes to, and what `resume` continues.

A run is identified by its directory `<out_root>/<run_name>` and by what `run_config.json` there
records (`exp_name` included). `resume=true` continues, in its own directory (so the data and eval
caches and `metrics.jsonl` are the run's own): the run named by `run_name`; without a run name,
the newest run whose recorded `exp_name` equals this one (a field comparison, not a name prefix).
`resume=PATH` continues the run that PATH (a run or step directory) belongs to, unless `run_name`
names another directory to continue it in. A resumed run must train on the same data and the same
model: a changed key that would alter them is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
from dataclasses import dataclass

from ..common.interrupt import Interrupted, signal_name, stop_signal
from ..common.layout import (
    TARGET_DTYPE,
    _checkpoint_or_none,
    checkpoint_step,
    ended_at,
    find_checkpoint,
    is_off,
    newest_run_of,
    read_run_config,
    run_dir_of,
)
from ..config import TARGET_EXECUTION_ONLY, TARGET_RESUMABLE, RunConfig

# Keys a resumed run may change: where and how it runs, logs, evaluates and saves. Everything
# else (data.*, target.*, drafter.*, the loss, the anchors, the seeds, the schedule and the
# optimizer) defines the data or the model of the run and must stay as the run started.
SAFE_KEYS = (
    "exp_name",
    "run_name",
    "out_root",
    "resume",
    "ckpt",
    "out",
    "logger.",
    "eval.",
    "topology.",
    "data.cache_dir",
    "drafter.init_from",  # the checkpoint's weights replace it
    "target.device",
    # how the training capture runs (compiled layers, CUDA graphs, packing, the memory check):
    # neither the data nor the eval sets depend on it (dflash.config.TARGET_EXECUTION_ONLY)
    *(f"target.{k}" for k in TARGET_EXECUTION_ONLY),
    # the kernels: they name the caches, but the resumed run reads the data it trained on
    *(f"target.{k}" for k in TARGET_RESUMABLE),
    "train.dtype",
    "train.lm_head_chunk",
    "train.attn_kernel",
    "train.compile",
    "train.allow_soft_loss",
    "train.log_every",
    "train.eval_every",
    "train.save_every",
    "train.keep_last",
    "train.keep_best",  # which drafter to keep aside; a kept best for another figure is removed
    # the sample order is by absolute position: another layout may cut it into steps differently
    "train.micro_batch_size",
    "train.grad_accum",
    # the schedule goes on from the fraction reached, over what the new budget leaves (budget.py)
    "train.time_budget_min",
)
SCHEDULE_KEYS = ("train.steps", "train.lr", "train.min_lr_ratio", "train.warmup_ratio")


class RunFinished(Exception):
    """resume of a run whose checkpoint ended it (train.steps, or its time budget spent):
    nothing to do (exit 0)."""


@dataclass
class RunPlan:
    run_dir: str
    ckpt: str | None  # the step directory to continue from; None: a fresh run
    step: int = 0


def plan_run(cfg: RunConfig, run_dir: str, named: bool) -> RunPlan:
    """run_dir: the directory this run would write to if it were new (`<out_root>/<run_name>`);
    named: run_name was given (not the default `<exp_name>-<run id>`), so it names a run."""
    if is_off(cfg.resume):
        ck = _checkpoint_or_none(run_dir)
        if ck:
            raise ValueError(
                f"run dir {run_dir} already has a checkpoint ({os.path.basename(ck)}): pass "
                "resume=true to continue it, or another run_name for a new run"
            )
        return RunPlan(run_dir, None)
    if str(cfg.resume).lower() == "true":
        own = _checkpoint_or_none(run_dir)
        if named or own:  # the same run id again (torchrun --rdzv-id) names the run too
            if not own:
                raise FileNotFoundError(
                    f"resume=true: run {run_dir} has no checkpoint to continue (run_name="
                    f"{os.path.basename(run_dir)}); run without resume to start it"
                )
            ck = own
        else:
            ck = newest_run_of(cfg.out_root, cfg.exp_name)
            run_dir = run_dir_of(ck)
    else:
        ck = find_checkpoint(str(cfg.resume))
        if not named:
            run_dir = run_dir_of(ck) or run_dir
    plan = RunPlan(os.path.normpath(run_dir), ck, checkpoint_step(ck))
    check_same_run(cfg, read_run_config(run_dir_of(ck)), ck, run_dir_of(ck))
    if plan.step >= cfg.train.steps:
        raise RunFinished(
            f"run {plan.run_dir} is finished: its checkpoint {ck} is at step {plan.step} "
            f"(train.steps={cfg.train.steps}); nothing to do. To train it further start a new "
            f"run from it: drafter.init_from={ck} (a new schedule; raising train.steps here "
            "would jump the cosine learning rate)"
        )
    ran = ended_at(ck)
    if ran.get("ended") == "budget" and (cfg.train.time_budget_min or 0) <= ran["time_budget_min"]:
        raise RunFinished(
            f"run {plan.run_dir} is finished: its time budget (train.time_budget_min="
            f"{ran['time_budget_min']:g}) ran out at step {plan.step} ({ck}); nothing to do. To "
            f"train it further start a new run from it: drafter.init_from={ck}"
        )
    return plan


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix + k).startswith("target.config"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_KEYS)


RESUME_FILE = "resume_command"  # the run's resume command line, written by the launcher


def override_key(token: str) -> str | None:
    """The key a command-line override sets (`+exp=x` -> exp), None for a flag such as -m."""
    if token.startswith("-") or ("=" not in token and not token.startswith("~")):
        return None
    return token.lstrip("+~").split("=", 1)[0]


def with_run_overrides(argv: list[str], default_out_root: str = "outputs") -> tuple[list, list]:
    """`train.py resume=RUN_DIR` (or a checkpoint of the run, or `resume=true run_name=NAME`)
    continues the run with the overrides it was started with: those of RUN_DIR/resume_command
    that this command line does not set again come first, so `resume=RUN_DIR` alone composes
    the run's own config (and a key given again, e.g. a longer budget, wins). Returns the
    command line to compose and the overrides taken from the run ([] when there are none)."""
    given = {k: t for t in argv if (k := override_key(t)) is not None}
    resume = given.get("resume", "resume=").split("=", 1)[1]
    if resume.lower() in ("", "false", "none", "null"):
        return argv, []
    if resume.lower() == "true":
        if "run_name" not in given:
            return argv, []
        out_root = given.get("out_root", f"out_root={default_out_root}").split("=", 1)[1]
        run_dir = os.path.join(out_root, given["run_name"].split("=", 1)[1])
    else:
        path = resume.rstrip("/")
        run_dir = path if os.path.isfile(os.path.join(path, RESUME_FILE)) else run_dir_of(path)
    own = os.path.join(run_dir or "", RESUME_FILE)
    if not run_dir or not os.path.isfile(own):
        return argv, []
    with open(own) as f:
        tokens = shlex.split(f.read())
    start = next((i + 1 for i, t in enumerate(tokens) if t.endswith("train.py")), len(tokens))
    restored = [
        t
        for t in tokens[start:]
        if (k := override_key(t)) is not None and k not in given and k not in ("resume", "run_name")
    ]
    return restored + list(argv), restored


def check_same_run(
    cfg: RunConfig, saved: dict | None, ckpt: str, run_dir: str | None = None
) -> None:
    """Refuse to continue a run on other data or another model than it started with; the
    message quotes the run's own resume command when the run dir has one."""
    if saved is None:
        return  # a step directory outside a run: only the drafter's config can be checked
    now = _flat(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
    old = _flat(saved)
    budget = "train.time_budget_min"
    if budget in old and (now[budget] is None) != (old[budget] is None):
        raise ValueError(
            f"resume: {budget} changed ({old[budget]!r} -> {now[budget]!r}) since the run "
            "started; a budgeted run's schedule follows the clock and a step-counted one the "
            f"steps, so one cannot continue as the other; set {budget}="
            f"{'null' if old[budget] is None else old[budget]} (another value is fine), or start "
            f"a new run from the checkpoint with drafter.init_from={ckpt}"
        )
    # target.dtype as resolved is checked below where the run recorded it (auto -> float32 on a
    # CPU is the same run as float32)
    resolved = {"target.dtype"} if saved.get(TARGET_DTYPE) else set()
    for key in sorted(now):
        if key in old and not _safe(key) and key not in resolved and now[key] != old[key]:
            how = (
                f"a new schedule: start a new run from the checkpoint with drafter.init_from={ckpt}"
                if key in SCHEDULE_KEYS
                else "set it back, or start a new run (another run_name, without resume)"
            )
            own = os.path.join(run_dir or "", RESUME_FILE)
            if key not in SCHEDULE_KEYS and run_dir and os.path.isfile(own):
                with open(own) as f:
                    how += f"; this run resumes with: {f.read().strip()}"
            if key == "target.path" and old[key] and now[key]:  # the weights moved, most often
                how = (
                    f"if the same weights now lie at {now[key]}, link them at the old path "
                    f"(ln -s {now[key]} {old[key]}) and resume without target.path (the path "
                    "keys the run's data cache); else " + how
                )
            what = "schedule" if key in SCHEDULE_KEYS else "data or model"
            raise ValueError(
                f"resume: {key} changed ({old[key]!r} -> {now[key]!r}) since the run started; it "
                f"would change the {what} of the run being continued; {how}"
            )
    _check_resolved_dtype(cfg, saved, ckpt)


def _check_resolved_dtype(cfg: RunConfig, saved: dict, ckpt: str) -> None:
    """target.dtype=auto resolves per machine (float32 on a CPU, bfloat16 on CUDA): a run begun on
    one and resumed on the other would capture its states and label its data in another dtype,
    which an explicit target.dtype change is refused for. run_config.json records what it ran as."""
    from ..target.load import concrete_settings

    then = saved.get(TARGET_DTYPE)
    here = concrete_settings(cfg.target)["dtype"]
    if then and here != then:
        raise ValueError(
            f"resume: target.dtype={cfg.target.dtype} is {here} on this machine but the run "
            f"started in {then} (its data and captured states); set target.dtype={then} to "
            f"continue it as it began, or start a new run from the checkpoint with "
            f"drafter.init_from={ckpt}"
        )


class ResumeCommand:
    """The one line printed on Ctrl-C: `resume=RUN_DIR` continues in the same run directory
    (RUN_DIR resolves to its latest checkpoint)."""

    def __init__(self, overrides: list[str], cfg: RunConfig, run_dir: str, world: int):
        drop = ("resume", "run_name")
        keep = [o for o in overrides if override_key(o) not in drop]
        prog = "python train.py" if world == 1 else f"torchrun --nproc-per-node {world} train.py"
        self.fresh = " ".join([prog, *map(shlex.quote, keep)])
        # resume=RUN_DIR alone continues in that directory (rundir.plan_run); a run_name here
        # would name a directory to continue in instead
        self.resume = " ".join([self.fresh, shlex.quote(f"resume={run_dir}")])
        self.run_dir = run_dir

    def save(self) -> None:
        """RUN_DIR/resume_command: what a resume that changes a key of the run points to."""
        path = os.path.join(self.run_dir, RESUME_FILE)
        with open(path + ".tmp", "w") as f:
            f.write(self.resume + "\n")
        os.replace(path + ".tmp", path)

    def line(self, e: Interrupted | None) -> str:
        signum = e.signum if e is not None else stop_signal()
        how = (
            "interrupted"
            if signum in (None, signal.SIGINT)
            else f"stopped by {signal_name(signum)}"
        )
        if e is None:
            return f"{how} before training started (nothing saved); start again with: {self.fresh}"
        if e.checkpoint is None and not os.path.isdir(os.path.join(self.run_dir, "checkpoints")):
            return f"{how} at step {e.step} (nothing saved: train.save_on_interrupt=false); start again with: {self.fresh}"
        return f"{how} at step {e.step}; resume with: {self.resume}"
