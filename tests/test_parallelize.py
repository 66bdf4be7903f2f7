"""train.dist=fsdp and deepspeed give the weights DDP (and one process over the whole batch)
gives: 2 ranks over gloo on CPU, gradient accumulation 2, a few steps."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import assert_same_adam_steps

from dflash.tools.testing import rank_env

MODES = [("ddp", 1), ("fsdp", 1), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]
STEPS = 3


def _micro(target, rank, world):
    """STEPS steps x 2 micro-batches of 4 samples; rank r takes its half of each micro-batch."""
    from test_training import _samples

    from dflash.data.batch import collate, target_forward

    s = _samples(target, n=8 * STEPS)
    out = []
    for step in range(STEPS):
        micro = []
        for m in range(2):
            chunk = s[(2 * step + m) * 4 : (2 * step + m + 1) * 4]
            mine = chunk[rank * 4 // world : (rank + 1) * 4 // world]
            micro.append(target_forward(target, collate(mine)))
        out.append(micro)
    return out


def _trainer(target, mode, stage, world, group, dtype="float32"):
    from conftest import make_drafter

    from dflash.config import TrainConfig
    from dflash.target.shape import Heads
    from dflash.train.step import DrafterTrainer

    cfg = TrainConfig(
        steps=10,
        max_anchors=6,
        lr=1e-2,
        grad_accum=2,
        dist=mode,
        zero_stage=stage,
        micro_batch_size=4 // world,
        dtype=dtype,
    )
    return DrafterTrainer(
        make_drafter(target),
        Heads(target.embed_tokens, target.lm_head),
        cfg,
        torch.device("cpu"),
        dp_group=group,
    )


def _weights(tr) -> dict:
    return {k: v.detach().clone() for k, v in tr.drafter_for_io().state_dict().items()}


def _train(mode, stage, rank, world, group):
    from conftest import get_target

    target = get_target("tiny_qwen3_5")
    tr = _trainer(target, mode, stage, world, group)
    for micro in _micro(target, rank, world):
        tr.train_step(micro)
    return _weights(tr)


def _rank(rank, world, port, out_dir):
    rank_env(rank, world, port)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for mode, stage in MODES:
        if mode == "deepspeed" and not _has_deepspeed():
            continue
        results[f"{mode}{stage}"] = _train(mode, stage, rank, world, dist.group.WORLD)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "weights.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _has_deepspeed():
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_fsdp_and_deepspeed_equal_ddp_and_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "weights.pt")
    ref = _train("ddp", 1, 0, 1, None)  # one process, the whole batch
    start = _train_zero_steps()
    print("modes compared with one process:", sorted(got))
    assert set(got) >= {"ddp1", "fsdp1"}
    if os.environ.get("CI"):  # .ci/run installs the deepspeed extra: every stage must run there
        assert {"deepspeed1", "deepspeed2", "deepspeed3"} <= set(got)
    for name, weights in got.items():
        assert_same_adam_steps(weights, ref, name)
    assert any(not torch.equal(ref[k], start[k]) for k in ref)  # the steps changed the weights


def _train_zero_steps():
    from conftest import get_target, make_drafter

    return make_drafter(get_target("tiny_qwen3_5")).state_dict()


def _bf16_rank(rank, port, out_dir):
    """One rank: the DeepSpeed trainer with bf16 autocast (the GPU setting) against the plain
    trainer, both in bf16 compute with fp32 master weights."""
    rank_env(0, 1, port)
    import torch.distributed as dist
    from conftest import get_target

    dist.init_process_group("gloo", rank=0, world_size=1)
    target = get_target("tiny_qwen3_5")
    micro = _micro(target, 0, 1)
    out = {}
    for mode, stage, group in [
        ("ddp", 1, None),
        ("deepspeed", 1, dist.group.WORLD),
        ("deepspeed", 3, dist.group.WORLD),
    ]:
        tr = _trainer(target, mode, stage, 1, group, dtype="bfloat16")
        assert tr.dtype == torch.bfloat16
        if mode == "deepspeed":  # the engine keeps the autocast on (on CPU it never turns it
            # off: it checks the CUDA autocast state; on the GPU it did), grads reduced in fp32
            eng = tr.par.engine
            assert eng.torch_autocast_enabled() and eng.torch_autocast_dtype() == torch.bfloat16
            assert eng.torch_autocast_lower_precision_safe_modules() == []
        losses = [tr.train_step(m)["train/loss"] for m in micro]
        out[f"{mode}{stage}"] = (losses, _weights(tr))
    torch.save(out, os.path.join(out_dir, "bf16.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_deepspeed_trains_under_bf16_autocast_like_the_plain_trainer(tmp_path):
    """DeepSpeed's engine turns an outer CUDA torch.autocast off unless its own torch_autocast is
    on: without it the fp32 drafter met the bf16 features on the H200 ('expected mat1 and mat2 to
    have the same dtype'). Here: the engine's autocast is configured, and the bf16 DeepSpeed
    trainer trains as the plain one does."""
    if not _has_deepspeed():
        pytest.skip("deepspeed not installed (pip install 'dflash[deepspeed]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_bf16_rank, args=(port, str(tmp_path)), nprocs=1, join=True)
    got = torch.load(tmp_path / "bf16.pt")
    ref_losses, ref = got.pop("ddp1")
    start = _train_zero_steps()
    for name, (losses, weights) in got.items():
        torch.testing.assert_close(losses, ref_losses, atol=1e-3, rtol=1e-3, msg=name)
        # bf16 rounding differs in order, and Adam turns near-zero gradients into lr-sized
        # steps: compare the weight updates as a whole, not elementwise
        diff = sum((weights[k].float() - ref[k].float()).pow(2).sum() for k in ref).sqrt()
        update = sum((ref[k].float() - start[k].float()).pow(2).sum() for k in ref).sqrt()
        assert diff / update < 0.05, f"{name}: update differs by {diff / update:.3f} of its norm"


RESUME_MODES = [("fsdp", 1), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]


def _resume_rank(rank, world, port, root):
    """Per mode: an uninterrupted 6-step run, a run that dies after step 5 (its last checkpoint
    is step 4), and its resume to step 6, all on 2 ranks with their sharded optimizer state."""
    from pathlib import Path

    from test_training import _run_cfg

    from dflash.common.comm import init_distributed
    from dflash.train.colocated import run_colocated

    rank_env(rank, world, port, DFLASH_RUN_ID="resume")
    ctx = init_distributed("gloo", 120, 120)
    for mode, stage in RESUME_MODES:
        if mode == "deepspeed" and not _has_deepspeed():
            continue
        d, over = Path(root) / f"{mode}{stage}", dict(dist=mode, zero_stage=stage)
        run_colocated(_run_cfg(d, 6, **over), str(d / "full"), ctx=ctx)
        run_colocated(_run_cfg(d, 6, **over), str(d / "part"), stop_at=5, ctx=ctx)
        run_colocated(_run_cfg(d, 6, resume=str(d / "part"), **over), str(d / "part"), ctx=ctx)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_and_deepspeed_runs_resume_to_the_uninterrupted_weights(tmp_path):
    """Each rank's part of the optimizer state is saved with every checkpoint (fsdp: torch
    distributed checkpoint; ZeRO: DeepSpeed's own) and read back: the resumed run ends with the
    fp32 master weights of the uninterrupted one, bit for bit."""
    from test_training import _master

    from dflash.tools.testing import free_port

    mp.spawn(_resume_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ran = sorted(p.name for p in tmp_path.iterdir())
    print("modes resumed:", ran)
    assert "fsdp1" in ran
    if os.environ.get("CI"):  # .ci/run installs the deepspeed extra: every stage must run there
        assert {"deepspeed1", "deepspeed2", "deepspeed3"} <= set(ran)
    for name in ran:
        ck = tmp_path / name / "part" / "checkpoints"
        assert (ck / "step_00000004" / "optimizer").is_dir()  # each rank's part, in the step dir
        a = _master(tmp_path / name / "full" / "checkpoints" / "step_00000006")
        b = _master(ck / "step_00000006")
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k, (a[k] - b[k]).abs().max())
        c = _master(ck / "step_00000004")
        assert not torch.equal(c["fc.weight"], a["fc.weight"])  # the resume had steps to redo
