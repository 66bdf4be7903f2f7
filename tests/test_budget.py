"""train.time_budget_min: the run ends on the clock, in time for its final eval and save; the lr
schedule follows the clock; a resumed budgeted run continues the clock and equals an
uninterrupted one (on a deterministic fake clock)."""

import functools
import json
import os
import re

import pytest
import torch

from dflash.tools.testing import rank_env
from dflash.train.budget import TimeBudget, budget_lr


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def test_budget_clock_reserve_progress_and_resume():
    c = Clock(100.0)
    b = TimeBudget(1.0, now=c)  # 60 s
    c.t += 10
    b.start_training()  # training starts 10 s into the run
    with b.timed("eval"):
        c.t += 8  # an eval of 8 s: 10 s kept for the final one
    assert b.reserve_s == pytest.approx(10.0)
    c.t = 100 + 30
    assert b.progress() == pytest.approx((30 - 10) / (60 - 10 - 10))
    assert not b.done()
    state = b.state_dict()
    c.t = 100 + 50
    assert b.done() and b.progress() == 1.0
    # a resumed process: its own clock starts anywhere; the checkpoint's 30 s carry on
    c2 = Clock(5000.0)
    r = TimeBudget(1.0, now=c2)
    r.load_state_dict(state)
    assert r.elapsed() == pytest.approx(30.0) and r.progress() == pytest.approx(0.5)
    c2.t += 20
    assert r.done()


def test_a_resume_with_another_budget_continues_the_schedule_without_a_jump():
    """`resume=RUN train.time_budget_min=25` on a 20-minute run: progress (and so the lr) goes on
    from where the checkpoint had it and reaches the end when the new budget runs out."""
    c = Clock(0.0)
    b = TimeBudget(20.0, now=c)
    b.start_training()
    c.t = 600.0  # half of the 20 minutes
    assert b.progress() == pytest.approx(0.5)
    state = b.state_dict()
    c2 = Clock(0.0)
    r = TimeBudget(25.0, now=c2)
    r.load_state_dict(state)
    assert r.progress() == pytest.approx(0.5)  # the old code read 600/1500 = 0.4: an lr jump
    c2.t = 450.0  # halfway through the 900 s the new budget leaves
    assert r.progress() == pytest.approx(0.75)
    c2.t = 900.0
    assert r.done()
    # saved again and resumed with the same budget: the same schedule
    c2.t = 450.0
    again = TimeBudget(25.0, now=Clock(0.0))
    again.load_state_dict(r.state_dict())
    assert again.progress() == pytest.approx(0.75)


def test_budget_lr_warms_up_then_decays_to_min():
    assert budget_lr(0.0, 0.1, 0.0) == pytest.approx(1e-3)
    assert budget_lr(0.05, 0.1, 0.0) == pytest.approx(0.5)
    assert budget_lr(0.1, 0.1, 0.0) == pytest.approx(1.0)
    assert budget_lr(0.55, 0.1, 0.0) == pytest.approx(0.5)
    assert budget_lr(1.0, 0.1, 0.2) == pytest.approx(0.2)
    xs = [budget_lr(p / 100, 0.1, 0.0) for p in range(10, 101)]
    assert all(a >= b for a, b in zip(xs, xs[1:]))


def _overrides(tmp_path) -> list[str]:
    return [
        "train.steps=1000",
        "train.time_budget_min=1",  # 60 s of fake time
        "train.warmup_ratio=0.1",
        "train.save_every=3",
        "train.eval_every=4",
        "train.log_every=1",
        "train.micro_batch_size=2",
        "train.max_anchors=6",
        "train.keep_last=10",
        "data.num_samples=8",
        "data.response_len=12",
        "eval.num_prompts=2",
        "eval.completion_len=8",
        "eval.budgets=[4]",
        "logger=console",
        f"out_root={tmp_path}",
        f"data.cache_dir={tmp_path}/cache",
    ]


