"""train.profile_at: the loop profiles the steps asked for, writes the tables and trace into the
run dir and says where the time went; the busy-time union equals brute force."""

import json
import os
import random

import pytest
import torch
from test_resume import typed

from dflash.common.profiling import StepProfiler, busy_union_us


def test_busy_union_equals_brute_force_on_a_grid():
    rng = random.Random(0)
    for _ in range(200):
        ivs = []
        for _ in range(rng.randint(0, 8)):
            a = rng.randint(0, 60)
            ivs.append((a, a + rng.randint(0, 15)))
        covered = {t for a, b in ivs for t in range(a, b)}  # unit cells [t, t+1)
        assert busy_union_us(ivs) == len(covered)


def test_profile_at_writes_tables_trace_and_a_summary(tmp_path, capsys):
    from dflash.train.colocated import run_colocated

    torch.set_num_threads(1)
    run_dir = tmp_path / "p"
    cfg = typed(tmp_path, "train.steps=6", "train.profile_at=4", "train.profile_steps=2")
    run_colocated(cfg, str(run_dir))
    out = capsys.readouterr().out
    assert "profile of steps 4-5:" in out and "(timed unprofiled just before)" in out
    files = sorted(os.listdir(run_dir / "profile"))
    assert files == ["steps_4-5.trace.json", "steps_4-5.txt"]
    text = (run_dir / "profile" / "steps_4-5.txt").read_text()
    res = json.loads(text.split("\n\n")[0])
    assert res["steps"] == [4, 5] and res["wall_unprofiled"] and res["wall_ms_per_step"] > 0
    assert "aten::" in text  # the operator table
    assert {"dflash.capture", "dflash.forward", "dflash.backward"} <= set(res["phases_ms_per_step"])
    json.loads((run_dir / "profile" / "steps_4-5.trace.json").read_text())


def test_profile_window_cut_short_by_the_end_of_training_is_still_written(tmp_path, capsys):
    from dflash.train.colocated import run_colocated

    torch.set_num_threads(1)
    cfg = typed(tmp_path, "train.steps=3", "train.profile_at=3", "train.profile_steps=5")
    run_colocated(cfg, str(tmp_path / "q"))
    assert "profile of steps 3-3:" in capsys.readouterr().out
    assert (tmp_path / "q" / "profile" / "steps_3-3.txt").exists()


def test_negative_profile_at_is_refused():
    with pytest.raises(ValueError, match="train.profile_at must be >= 0"):
        StepProfiler(-1, 5, torch.device("cpu"), "unused")


def test_phase_times_merges_the_host_and_gpu_entries_of_a_range():
    from types import SimpleNamespace as E

    from dflash.common.profiling import phase_times

    avgs = [  # CUDA lists a range twice: its host span, then its span on the GPU timeline
        E(key="dflash.forward", cpu_time_total=6000.0, device_time_total=500.0),
        E(key="aten::mm", cpu_time_total=9000.0, device_time_total=9000.0),
        E(key="dflash.forward", cpu_time_total=0.0, device_time_total=14000.0),
        E(key="dflash.optimizer", cpu_time_total=2000.0),
    ]
    assert phase_times(avgs, 2) == {"dflash.forward": [3.0, 7.0], "dflash.optimizer": [1.0, 0.0]}
