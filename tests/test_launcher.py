"""The launcher as a user meets it: bad invocations are one line and leave nothing behind, the log
file holds the console, checks that need no model come first, Ctrl-C resumes in place."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, target_cfg

from dflash.run.overrides import check_override

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_NO_PROGRESS": "1"}
TINY_RUN = [
    "data.num_samples=16",
    "data.response_len=16",
    "eval.enabled=false",
    "train.log_every=1",
    "train.save_every=1000",
]


def _train(args, **kw):
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        **kw,
    )


def _error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "override,match",
    [
        ("+train.stpes=5", r"'train.stpes'.*did you mean train.steps"),
        ("trian.steps=5", r"'trian'.*did you mean train\?"),
        ("train.stepz=5", r"did you mean train.steps"),
        ("target=tiny_qwen", r"option 'tiny_qwen' of group 'target'.*target=tiny_qwen3_5"),
        ("+exp=v6", r"did you mean \+exp=v5"),
        ("tagret=tiny_llama", r"'tagret'.*did you mean target"),
    ],
)
def test_unknown_keys_name_the_closest(override, match):
    with pytest.raises(ValueError, match=match):
        check_override(override)


@pytest.mark.parametrize(
    "override",
    [
        "train.steps=5",
        "+exp=v5",
        "target=tiny_llama",
        "target.config.hidden_size=64",
        "resume=true",
        "hydra.verbose=true",
        "drafter.rope_scaling={rope_type: yarn}",
        "train.lr=1e-3",
        "train.steps=5",
        "eval.enabled=false",
        "train.time_budget_min=null",
        "drafter.target_layer_ids=[1,2]",
        "train.lr=${train.min_lr_ratio}",
        "train.lr=1e-3,2e-3",  # a sweep (-m)
    ],
)
def test_valid_overrides_pass(override):
    check_override(override)


@pytest.mark.parametrize(
    "args,match",
    [
        (["+train.stpes=5"], "did you mean train.steps"),
        (["train.log_every=0"], "train.log_every"),
        (["resume=/nonexistent/run"], "no resumable checkpoint under '/nonexistent/run'"),
        (["train.lr=abc"], "'train.lr=abc': train.lr takes a number, got 'abc'"),
        (["train.steps=1.5"], "train.steps takes an integer, got '1.5'"),
        (["eval.enabled=maybe"], "eval.enabled takes true or false, got 'maybe'"),
    ],
)
def test_bad_invocation_is_one_line_and_leaves_no_directory(tmp_path, args, match):
    before = set(os.listdir(ROOT))
    t0 = time.monotonic()
    r = _train([f"out_root={tmp_path}/out", *args])
    assert re.search(match, _error_line(r))
    assert not (tmp_path / "out").exists()
    assert set(os.listdir(ROOT)) == before  # no .hydra/, train.log or outputs/ in the cwd
    assert time.monotonic() - t0 < 60  # before any model loads (was ~20 s of loading + regen)


def test_a_start_that_fails_leaves_no_empty_out_root_behind(tmp_path):
    """A run that fails before it started removes its run dir and the folders it made for it
    (out_root included), but never a folder that was there or holds something else."""
    from dflash.run.directory import RunDir

    rd = RunDir(str(tmp_path / "out" / "exp" / "run"), "train.log").open()
    print("a line for the log")
    rd.close(ok=False)
    assert os.listdir(tmp_path) == []
    (tmp_path / "out" / "other").mkdir(parents=True)
    rd = RunDir(str(tmp_path / "out" / "exp" / "run"), "train.log").open()
    rd.close(ok=False)
    assert os.listdir(tmp_path / "out") == ["other"]


def test_target_too_big_for_memory_or_needing_cuda_is_refused(monkeypatch):
    import dflash.run.preflight as P

    big = target_cfg("qwen3_6_27b_random")
    assert 20e9 < P.estimate_params(big.config) < 32e9  # the 27B shape
    monkeypatch.setattr(P, "available_bytes", lambda dev: 16 * 10**9)
    with pytest.raises(ValueError, match=r"qwen3_6_27b_random.*needs ~4\d\.\d GB.*16\.0 GB free"):
        P.check_target_resources(big, device="cpu")
    P.check_target_resources(target_cfg("tiny_qwen3_5"), device="cpu")  # fits
    monkeypatch.setattr(P.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        P.check_target_resources(target_cfg("tiny_qwen3_5", device="cuda"))
    with pytest.raises(ValueError, match="linear_attn_backend=fla needs a CUDA device"):
        P.check_target_resources(target_cfg("tiny_qwen3_5", linear_attn_backend="fla"))


def test_safetensors_weights_are_counted_from_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    import dflash.run.preflight as P

    save_file(
        {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)},
        tmp_path / "m.safetensors",
    )
    assert (
        P.target_weight_bytes(target_cfg("tiny_llama", config=None, path=str(tmp_path)), "float32")
        == 17 * 4
    )


@pytest.mark.slow
def test_ctrl_c_saves_prints_resume_command_and_it_continues_in_place(tmp_path):
    # long enough that SIGINT lands mid-run, short enough that the resumed run finishes it
    args = [f"out_root={tmp_path}", "train.steps=60", *TINY_RUN]
    p = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    run_dir = None
    for line in p.stdout:
        if line.startswith("run dir: "):
            run_dir = line.split("run dir: ")[1].strip()
        if line.startswith("step      3 |"):
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("interrupted at step")]
    assert len(lines) == 1, err[-3000:]
    step = int(re.match(r"interrupted at step (\d+); resume with: ", lines[0]).group(1))
    assert step >= 3
    cmd = shlex.split(lines[0].split("resume with: ")[1])
    assert cmd[:2] == ["python", "train.py"] and f"resume={run_dir}" in cmd
    log = open(os.path.join(run_dir, "train.log")).read()
    assert f"run dir: {run_dir}" in log and "step      1 | loss=" in log and lines[0] in log

    assert step < 60, "the run finished before the interrupt: the test proves nothing"
    saved = open(os.path.join(run_dir, "resume_command")).read().strip()
    assert saved == lines[0].split("resume with: ")[1]
    # a resume that changes the run's data is refused, quoting the run's command
    bad = _train([f"resume={run_dir}", "data.num_samples=7"])
    assert bad.returncode == 2 and "data.num_samples changed" in _error_line(bad)
    assert f"this run resumes with: {saved}" in _error_line(bad)
    # resume=RUN_DIR alone: the run's own overrides come back from its resume_command (the
    # printed command, with all of them, is the same run)
    r = _train([f"resume={run_dir}"])
    assert r.returncode == 0, r.stderr[-3000:]
    restored = " ".join(o for o in cmd[2:] if not o.startswith("resume="))
    assert f"resume: with the run's own overrides: {restored}" in r.stdout
    assert f"run dir: {run_dir}" in r.stdout
    assert f"resumed from {run_dir}/checkpoints/step_{step:08d} at step {step}" in r.stdout
    assert f"step {step + 1:>6d} | loss=" in r.stdout
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step_00000060"))


def test_sigterm_finishes_the_step_saves_and_prints_the_resume_command(tmp_path):
    """Preemption (SLURM, scancel, Kubernetes) sends SIGTERM: like Ctrl-C, the step finishes,
    is saved, and the resume line is printed; exit 143 (128 + SIGTERM)."""
    args = [f"out_root={tmp_path}", "run_name=r", "train.steps=200", *TINY_RUN]
    p = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    for line in p.stdout:
        if line.startswith("step      3 |"):
            p.send_signal(signal.SIGTERM)
            break
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SIGTERM: finishing the current step" in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("stopped by SIGTERM at step")]
    step = int(re.match(r"stopped by SIGTERM at step (\d+); resume with: ", line).group(1))
    assert 3 <= step < 200 and f"resume={tmp_path}/r" in line
    assert (tmp_path / "r" / "checkpoints" / f"step_{step:08d}" / "train_state.pt").is_file()
    assert line in (tmp_path / "r" / "train.log").read_text()


def test_the_same_command_twice_is_refused_naming_the_live_run(tmp_path):
    """Two processes in one run directory mixed silently (every metrics row twice, the other
    run's weights in a step dir, a resume joining a live run): the second is refused in one
    line naming the first."""
    args = [f"out_root={tmp_path}", "run_name=r", "train.steps=100000", *TINY_RUN]
    first = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    try:
        for line in first.stdout:
            if line.startswith("step      1 |"):
                break
        for again in ([*args, "train.lr=1e-4"], [*args, "resume=true"]):
            r = _train(again)
            assert re.fullmatch(
                rf"error: run dir {tmp_path}/r is in use by a live run \(pid {first.pid} on "
                r"host .*\): .*pick another run_name.*",
                _error_line(r),
            )
    finally:
        first.kill()
        first.wait()


def test_sigterm_outside_the_train_loop_stops_like_ctrl_c():
    from dflash.common import interrupt

    prev = {s: signal.getsignal(s) for s in interrupt.STOP_SIGNALS}
    try:
        interrupt.stop_at_once()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
        assert interrupt.stop_signal() == signal.SIGTERM
        assert interrupt.exit_code(interrupt.stop_signal()) == 143
    finally:
        interrupt._received.clear()
        for s, h in prev.items():
            signal.signal(s, h)


def test_eval_writes_to_its_own_dir_named_after_the_checkpoint(tmp_path):
    from dflash.config import RunConfig
    from dflash.eval.cli import eval_dir

    ck = tmp_path / "smoke-1" / "checkpoints" / "step_00000300"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    assert eval_dir(RunConfig(ckpt=str(ck))) == os.path.join("evals", "smoke-1-step_00000300")
    pub = tmp_path / "Qwen3.6-27B-DFlash"
    pub.mkdir()
    (pub / "model.safetensors").write_text("")
    assert eval_dir(RunConfig(ckpt=str(pub))) == os.path.join("evals", "Qwen3.6-27B-DFlash")
    before = set(os.listdir(ROOT))
    r = subprocess.run(
        [sys.executable, "eval.py", f"ckpt={tmp_path}/missing"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert "is not a directory" in _error_line(r)
    assert set(os.listdir(ROOT)) == before


def test_eval_ckpt_may_name_a_run_dir_its_latest_file_or_a_step_dir(tmp_path):
    """The README's `eval.py ckpt=outputs/NAME/checkpoints/latest` (a file), a run directory
    (its newest checkpoint) and a step directory all name the same drafter."""
    from dflash.config import RunConfig
    from dflash.eval.cli import eval_dir

    run = tmp_path / "smoke-1"
    for step in (100, 200):
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:08d}" / "config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_00000200\n")
    want = os.path.join("evals", "smoke-1-step_00000200")
    for ck in (run, run / "checkpoints", run / "checkpoints" / "latest"):
        assert eval_dir(RunConfig(ckpt=str(ck))) == want, ck
    (run / "checkpoints" / "latest").unlink()  # lost: the newest step
    assert eval_dir(RunConfig(ckpt=str(run))) == want
    step = run / "checkpoints" / "step_00000100"
    assert eval_dir(RunConfig(ckpt=str(step))) == os.path.join("evals", "smoke-1-step_00000100")
    with pytest.raises(FileNotFoundError, match="holds no drafter.*a run directory"):
        eval_dir(RunConfig(ckpt=str(tmp_path)))


def test_parity_refuses_a_cuda_setting_without_cuda_at_once(monkeypatch, capsys):
    import dflash.run.preflight as P
    from dflash.tools import parity

    monkeypatch.setattr(P.torch.cuda, "is_available", lambda: False)
    argv = [
        "--target",
        "qwen3_6_27b_random",
        "--a",
        "torch:bfloat16:cuda",
        "--b",
        "fla:bfloat16:cuda",
    ]
    t0 = time.monotonic()
    assert parity.main(argv) == 2
    assert "no CUDA device" in capsys.readouterr().err and time.monotonic() - t0 < 10


def test_sharded_modes_are_not_refused_at_resume():
    """fsdp and DeepSpeed checkpoints hold each rank's optimizer state: resume is checked like
    ddp's (tests/test_parallelize.py resumes them), not refused before loading."""
    from dflash.config import RunConfig, TrainConfig
    from dflash.run.preflight import check_dist

    check_dist(RunConfig(train=TrainConfig(dist="fsdp"), resume="/some/run"))


def test_missing_data_file_is_named_before_loading(tmp_path):
    from dflash.config import DataConfig, RunConfig
    from dflash.run.preflight import check_files

    cfg = RunConfig(data=DataConfig(source="jsonl", paths=[str(tmp_path / "nope.jsonl")]))
    with pytest.raises(FileNotFoundError, match="data.paths: .*nope.jsonl"):
        check_files(cfg)


def test_missing_gguf_target_says_how_to_fetch_it(tmp_path):
    from dflash.config import RunConfig, TargetConfig
    from dflash.run.preflight import check_files

    gguf = TargetConfig(name="smollm2_135m", path=str(tmp_path / "smollm2"), gguf_file="S.gguf")
    with pytest.raises(FileNotFoundError, match=r"S.gguf: fetch it with .*fetch_models.sh"):
        check_files(RunConfig(target=gguf))
    with pytest.raises(FileNotFoundError) as e:  # a plain directory target: no fetch hint
        check_files(RunConfig(target=TargetConfig(name="t", path=str(tmp_path / "m"))))
    assert "fetch_models" not in str(e.value)