def _cfg(tmp_path, resume=None, *more):
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from dflash.run.cli import setup, typed

    setup()
    over = _overrides(tmp_path)
    if resume:
        over.append(f"resume={resume}")
    over += list(more)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return typed(compose("config", overrides=over))


@pytest.fixture
def fake_time(monkeypatch):
    """Each train step takes 4 s and each eval 3 s of a fake clock; loading takes none."""
    import dflash.eval.offline as ev
    import dflash.train.step as tr

    clock = Clock()
    clock.first_step = 4.0  # a test sets the first step's length (it compiles on the GPU)
    monkeypatch.setattr(tr, "TimeBudget", functools.partial(TimeBudget, now=clock))
    step, run = tr.DrafterTrainer.step_async, ev.Evaluator.run

    def step_async(self, micro):  # a process's first step compiles: fresh or resumed
        first = not getattr(self, "_stepped", False)
        self._stepped = True
        clock.t += clock.first_step if first else 4.0
        return step(self, micro)

    def eval_run(self, drafter, heads):
        clock.t += 3.0
        return run(self, drafter, heads)

    monkeypatch.setattr(tr.DrafterTrainer, "step_async", step_async)
    monkeypatch.setattr(ev.Evaluator, "run", eval_run)
    return clock


def _rows(run_dir):
    return [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]


def _master(step_dir) -> dict:
    from dflash.common.layout import STATE_FILE

    return torch.load(os.path.join(step_dir, STATE_FILE), weights_only=False)


def test_budgeted_run_stops_on_the_clock_with_final_eval_save_and_plot(tmp_path, fake_time, capsys):
    from dflash.train.colocated import run_colocated

    run_dir = str(tmp_path / "full")
    out = run_colocated(_cfg(tmp_path), run_dir)
    last = int(os.path.basename(out["checkpoint"]).split("_")[1])
    # 3 s step-0 eval, 4 s steps, 3 s evals after steps 4 and 8; reserve: one step + 1.25 x 3 s.
    # After step 11 the run is 3 + 44 + 6 = 53 s old, past 60 - 7.75 s (after step 10: 49 s)
    assert last == 11, last
    assert fake_time.t <= 60.0  # the final eval fits in the budget
    rows = _rows(run_dir)
    assert any(r["step"] == last and "eval/tau" in r for r in rows)  # final eval
    # each eval row on the budget clock, taken before the eval: the curves of tools.compare
    evals = [(r["step"], r["time/run_min"] * 60) for r in rows if "eval/tau" in r]
    assert [s for s, _ in evals] == [0, 4, 8, last]
    assert [t for _, t in evals][1:3] == pytest.approx([3 + 16, 3 + 32 + 3])
    # the step's figures are read at log steps only, each with its timing and the interval's rate
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, last + 1))  # train.log_every=1
    for r in train_rows:
        assert r["perf/tokens_per_s"] > 0 and r["perf/target_s"] >= 0 and r["perf/drafter_s"] > 0
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]
    peak = max(lrs)
    assert lrs.index(peak) in range(1, 4) and lrs[-1] < 0.05 * peak  # warmup, then cosine
    assert os.path.isfile(os.path.join(run_dir, "metrics.png"))
    log = capsys.readouterr().out  # train.log when run by train.py
    phases = (
        r"start and target load \d+ s, data \d+ s, trainer and eval set \d+ s, step-0 eval \d+ s"
    )
    assert re.search(r"min spent before training \(" + phases + r"\)", log), log
    # 2 samples a step, 11 steps: 22 reads of the 8 samples; said once, early, without the hint
    (line,) = [x for x in log.splitlines() if "at this pace" in x]
    end = float(re.search(r"reads each of its 8 samples ~\d+ times \(([\d.]+) epochs", line)[1])
    assert 2.0 <= end <= 3.5 and "data.num_samples" not in line, line
    state = _master(out["checkpoint"])["trainer"]["budget"]
    assert 50 < state["elapsed_s"] <= 60


