"""Resume semantics: which run `resume` continues, in which directory, on which config."""

import json
import os

import pytest
from conftest import CONF, make_drafter

from dflash.common.layout import write_run_config
from dflash.train.resume import save_checkpoint

FAST = [
    "train.save_every=3",
    "train.eval_every=1000",
    "train.log_every=1",
    "train.micro_batch_size=2",
    "train.max_anchors=6",
    "data.num_samples=8",
    "data.response_len=12",
    "eval.enabled=false",
    "logger=console",
]


def compose(out_root, *over):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from dflash.run.cli import setup

    setup()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hcompose("config", overrides=[f"out_root={out_root}", *FAST, *over])


def typed(out_root, *over):
    from dflash.run.cli import typed as to_typed

    return to_typed(compose(out_root, *over))


def fake_run(tiny_qwen, run_dir, step, *over, out_root=None):
    """A run directory as training leaves it: run_config.json and a checkpoint at `step`."""
    cfg = typed(out_root or os.path.dirname(run_dir), *over)
    save_checkpoint(str(run_dir), step, make_drafter(tiny_qwen), {})
    write_run_config(cfg, str(run_dir))
    return cfg


def test_resume_true_picks_exactly_this_experiment(tiny_qwen, tmp_path):
    """exp_name=a resumes a run of experiment `a`, never a newer `a-lr3-*` run whose directory
    merely starts with `a-` (a name prefix is not an experiment)."""
    from dflash.run.plan import plan_run

    fake_run(tiny_qwen, tmp_path / "a-20260101", 2, "exp_name=a", "train.steps=10")
    fake_run(tiny_qwen, tmp_path / "a-lr3-20270101", 5, "exp_name=a-lr3", "train.steps=10")  # newer
    os.utime(tmp_path / "a-20260101" / "checkpoints" / "step_00000002", (1, 1))
    cfg = typed(tmp_path, "exp_name=a", "resume=true", "train.steps=10")
    plan = plan_run(cfg, str(tmp_path / "a-now"), named=False)
    assert plan.run_dir == str(tmp_path / "a-20260101") and plan.step == 2
    assert plan.ckpt.endswith(os.path.join("a-20260101", "checkpoints", "step_00000002"))
    # and the `a-lr3` experiment resumes its own run
    cfg = typed(tmp_path, "exp_name=a-lr3", "resume=true", "train.steps=10")
    assert plan_run(cfg, str(tmp_path / "x"), named=False).run_dir == str(
        tmp_path / "a-lr3-20270101"
    )
    # no run of the experiment: an error naming it, not another experiment's run
    cfg = typed(tmp_path, "exp_name=b", "resume=true", "train.steps=10")
    with pytest.raises(FileNotFoundError, match="exp_name=b"):
        plan_run(cfg, str(tmp_path / "b-now"), named=False)


def test_run_name_resumes_that_run_in_its_dir_reusing_caches_and_metrics(tmp_path, capsys):
    """resume=true run_name=r continues run r in <out_root>/r: the data cache there is read (not
    regenerated), metrics.jsonl continues with no row twice, nothing else is written."""
    from dflash.run.launcher import launch
    from dflash.train.colocated import run_colocated

    run_dir = tmp_path / "r"
    # an interrupted run: checkpoint at step 3, metric rows logged up to step 4
    run_colocated(typed(tmp_path, "run_name=r", "train.steps=6"), str(run_dir), stop_at=4)
    assert "regenerating" in capsys.readouterr().out
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    other = compose(tmp_path, "run_name=r", "train.steps=6", "resume=true", "train.log_every=2")
    launch(other)
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 3" in out
    assert "from cache" in out and "regenerating" not in out
    steps = [json.loads(x)["step"] for x in open(run_dir / "metrics.jsonl")]
    train_steps = [json.loads(x)["step"] for x in open(run_dir / "metrics.jsonl") if "loss" in x]
    assert train_steps == [1, 2, 3, 4, 6] and steps == sorted(steps)
    assert sorted(os.listdir(run_dir / "checkpoints")) == [
        "latest",
        "step_00000003",
        "step_00000006",
    ]
    assert sorted(os.listdir(tmp_path)) == ["r"]


