"""dflash.tools.compare: the ablation table names the settings that differ and each run's
final figures."""

import json

from dflash.tools.compare import table


def _run(d, layers, tau, budget_min=None):
    d.mkdir()
    cfg = {"run_name": d.name, "drafter": {"num_layers": layers, "block_size": 16}, "train": {}}
    (d / "run_config.json").write_text(json.dumps(cfg))
    rows = [
        {"step": 0, "eval/tau": 1.0, "eval/tau@64": 1.0},
        {"step": 10, "train/loss": 2.0, "train/acc": 0.5, "perf/tokens_per_s": 100.0},
        {
            "step": 20,
            "train/loss": 1.0,
            "train/acc": 0.6,
            "perf/tokens_per_s": 300.0,
            "data/epoch": 1.5,
            **({"time/run_min": budget_min} if budget_min else {}),
        },
        {"step": 20, "eval/tau": tau, "eval/tau@16": tau + 0.1, "eval/tau@64": tau + 0.5},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def test_table_lists_differing_settings_and_final_figures(tmp_path):
    out = table([_run(tmp_path / "a", 2, 2.5, 9.8), _run(tmp_path / "b", 4, 3.0)])
    lines = out.splitlines()
    assert lines[0].split(" | ")[1] == "drafter.num_layers"  # run_name differs but is no setting
    assert "block_size" not in out
    a = [c.strip() for c in lines[2].strip("|").split("|")]
    assert a == ["a", "2", "20", "9.8", "1.50", "0.600", "200", "2.500", "3.000 @64"]
    b = [c.strip() for c in lines[3].strip("|").split("|")]
    assert b[1] == "4" and b[3] == "-" and b[-2:] == ["3.000", "3.500 @64"]


def test_runs_with_eval_sets_show_each_sets_tau(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "run_config.json").write_text(json.dumps({"run_name": "s", "train": {}}))
    rows = [
        {"step": 5, "train/loss": 1.0, "train/acc": 0.5, "perf/tokens_per_s": 10.0},
        {"step": 5, "eval/code/tau": 3.25, "eval/chat/tau": 2.5, "eval/chat/tau@4": 2.75},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = [c.strip() for c in table([str(d)]).splitlines()[2].strip("|").split("|")]
    assert cells[-2] == "chat 2.500, code 3.250"


def test_tau_at_minutes_and_the_curve_plot_follow_the_budget_clock(tmp_path):
    """--at / --plot: an eval at a step without a clock of its own sits at the minutes its
    neighbours' clocks put it at (linear between them); tau by M minutes is the last eval by
    then, per eval set."""
    import subprocess
    import sys

    from conftest import ROOT

    from dflash.common.plot import eval_curve

    d = tmp_path / "long"
    d.mkdir()
    (d / "run_config.json").write_text(json.dumps({"run_name": "long", "train": {}}))
    rows = [{"step": 0, "eval/code/tau": 1.0, "eval/chat/tau": 1.0, "time/run_min": 2.5}]
    for step, minutes in ((1000, 10.0), (2000, 30.0), (3000, 60.0)):
        rows.append(
            {
                "step": step,
                "train/loss": 1.0,
                "train/acc": 0.5,
                "perf/tokens_per_s": 9.0,
                "time/run_min": minutes,
            }
        )
    rows += [
        {"step": 1500, "eval/code/tau": 3.0, "eval/chat/tau": 2.0},  # 20 min (older runs:
        {"step": 2500, "eval/code/tau": 4.0, "eval/chat/tau": 2.5},  # 45 min  no clock on
        {"step": 3000, "eval/code/tau": 4.5, "eval/chat/tau": 2.75},  # 60 min  eval rows)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert eval_curve(rows, "eval/code/tau") == ([2.5, 20.0, 45.0, 60.0], [1.0, 3.0, 4.0, 4.5])
    out = table([str(d)], at=[20, 40, 60])
    cells = [c.strip() for c in out.splitlines()[2].strip("|").split("|")]
    assert cells[-3:] == [
        "chat 2.000, code 3.000",
        "chat 2.000, code 3.000",
        "chat 2.750, code 4.500",
    ]
    png = tmp_path / "curve.png"
    r = subprocess.run(
        [sys.executable, "-m", "dflash.tools.compare", str(d), "--at", "20,60", "--plot", str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-1000:]
    assert "tau @20 min" in r.stdout and png.stat().st_size > 10_000


def test_folders_that_are_no_runs_are_named_not_dropped_unseen(tmp_path, capsys):
    """A folder without run_config.json (a device call's res/ with metrics.jsonl alone) and a
    pattern that matches nothing are said on stderr; the runs that are there still compare."""
    import pytest

    from dflash.tools.compare import run_dirs

    good = _run(tmp_path / "good", 2, 2.5)
    bare = tmp_path / "res"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/tau": 1.0}) + "\n")
    assert run_dirs([good, str(bare), str(tmp_path / "nope")]) == [good]
    err = capsys.readouterr().err
    assert f"skipped {bare}: no run_config.json" in err
    assert f"skipped {tmp_path / 'nope'}: no such directory" in err
    with pytest.raises(SystemExit, match="no run directories"):
        run_dirs([str(bare)])


def test_runs_scored_on_different_eval_sets_are_said_not_to_compare(tmp_path):
    """A run saved before eval.near_tie_rounds (it cut each completion at its first bf16
    near-tie) next to one scoring whole completions: the table names the key and says the tau
    columns do not compare; a setting that leaves the set alone (eval.real_decode_prompts) does
    not."""
    a, b, c = (_run(tmp_path / n, 2, 3.0) for n in "abc")
    for d, ev in ((a, {"num_prompts": 164}), (b, {"num_prompts": 164, "near_tie_rounds": 4})):
        cfg = json.loads(open(f"{d}/run_config.json").read())
        cfg["eval"] = ev
        open(f"{d}/run_config.json", "w").write(json.dumps(cfg))
    out = table([a, b])
    assert out.splitlines()[0].split(" | ")[1] == "eval.near_tie_rounds"
    assert [r.split(" | ")[1] for r in out.splitlines()[2:4]] == ["0", "4"]  # a: what it ran with
    assert "evals score different sets (eval.near_tie_rounds)" in out
    cfg = json.loads(open(f"{c}/run_config.json").read())
    cfg["eval"] = {"num_prompts": 164, "near_tie_rounds": 4, "real_decode_prompts": 2}
    open(f"{c}/run_config.json", "w").write(json.dumps(cfg))
    out = table([b, c])
    assert "eval.real_decode_prompts" in out and "different sets" not in out