def test_the_first_steps_compile_is_neither_warmup_nor_a_steps_length(tmp_path, fake_time, capsys):
    """The first step compiles (~30 s on the GPU recipes). Counted in the training window, it
    used up a 20-minute run's warmup (the second step ran at the peak lr); kept as the longest
    step, it held 30 s of the budget back for one more step at the end."""
    from dflash.train.colocated import run_colocated

    fake_time.first_step = 30.0
    cfg = _cfg(tmp_path, None, "train.time_budget_min=2")  # 120 s; warmup: 10 % of the window
    out = run_colocated(cfg, str(tmp_path / "run"))
    rows = _rows(str(tmp_path / "run"))
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]
    peak = max(lrs)
    # steps 1 and 2 at the warmup's start (2: set right after the compile), then a ramp to the peak
    assert lrs[0] < 0.01 * peak and lrs[1] < 0.01 * peak, lrs[:4]
    assert 0.2 * peak < lrs[2] < 0.9 * peak and lrs.index(peak) >= 3, lrs[:6]
    state = _master(out["checkpoint"])["trainer"]["budget"]
    # the reserve holds one 4 s step, 1.25 x the 3 s eval: the run goes on past 108 s (the 30 s
    # step kept as the longest stopped it before 90 s)
    assert 108 < state["elapsed_s"] <= 120, state
    assert state["longest"]["step"] == 4.0
    # train.log says so: 120 s - 33 s (step-0 eval, step 1) - 3.75 s (one more eval) = 83 s
    assert (
        "1.4 min of training from here; the lr warms up over the first 8 s"
        in capsys.readouterr().out
    )


def test_budgeted_resume_continues_the_clock_and_equals_uninterrupted(tmp_path, fake_time):
    from dflash.train.colocated import run_colocated

    full = run_colocated(_cfg(tmp_path), str(tmp_path / "full"))
    fake_time.t = 0.0
    run_colocated(_cfg(tmp_path), str(tmp_path / "part"), stop_at=6)
    fake_time.t = 1000.0  # the resumed process's clock starts elsewhere
    ckpt = str(tmp_path / "part" / "checkpoints" / "step_00000006")
    cont = run_colocated(_cfg(tmp_path, resume=ckpt), str(tmp_path / "part"))
    assert os.path.basename(cont["checkpoint"]) == os.path.basename(full["checkpoint"])
    a = _master(full["checkpoint"])["drafter_fp32"]
    b = _master(cont["checkpoint"])["drafter_fp32"]
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-7), k
    c = _master(ckpt)["drafter_fp32"]
    assert not torch.allclose(c["fc.weight"], a["fc.weight"])


def test_a_resumed_runs_compile_does_not_move_its_schedule(tmp_path, fake_time):
    """The resumed process compiles again in its first step (30 s here, 4 s a step): the learning
    rate after it is the uninterrupted run's, as if that step had taken 4 s (counted as such, 30 s
    moved the schedule by 26 s at once)."""
    from dflash.train.colocated import run_colocated

    two = "train.time_budget_min=2"
    run_colocated(_cfg(tmp_path, None, two), str(tmp_path / "full"))
    fake_time.t = 0.0
    run_colocated(_cfg(tmp_path, None, two), str(tmp_path / "part"), stop_at=6)
    fake_time.t, fake_time.first_step = 1000.0, 30.0
    ckpt = str(tmp_path / "part" / "checkpoints" / "step_00000006")
    cont = run_colocated(_cfg(tmp_path, ckpt, two), str(tmp_path / "part"))
    lr = {
        k: {r["step"]: r["train/lr"] for r in _rows(str(tmp_path / k)) if "train/lr" in r}
        for k in ("full", "part")
    }
    assert lr["part"][8] == pytest.approx(lr["full"][8], rel=1e-6), (lr["part"], lr["full"])
    assert lr["part"][9] < lr["full"][9]  # the rest spreads over the 26 s less the budget leaves
    state = _master(cont["checkpoint"])["trainer"]["budget"]
    assert state["longest"]["step"] == 4.0 and state["elapsed_s"] <= 120.0