def test_a_run_dir_moved_elsewhere_resumes_where_it_now_is(tmp_path, capsys):
    """A run directory copied to another machine or path (a preempted job restarted elsewhere;
    the device relay, scripts/device/README.md) resumes in its new place: its cache is read there,
    its checkpoints and metrics go on there, and nothing is written under the old out_root. Its
    eval sets' cache, left out, is rebuilt."""
    from dflash.run.launcher import launch
    from dflash.train.colocated import run_colocated

    old = tmp_path / "old"
    ev = ["eval.enabled=true", "eval.num_prompts=2", "eval.completion_len=8"]
    run_colocated(typed(old, "run_name=r", "train.steps=6", *ev), str(old / "r"), stop_at=4)
    new = tmp_path / "elsewhere" / "moved"
    new.parent.mkdir()
    os.rename(old / "r", new)
    # the relay's pack leaves out the eval sets' cache (scripts/device/pack_run.sh): rebuilt
    evals = sorted(f for f in os.listdir(new / "data") if f.startswith("eval-"))
    assert evals
    for f in evals:
        os.remove(new / "data" / f)
    capsys.readouterr()
    # what `train.py resume=NEW` composes: the run's own overrides (out_root=OLD) + resume
    launch(compose(old, "train.steps=6", *ev, f"resume={new}"))
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 3" in out and "from cache" in out
    assert "eval: 2 prompts" in out and "built in" in out
    assert sorted(f for f in os.listdir(new / "data") if f.startswith("eval-")) == evals
    assert sorted(os.listdir(new / "checkpoints")) == ["latest", "step_00000003", "step_00000006"]
    assert [json.loads(x)["step"] for x in open(new / "metrics.jsonl") if "loss" in x][-1] == 6
    assert os.listdir(old) == []


def test_keep_best_may_change_at_resume_but_must_name_a_set_of_the_eval(tmp_path, capsys):
    """train.keep_best is checked against the eval's sets when the loop starts, a resume too
    (eval.sets may change there): a figure of no set stops it before any training. Another
    figure is fine: the best kept for the old one is removed, with a line."""
    from dflash.run.launcher import launch
    from dflash.train.colocated import run_colocated

    run_dir = tmp_path / "r"
    ev = ["eval.enabled=true", "train.eval_every=2", "train.save_every=2", "train.steps=6"]
    run_colocated(
        typed(tmp_path, "run_name=r", *ev, "train.keep_best=eval/tau"), str(run_dir), stop_at=4
    )
    kept = json.load(open(run_dir / "checkpoints" / "best" / "manifest.json"))["run"]
    assert kept["best_metric"] == "eval/tau" and kept["step"] in (2, 4)
    rows = open(run_dir / "metrics.jsonl").read()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        launch(compose(tmp_path, "run_name=r", *ev, "resume=true", "train.keep_best=eval/x/tau"))
    assert "train.keep_best='eval/x/tau' names no set of this run's eval" in capsys.readouterr().err
    assert open(run_dir / "metrics.jsonl").read() == rows  # not one step trained
    capsys.readouterr()
    launch(compose(tmp_path, "run_name=r", *ev, "resume=true", "train.keep_best=eval/tau@4"))
    assert "best: removed " in capsys.readouterr().out
    kept = json.load(open(run_dir / "checkpoints" / "best" / "manifest.json"))["run"]
    assert kept["best_metric"] == "eval/tau@4" and kept["step"] == 6


def test_resume_true_without_run_name_continues_in_the_runs_own_dir(tiny_qwen, tmp_path):
    """The newest run of this experiment is continued in its own dir; no new dir is made."""
    import dflash.run.launcher as launch_mod

    fake_run(tiny_qwen, tmp_path / "e-1", 2, "exp_name=e", "train.steps=9")
    got = {}

    def fake_run_colocated(cfg, run_dir):
        got.update(cfg=cfg, run_dir=run_dir)

    launch_mod.run_colocated, real = fake_run_colocated, launch_mod.run_colocated
    try:
        launch_mod.launch(compose(tmp_path, "exp_name=e", "resume=true", "train.steps=9"))
    finally:
        launch_mod.run_colocated = real
    assert got["run_dir"] == str(tmp_path / "e-1")
    assert got["cfg"].resume.endswith(os.path.join("e-1", "checkpoints", "step_00000002"))
    assert sorted(os.listdir(tmp_path)) == ["e-1"]


