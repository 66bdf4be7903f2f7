"""train.keep_best: checkpoints/best holds the drafter of the eval that scored highest on the
named figure, replaced atomically, removed on resume when it lies past the resumed step."""

import os

import pytest
import torch
from conftest import make_drafter

from dflash.common.manifest import read_manifest, verify_manifest
from dflash.drafter.checkpoint import load_drafter
from dflash.train import resume as best_mod
from dflash.train.resume import BestCheckpoint


def _weights(path):
    d, _ = load_drafter(str(path))
    return {k: v.clone() for k, v in d.state_dict().items()}


def _scaled(tiny_qwen, s):
    d = make_drafter(tiny_qwen)
    with torch.no_grad():
        for p in d.parameters():
            p.mul_(s)
    return d


def test_keeps_the_highest_figure_and_only_it(tiny_qwen, tmp_path):
    keep = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=0)
    d1, d2, d3 = (_scaled(tiny_qwen, s) for s in (1.0, 2.0, 3.0))
    assert keep.offer(10, {"eval/tau": 2.0}, d1)
    assert keep.offer(20, {"eval/tau": 2.5}, d2)
    assert not keep.offer(30, {"eval/tau": 2.5}, d3)  # a tie keeps the earlier
    assert not keep.offer(40, {"eval/tau": 1.0}, d3)
    path = tmp_path / "checkpoints" / "best"
    run = read_manifest(str(path))["run"]
    assert run == {"step": 20, "best_metric": "eval/tau", "best_value": 2.5}
    assert verify_manifest(str(path))
    want = {k: v.to(torch.bfloat16).float() for k, v in d2.state_dict().items()}
    got = _weights(path)
    assert all(torch.equal(got[k].float(), want[k]) for k in want)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["best"]  # nothing left aside


def test_another_rank_tracks_the_figure_without_writing(tiny_qwen, tmp_path):
    keep = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=0, writer=False)
    assert keep.offer(10, {"eval/tau": 2.0}, make_drafter(tiny_qwen))
    assert keep.value == 2.0 and not (tmp_path / "checkpoints").exists()


def test_an_unknown_figure_is_named_with_the_choices(tmp_path):
    keep = BestCheckpoint(str(tmp_path), "eval/taux", resumed_step=0)
    with pytest.raises(ValueError, match=r"train.keep_best='eval/taux' .*\['eval/code/tau'"):
        keep.check({"eval/code/tau": 1.0, "eval/code/tau@4": 1.0, "train/loss": 3.0})


def test_resume_keeps_a_best_from_before_and_forgets_one_from_after(tiny_qwen, tmp_path):
    BestCheckpoint(str(tmp_path), "eval/tau", 0).offer(
        30, {"eval/tau": 3.0}, make_drafter(tiny_qwen)
    )
    after = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=40)
    assert (after.value, after.step) == (3.0, 30)
    assert not after.offer(50, {"eval/tau": 2.9}, make_drafter(tiny_qwen))
    other = BestCheckpoint(str(tmp_path), "eval/other/tau", resumed_step=40, writer=False)
    assert other.value is None and (tmp_path / "checkpoints" / "best").is_dir()  # reads only
    replayed = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=20)  # steps 21.. again
    assert replayed.value is None
    # removed from disk too when the loop starts: eval.py ckpt=RUN/checkpoints/best (or a relay
    # leg's pack) never reads a drafter of the discarded steps
    line = replayed.start(["eval/"])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == []
    assert line.startswith("best: removed ") and "eval/tau at step 30; resumed at step 20" in line