def test_budget_with_split_topology_is_refused_before_anything_runs():
    from dflash.config import RunConfig, TopologyConfig, TrainConfig
    from dflash.run.preflight import check_dist

    cfg = RunConfig(train=TrainConfig(time_budget_min=5), topology=TopologyConfig(mode="split"))
    with pytest.raises(ValueError, match="time_budget_min.*split"):
        check_dist(cfg)
    with pytest.raises(ValueError, match="must be > 0"):
        TrainConfig(time_budget_min=0).validate()


def _agree_rank(rank, port, out_dir):
    import torch.distributed as dist

    from dflash.common.interrupt import agree_max

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # rank 1's clock ran out; nobody pressed Ctrl-C; rank 0 alone was interrupted afterwards
    # a gloo group keeps the flags on the host whatever the trainer's device (the loop passes
    # the gloo control group so that the agreement never waits for a CUDA stream): "meta"
    # stands in for cuda here and would fail in the all-reduce if the flags went there
    got = [
        agree_max([float(rank == 1), 0.0], dist.group.WORLD),
        agree_max([0.0, float(rank == 0)], dist.group.WORLD, torch.device("meta")),
        agree_max([0.25 + 0.5 * rank], dist.group.WORLD),  # each rank's budget progress
    ]
    torch.save(got, os.path.join(out_dir, f"agree{rank}.pt"))
    dist.destroy_process_group()


def test_ranks_stop_together_when_any_rank_runs_out_of_time_or_is_interrupted(tmp_path):
    """One all-reduce per step carries both flags and the budget's progress: every rank sees a
    flag if any rank has it, and the furthest progress."""
    import torch.multiprocessing as mp

    from dflash.tools.testing import free_port

    mp.spawn(_agree_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"agree{rank}.pt") == [[1.0, 0.0], [0.0, 1.0], [0.75]]


def test_startup_phases_count_from_the_previous_phase_and_restart_with_each_run(monkeypatch):
    import dflash.train.budget as b

    t = [1000.0]
    monkeypatch.setattr(b.time, "monotonic", lambda: t[0])
    monkeypatch.setattr(b, "_PHASES", [("", 0.0)])  # an earlier run: this one counts from now
    b.start_phases()
    t[0] += 12.4
    b.phase_done("target")
    t[0] += 100.0
    b.phase_done("data")
    assert b.startup_phases() == "target 12 s, data 100 s"
    b.start_phases()  # the next run of a multirun forgets the last one's phases
    t[0] += 5.0
    b.phase_done("target")
    assert b.startup_phases() == "target 5 s"