@pytest.mark.parametrize(
    "key,new",
    [("data.num_samples", "16"), ("drafter.block_size", "4"), ("train.max_anchors", "7")],
)
def test_resume_refuses_a_change_of_data_or_model(tiny_qwen, tmp_path, capsys, key, new):
    from dflash.run.launcher import launch

    fake_run(tiny_qwen, tmp_path / "r", 2, "run_name=r", "train.steps=10")
    cfg = compose(tmp_path, "run_name=r", "train.steps=10", "resume=true", f"{key}={new}")
    with pytest.raises(SystemExit) as e:
        launch(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"resume: {key} changed" in err and f"-> {new}" in err and "new run" in err
    assert "Traceback" not in err


def test_resume_allows_logging_and_eval_changes(tiny_qwen, tmp_path):
    from dflash.run.plan import plan_run

    fake_run(tiny_qwen, tmp_path / "r", 2, "run_name=r", "train.steps=10")
    cfg = typed(tmp_path, "run_name=r", "train.steps=10", "resume=true", "train.eval_every=7")
    cfg.logger.kind, cfg.eval.num_prompts = "none", 3
    assert plan_run(cfg, str(tmp_path / "r"), named=True).step == 2


def test_resume_may_change_the_time_budget_but_not_add_or_drop_it(tiny_qwen, tmp_path):
    """The README's `resume=outputs/NAME train.time_budget_min=25` on a budgeted run."""
    from dflash.run.plan import plan_run

    fake_run(tiny_qwen, tmp_path / "r", 2, "run_name=r", "train.time_budget_min=20")
    cfg = typed(tmp_path, "run_name=r", "resume=true", "train.time_budget_min=25")
    assert plan_run(cfg, str(tmp_path / "r"), named=True).step == 2
    cfg = typed(tmp_path, "run_name=r", "resume=true")  # the budget dropped: steps would rule
    with pytest.raises(ValueError, match="train.time_budget_min changed .20.0 -> None"):
        plan_run(cfg, str(tmp_path / "r"), named=True)


def test_resume_of_a_finished_run_says_so_and_writes_nothing(tiny_qwen, tmp_path, capsys):
    from dflash.run.launcher import launch

    fake_run(tiny_qwen, tmp_path / "f-1", 10, "exp_name=f", "train.steps=10")
    before = sorted(os.walk(tmp_path))
    launch(compose(tmp_path, "exp_name=f", "train.steps=10", "resume=true"))
    out = capsys.readouterr().out
    assert "is finished" in out and "step 10" in out and "drafter.init_from=" in out
    assert sorted(os.walk(tmp_path)) == before
    # a longer schedule is refused with the way to get one
    with pytest.raises(SystemExit):
        launch(compose(tmp_path, "exp_name=f", "train.steps=20", "resume=true"))
    err = capsys.readouterr().err
    assert "train.steps changed (10 -> 20)" in err and "drafter.init_from=" in err


def test_new_run_into_a_dir_with_checkpoints_is_refused(tiny_qwen, tmp_path):
    from dflash.run.plan import plan_run

    fake_run(tiny_qwen, tmp_path / "r", 2, "run_name=r")
    with pytest.raises(ValueError, match="resume=true"):
        plan_run(typed(tmp_path, "run_name=r"), str(tmp_path / "r"), named=True)


def test_resume_of_a_run_dir_restores_the_overrides_it_started_with(tmp_path):
    """`train.py resume=RUN_DIR` alone composes the run's own config: the overrides saved in
    RUN_DIR/resume_command come first, and a key given again on the command line wins."""
    from dflash.run.plan import RESUME_FILE, with_run_overrides

    run = tmp_path / "out" / "main"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / RESUME_FILE).write_text(
        f"python train.py +exp=qwen05_coder 'train.time_budget_min=17' out_root={tmp_path}/out "
        f"'drafter.init_layers_from_target=[-2, -1]' resume={run}\n"
    )
    saved = [
        "+exp=qwen05_coder",
        "train.time_budget_min=17",
        f"out_root={tmp_path}/out",
        "drafter.init_layers_from_target=[-2, -1]",
    ]
    argv, restored = with_run_overrides([f"resume={run}"])
    assert restored == saved and argv == saved + [f"resume={run}"]
    # a checkpoint of the run, and a key given again (the budget) wins over the saved one
    ck = f"resume={run}/checkpoints/step_00000010"
    argv, restored = with_run_overrides([ck, "train.time_budget_min=25"])
    assert "train.time_budget_min=17" not in argv and argv[-2:] == [ck, "train.time_budget_min=25"]
    assert restored == [saved[0], *saved[2:]]
    # resume=true run_name=NAME (with the out_root it names)
    argv, restored = with_run_overrides(
        ["resume=true", "run_name=main", f"out_root={tmp_path}/out"]
    )
    assert restored == [saved[0], saved[1], saved[3]]
    # nothing to restore: not a resume, no such run, or a run dir without the file
    for args in (["train.steps=5"], ["resume=false"], [f"resume={tmp_path}/none"], ["resume=true"]):
        assert with_run_overrides(args) == (args, [])
    (run / RESUME_FILE).unlink()
    assert with_run_overrides([f"resume={run}"]) == ([f"resume={run}"], [])
    # torchrun's command line
    (run / RESUME_FILE).write_text(
        f"torchrun --nproc-per-node 2 train.py topology=split resume={run}\n"
    )
    assert with_run_overrides([f"resume={run}"])[1] == ["topology=split"]