def test_a_best_kept_for_another_figure_is_removed_on_resume(tiny_qwen, tmp_path):
    BestCheckpoint(str(tmp_path), "eval/tau", 0).offer(
        30, {"eval/tau": 3.0}, make_drafter(tiny_qwen)
    )
    keep = BestCheckpoint(str(tmp_path), "eval/chat/tau", resumed_step=40)
    with pytest.raises(ValueError, match="names no set"):  # a refused figure removes nothing
        keep.start(["eval/"])
    assert keep.value is None and (tmp_path / "checkpoints" / "best").is_dir()
    assert keep.start(["eval/code/", "eval/chat/"]).startswith("best: removed ")
    assert not (tmp_path / "checkpoints" / "best").exists()
    assert keep.offer(50, {"eval/chat/tau": 1.5}, make_drafter(tiny_qwen))


def test_a_non_finite_figure_is_never_kept(tiny_qwen, tmp_path):
    keep = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=0)
    assert not keep.offer(10, {"eval/tau": float("nan")}, make_drafter(tiny_qwen))
    assert keep.value is None and not (tmp_path / "checkpoints").exists()
    assert keep.offer(20, {"eval/tau": 1.5}, make_drafter(tiny_qwen))
    assert not keep.offer(30, {"eval/tau": float("inf")}, make_drafter(tiny_qwen))
    assert keep.step == 20


def test_the_figure_must_name_one_of_the_eval_sets(tmp_path):
    """Checked when the loop starts (a resume whose eval.sets dropped the set stops there)."""
    assert BestCheckpoint(str(tmp_path), "eval/tau", 0).start(["eval/"]) is None
    BestCheckpoint(str(tmp_path), "eval/chat/tau@4", 0).start(["eval/code/", "eval/chat/"])
    with pytest.raises(ValueError, match="names no set of this run's eval .*eval/code/"):
        BestCheckpoint(str(tmp_path), "eval/chat/tau", 0).start(["eval/code/"])
    with pytest.raises(ValueError, match="names no set"):  # a set's figure, unnamed-set run
        BestCheckpoint(str(tmp_path), "eval/chat/tau", 0).start(["eval/"])


def test_a_failed_write_leaves_the_previous_best_whole(tiny_qwen, tmp_path, monkeypatch):
    keep = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=0)
    d1 = _scaled(tiny_qwen, 1.0)
    keep.offer(10, {"eval/tau": 2.0}, d1)
    before = _weights(tmp_path / "checkpoints" / "best")

    def broken(path, drafter, manifest=True):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "model.safetensors"), "w").write("half")
        raise OSError("disk full")

    monkeypatch.setattr(best_mod, "save_drafter", broken)
    with pytest.raises(OSError, match="disk full"):
        keep.offer(20, {"eval/tau": 3.0}, _scaled(tiny_qwen, 2.0))
    path = tmp_path / "checkpoints" / "best"
    assert read_manifest(str(path))["run"]["step"] == 10 and verify_manifest(str(path))
    after = _weights(path)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["best"]


def test_a_kill_between_the_two_renames_loses_no_best(tiny_qwen, tmp_path):
    """Killed after the old `best` was moved aside and before the new one took its place: the
    next start puts the old one back; an old copy beside a whole `best` is removed."""
    BestCheckpoint(str(tmp_path), "eval/tau", 0).offer(
        10, {"eval/tau": 2.0}, make_drafter(tiny_qwen)
    )
    ck = tmp_path / "checkpoints"
    os.replace(ck / "best", ck / ".best.old4242")
    keep = BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=20)
    assert (keep.value, keep.step) == (2.0, 10) and verify_manifest(str(ck / "best"))
    (ck / ".best.old4343").mkdir()
    BestCheckpoint(str(tmp_path), "eval/tau", resumed_step=20)
    assert sorted(os.listdir(ck)) == ["best"]


@pytest.mark.parametrize(
    "over,match",
    [
        (["train.keep_best=tau"], r"train.keep_best='tau' is not an in-loop eval figure"),
        (["train.keep_best=eval/tau", "eval.enabled=false"], "needs the in-loop eval"),
        (["train.keep_best=eval/code/num_rounds"], "is a count, not a score"),
    ],
)
def test_bad_keep_best_settings_are_refused(over, match):
    from dflash.run.cli import run_config

    with pytest.raises(ValueError, match=match):
        run_config(over)