def test_resuming_a_run_that_spent_its_budget_says_so_and_writes_nothing(
    tmp_path, fake_time, capsys
):
    """Only `step >= train.steps` used to mark a finished run: a budgeted one trained another step
    (a new step dir, the final eval again, more metric rows). Its last checkpoint records that
    the budget ended it; a resume with the same budget has nothing to do."""
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from dflash.run.launcher import launch
    from dflash.train.colocated import run_colocated

    cfg = _cfg(tmp_path)
    out = run_colocated(cfg, str(tmp_path / "b"))
    assert os.path.basename(out["checkpoint"]) == "step_00000011"
    before = _tree(tmp_path)
    over = [*_overrides(tmp_path), "run_name=b", "resume=true"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        launch(compose("config", overrides=over))
    said = capsys.readouterr().out
    assert "is finished: its time budget (train.time_budget_min=1) ran out at step 11" in said
    assert "drafter.init_from=" in said
    assert _tree(tmp_path) == before


def _tree(root) -> list:
    """Every directory and file name under root, and the metrics rows."""
    return sorted(
        (
            d,
            sorted(names),
            open(os.path.join(d, "metrics.jsonl")).read() if "metrics.jsonl" in names else "",
        )
        for d, _, names in os.walk(root)
    )


def _dp_budget_rank(rank, world, port, root):
    """A budgeted 2-rank DDP run whose ranks' clocks disagree (rank 1's steps take 4.5 s, its
    process started 2 s later): each rank's learning rates and final weights."""
    import dflash.eval.offline as ev
    import dflash.train.step as tr
    from dflash.common.comm import init_distributed
    from dflash.train.colocated import run_colocated

    rank_env(rank, world, port, DFLASH_RUN_ID="budget")
    clock, lrs, trainer = Clock(-2.0 * rank), [], []
    tr.TimeBudget = functools.partial(TimeBudget, now=clock)
    step, run = tr.DrafterTrainer.step_async, ev.Evaluator.run

    def step_async(self, micro):
        trainer[:] = [self]
        lrs.append(self.par.base_optimizer.param_groups[0]["lr"])
        clock.t += 4.0 + 0.5 * rank
        return step(self, micro)

    def eval_run(self, drafter, heads):
        clock.t += 3.0
        return run(self, drafter, heads)

    tr.DrafterTrainer.step_async, ev.Evaluator.run = step_async, eval_run
    ctx = init_distributed("gloo", 120, 120)
    run_colocated(_cfg(root, None, "train.dist=ddp"), os.path.join(root, "run"), ctx=ctx)
    weights = {k: v.detach().clone() for k, v in trainer[0].drafter_for_io().state_dict().items()}
    torch.save({"lrs": lrs, "weights": weights}, os.path.join(root, f"rank{rank}.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_data_parallel_ranks_follow_one_budget_clock(tmp_path):
    """Each rank's own clock gave each replica its own learning rate, so DDP's replicas drifted
    apart; the loop now agrees the furthest progress after each step and every rank sets its
    learning rate from it."""
    import torch.multiprocessing as mp

    from dflash.tools.testing import free_port

    mp.spawn(_dp_budget_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(r0["lrs"]) == len(r1["lrs"]) > 5
    assert r0["lrs"] == r1["lrs"] and max(r0["lrs"]) > 10 * r0["lrs"][-1]  # warmup and decay
    for k, v in r0["weights"].items():
        assert torch.equal(v, r1["weights"][k]), k


def test_the_window_line_when_the_first_step_spent_the_budget():
    c = Clock(0.0)
    b = TimeBudget(1.0, now=c)
    c.t = 70.0  # loading and the first step took more than the 60 s
    b.start_training()
    assert b.window_line(0.04) == "time budget: spent by the first step; the run ends with it"
    assert b.done()


def test_the_epoch_forecast_is_said_once_and_names_the_fix_past_15_epochs():
    """EpochForecast: once 5 % of the window has run since its first look, the epochs the whole
    budget will read at this pace (from where this process started: a resumed run's too); past
    15 it names more distinct prompts as the better use of the budget."""
    from dflash.train.budget import EpochForecast

    f = EpochForecast()
    assert f.update(0.0, 0.0, 1000) is None and f.update(0.04, 1.0, 1000) is None
    line = f.update(0.05, 1.25, 1000)  # 25 epochs a window
    assert "each of its 1,000 samples ~25 times (25.0 epochs by the end)" in line
    assert "more distinct prompts (data.num_samples)" in line
    assert f.update(0.5, 12.0, 1000) is None  # once
    resumed = EpochForecast()  # a resume at half the window, 10 epochs read
    assert resumed.update(0.5, 10.0, 1000) is None
    line = resumed.update(0.6, 10.5, 1000)  # 5 epochs a window from here: 12.5 at the end
    assert "(12.5 epochs by the end)" in line and "data.num_samples" not in line