def _train_run(tmp_path, name, *over, stop_at=None):
    from dflash.train.colocated import run_colocated

    cfg = typed(tmp_path, f"run_name={name}", f"data.cache_dir={tmp_path}/cache", *over)
    return run_colocated(cfg, str(tmp_path / name), stop_at=stop_at)


def test_resume_on_edited_samples_of_the_same_count_is_refused_naming_the_cache(tmp_path):
    """The same number of samples, one token changed in the cached dataset: the stream position
    would continue on other samples; the samples' digest in the checkpoint refuses it."""
    import glob

    import torch

    _train_run(tmp_path, "r", "train.steps=6", stop_at=3)
    (cache,) = glob.glob(str(tmp_path / "cache" / "train-*.pt"))
    data = torch.load(cache)
    data["input_ids"][5] = (data["input_ids"][5] + 1) % 500
    torch.save(data, cache)
    with pytest.raises(ValueError) as e:
        _train_run(tmp_path, "r", "train.steps=6", "resume=true")
    msg = str(e.value)
    assert msg.startswith(f"resume: the samples in {tmp_path}/cache are not the ones"), msg
    assert "regenerated or edited" in msg


def test_a_resume_that_changes_the_targets_kernels_trains_on_the_data_it_started_with(
    tmp_path, capsys
):
    """target.attn_implementation may change at a resume (another machine may lack a kernel) and
    names the data cache: the resumed run reads the cache it trained on (run_config.json's
    data_file; for a run recorded before that key, the name under the kernels it started with)
    instead of regenerating its data, here in all three legs."""
    import glob

    def caches():
        return sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "cache" / "train-*")))

    _train_run(tmp_path, "r", "train.steps=9", "target.attn_implementation=eager", stop_at=3)
    (first,) = caches()
    saved = json.load(open(tmp_path / "r" / "run_config.json"))
    assert saved["data_file"] == first and saved["target_dtype"] == "float32"  # auto on a CPU
    del saved["data_file"]  # a run recorded before the key: the name is computed
    json.dump(saved, open(tmp_path / "r" / "run_config.json", "w"))
    capsys.readouterr()
    for stop in (6, None):
        _train_run(
            tmp_path,
            "r",
            "train.steps=9",
            "resume=true",
            "target.attn_implementation=sdpa",
            stop_at=stop,
        )
        out = capsys.readouterr().out
        assert f"data: the run's own cache {tmp_path}/cache/{first} (this resume" in out, out
        assert "regenerat" not in out and caches() == [first]
        saved = json.load(open(tmp_path / "r" / "run_config.json"))
        assert saved["data_file"] == first and saved["target"]["attn_implementation"] == "sdpa"
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "step_00000009")


def test_resume_with_another_step_layout_says_so_and_records_it(tmp_path, capsys):
    _train_run(tmp_path, "r", "train.steps=6", stop_at=3)
    capsys.readouterr()
    _train_run(tmp_path, "r", "train.steps=6", "resume=true", "train.micro_batch_size=4")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "step layout changed" in ln]
    assert lines == [
        "resume: the step layout changed at step 3 (train.micro_batch_size 2 -> 4); from here on "
        "the run is not the uninterrupted one (another cut of the samples into steps); recorded "
        "in run_config.json (layout_changes)"
    ]
    saved = json.load(open(tmp_path / "r" / "run_config.json"))
    assert saved["layout_changes"] == [
        {"step": 3, "from": {"train.micro_batch_size": 2}, "to": {"train.micro_batch_size": 4}}
    ]
    assert saved["train"]["micro_batch_size"] == 4


def test_a_damaged_metrics_row_drops_only_itself(tmp_path, capsys):
    """A NUL-filled row in the middle of metrics.jsonl: every parseable row up to the checkpoint
    stays, the damaged one goes with a line, rows past the checkpoint are redone."""
    _train_run(tmp_path, "r", "train.steps=8", stop_at=7)  # checkpoint at step 6
    path = tmp_path / "r" / "metrics.jsonl"
    rows = path.read_bytes().split(b"\n")
    assert [json.loads(r)["step"] for r in rows if r] == list(range(1, 8))
    rows[1] = b"\x00" * len(rows[1])  # the row of step 2
    path.write_bytes(b"\n".join(rows))
    capsys.readouterr()
    _train_run(tmp_path, "r", "train.steps=8", "resume=true")
    assert "metrics.jsonl: line 2 is damaged (not JSON); dropped it" in capsys.readouterr().out
    steps = [json.loads(r)["step"] for r in path.read_bytes().split(b"\n") if r]
    assert steps == [1, 3, 4, 5, 6, 7, 8]


def test_resume_reads_the_train_state_to_the_cpu(tiny_qwen, tmp_path, monkeypatch):
    """Under DDP every rank reads train_state.pt: without map_location its tensors go to the
    device that saved them (GPU 0 for every rank)."""
    import torch

    import dflash.train.resume as rs

    d = make_drafter(tiny_qwen)
    step = save_checkpoint(str(tmp_path), 3, d, {"x": 1})
    calls, real = [], torch.load
    monkeypatch.setattr(
        rs.torch, "load", lambda *a, **k: calls.append(k.get("map_location")) or real(*a, **k)
    )
    rs.load_checkpoint(step, make_drafter(tiny_qwen))
    assert calls == ["cpu"]


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_run_dir_is_owned_by_one_live_run(tiny_qwen, tmp_path, capsys):
    """A second start or resume of a run directory that a live run holds is refused in one line
    naming the owner (they would mix their checkpoints and metrics, or join); the lock of a run
    that died is taken over with a line."""
    import socket

    from dflash.run.launcher import launch
    from dflash.run.lock import LOCK_FILE, RunLock

    fake_run(tiny_qwen, tmp_path / "r", 2, "run_name=r", "train.steps=10")
    live = RunLock(str(tmp_path / "r"))
    assert live.acquire() is None  # a live run (this process) owns r
    before = sorted(os.walk(tmp_path))
    for over in (["resume=true"], ["train.lr=1e-3"], []):
        with pytest.raises(SystemExit) as e:
            launch(compose(tmp_path, "run_name=r", "train.steps=10", *over))
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: run dir {tmp_path / 'r'} is in use by a live run (pid ")
        assert f"{os.getpid()} on host {socket.gethostname()}" in err and "\n" not in err
        assert sorted(os.walk(tmp_path)) == before  # nothing written: not even train.log
    live.release()

    # the owner died (kill -9 leaves its lock file): the next start takes it over
    lock = tmp_path / "r" / LOCK_FILE
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": 1}))
    import dflash.run.launcher as launch_mod

    launch_mod.run_colocated, real = (lambda cfg, run_dir: None), launch_mod.run_colocated
    try:
        launch(compose(tmp_path, "run_name=r", "train.steps=10", "resume=true"))
    finally:
        launch_mod.run_colocated = real
    assert "run dir: taking it over from a run that is gone (pid " in capsys.readouterr().out
    assert not lock.exists()  # released at the end


def test_leftovers_of_killed_starts_are_cleaned_on_the_next_start(tmp_path, capsys):
    """A fresh start after a kill before the first checkpoint does not append to the earlier
    start's metrics (every row twice); the temporary folders of killed saves do not stay
    forever."""
    import dflash.run.launcher as launch_mod

    run = tmp_path / "r"
    dead = _dead_pid()
    leftovers = [
        f"checkpoints/.step_00000004.tmp{dead}/model.safetensors",
        f"checkpoints/.step_00000002.old{dead}/config.json",
        f"checkpoints/.latest.tmp{dead}",
        f"run_config.json.tmp{dead}",
        f"data/train-0123.pt.partial/shard_000001.npz.tmp{dead}",
        f"data/eval-0123.safetensors.tmp{dead}",
    ]
    for rel in leftovers + ["data/train-0123.pt.partial/shard_000000.npz"]:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("x")
    (run / "metrics.jsonl").write_text('{"step": 1, "train/loss": 5.0}\n')
    launch_mod.run_colocated, real = (lambda cfg, run_dir: None), launch_mod.run_colocated
    try:
        launch_mod.launch(compose(tmp_path, "run_name=r"))
    finally:
        launch_mod.run_colocated = real
    out = capsys.readouterr().out
    assert "run dir: removed what an interrupted earlier start left: " in out
    for rel in leftovers:
        top = "/".join(rel.split("/")[:2]) if rel.startswith("checkpoints/.step") else rel
        assert not (run / top).exists(), rel
    assert not (run / "metrics.jsonl").exists() and "metrics.jsonl (of an earlier start" in out
    assert (run / "data/train-0123.pt.partial/shard_000000.npz").exists()  # resumable: kept


def test_resume_with_the_target_weights_elsewhere_says_to_link_them_at_the_old_path():
    """A run moved to a machine where the target's weights lie elsewhere: target.path keys the
    data cache, so the change is refused, naming the link that resumes it."""
    import dataclasses

    from dflash.config import RunConfig
    from dflash.run.plan import check_same_run

    cfg = RunConfig()
    cfg.target.path = "/new/qwen"
    saved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    saved["target"]["path"] = "/old/qwen"
    with pytest.raises(ValueError) as e:
        check_same_run(cfg, saved, "ck")
    msg = str(e.value)
    assert "target.path changed ('/old/qwen' -> '/new/qwen')" in msg
    assert "ln -s /new/qwen /old/qwen" in msg and "resume without target.path" in msg


def test_a_resume_may_change_how_the_target_runs_the_capture_not_what_it_computes():
    """target.compile_layers, capture_graphs, ... name neither cache: a run started compiled on
    a GPU resumes eagerly elsewhere (e.g. a relay's state checked on a CPU); target.dtype, which
    changes the forward, is still refused."""
    import dataclasses

    from dflash.config import RunConfig
    from dflash.run.plan import check_same_run

    cfg = RunConfig()
    saved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    saved["target"].update(compile_layers=True, capture_graphs=False, compile_gdn="mlp")
    check_same_run(cfg, saved, "ck")  # no error
    saved["target"]["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="target.dtype changed"):
        check_same_run(cfg, saved, "ck")


def test_a_resume_may_not_change_what_target_dtype_auto_resolves_to(monkeypatch):
    """target.dtype=auto is float32 on a CPU and bfloat16 on CUDA: a run begun on one (its
    run_config.json records the dtype it ran as) is refused on the other, with the setting that
    continues it; auto and that explicit dtype are the same run."""
    import dataclasses

    import torch

    from dflash.config import RunConfig
    from dflash.run.plan import check_same_run

    cfg = RunConfig()
    assert cfg.target.dtype == "auto"
    saved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    saved["target_dtype"] = "float32"  # begun on a CPU
    check_same_run(cfg, saved, "ck")  # on a CPU again: no error
    cfg.target.dtype = "float32"
    check_same_run(cfg, saved, "ck")  # auto -> float32 on a CPU: the same run
    cfg.target.dtype = "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resumed on a GPU
    with pytest.raises(ValueError) as e:
        check_same_run(cfg, saved, "ck")
    msg = str(e.value)
    assert "target.dtype=auto is bfloat16 on this machine but the run started in float32" in msg
    assert "set target.dtype=float32" in msg and "drafter.init_from=ck" in msg
    cfg.target.dtype = "float32"
    check_same_run(cfg, saved, "ck")  # the fix the message names
    cfg.target.dtype = "bfloat16"
    with pytest.raises(ValueError, match="is bfloat16 on this machine"):
        check_same_run(cfg, saved, "ck")
    del saved["target_dtype"]  # a run recorded before the key: the setting itself is compared
    with pytest.raises(ValueError, match="target.dtype changed"):
        check_same_run(cfg, saved, "ck")
