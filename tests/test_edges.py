"""Edges that crashed or cost memory: micro-batches without labels, the lm_head dtype in the
loss, eval prompts that overlap training prompts, resuming on fewer GPUs, interrupted saves."""

import json
import os

import pytest
import torch
from conftest import CONF

from dflash.config import TrainConfig
from dflash.data.batch import TargetBatch
from dflash.train.step import DrafterTrainer, Heads


def _compose(tmp_path, over):
    from hydra import compose, initialize_config_dir

    from dflash.run.cli import setup, typed

    setup()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return typed(compose("config", overrides=over))


def test_one_token_responses_train_and_are_counted(tmp_path):
    """Every sample has a one-token response (prompt of max_length-1 tokens): no anchor, no
    label. With micro_batch_size=1 each micro-batch is empty; training runs on and logs them."""
    from dflash.train.colocated import run_colocated

    cfg = _compose(
        tmp_path,
        [
            "train.steps=3",
            "train.micro_batch_size=1",
            "train.grad_accum=2",
            "train.log_every=1",
            "train.save_every=1000",
            "data.num_samples=4",
            "data.prompt_len=12",
            "data.max_length=13",
            "data.response_len=4",
            "eval.enabled=false",
            "logger=console",
            f"out_root={tmp_path}",
            f"data.cache_dir={tmp_path}/cache",
        ],
    )
    out = run_colocated(cfg, str(tmp_path / "run"))
    assert out["train/empty_micro_batches"] == 2 and out["train/labels"] == 0
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    counts = [r["train/empty_micro_batches"] for r in rows if "train/empty_micro_batches" in r]
    assert counts == [2.0, 2.0, 2.0]


def _tiny_trainer(dtype="float32", head_dtype=torch.float32, **over):
    from test_drafter import _drafter

    d = _drafter(window=64, block_size=4)
    g = torch.Generator().manual_seed(3)
    emb = torch.nn.Embedding(512, 128).to(head_dtype)
    head = torch.nn.Linear(128, 512, bias=False).to(head_dtype)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(512, 128, generator=g))
        head.weight.copy_(torch.randn(512, 128, generator=g) * 0.1)
    cfg = TrainConfig(max_anchors=6, lr=1e-2, dtype=dtype, lm_head_chunk=5, **over)
    return DrafterTrainer(d, Heads(emb, head), cfg, torch.device("cpu"))


def _batch(T=20, P=6, seed=0, response=True):
    g = torch.Generator().manual_seed(seed)
    lm = torch.zeros(1, T, dtype=torch.bool)
    if response:
        lm[0, P:] = True
    else:
        lm[0, T - 1] = True  # a one-token response: no anchor
    return TargetBatch(
        torch.randint(0, 500, (1, T), generator=g),
        torch.arange(T)[None],
        torch.zeros(1, T, dtype=torch.long),
        lm,
        torch.tensor([seed]),
        [seed],
        aux_NTF=torch.randn(1, T, 384, generator=g),
        next_token_NT=torch.randint(0, 500, (1, T), generator=g),
    )


def test_empty_micro_batch_keeps_accumulation_exact():
    """[empty, full] micro-batches give the step of [full] alone: the empty one adds nothing to
    the sum or the global weight sum, but still runs its forward/backward."""
    a, b = _tiny_trainer(), _tiny_trainer()
    ma = a.train_step([_batch(seed=1, response=False), _batch(seed=2)])
    mb = b.train_step([_batch(seed=2)])
    assert ma["train/empty_micro_batches"] == 1 and mb["train/empty_micro_batches"] == 0
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], rel=1e-6)
    for (k, x), y in zip(a.drafter.named_parameters(), b.drafter.parameters()):
        assert torch.allclose(x, y, atol=1e-7), k


def test_loss_uses_the_lm_head_in_its_own_dtype():
    """bf16 head under bf16 autocast: no fp32 [V, H] copy of the head weight is ever made (it is
    5 GB at 27B scale), forward or backward; the loss equals the fp32 computation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.copies = shape, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    if tuple(t.shape) in (self.shape, self.shape[::-1]):
                        self.copies.append(str(func))
            return out

    tr = _tiny_trainer(dtype="bfloat16", head_dtype=torch.bfloat16)
    tb = _batch(seed=4)
    prep = tr.prepare(tb, 0)
    with Watch(tuple(tr.heads.lm_head.weight.shape)) as w:
        loss, _ = tr.forward_sums(tb, prep)
        loss.backward()
    assert w.copies == [], w.copies
    # fp32 reference of the same step: fp32 head and compute
    ref = _tiny_trainer(dtype="float32", head_dtype=torch.float32)
    ref.heads.lm_head.weight.data.copy_(tr.heads.lm_head.weight.float())
    ref.heads.embed.weight.data.copy_(tr.heads.embed.weight.float())
    loss32, _ = ref.forward_sums(tb, ref.prepare(tb, 0))
    assert float(loss.detach()) == pytest.approx(float(loss32.detach()), rel=2e-2)


def _jsonl(path, prompts):
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return str(path)


def test_eval_paths_overlapping_training_prompts_are_refused(tmp_path):
    from dflash.eval.sets import heldout_text_prompts

    train = _jsonl(tmp_path / "train.jsonl", [f"train prompt {i}" for i in range(10)])
    held = _jsonl(tmp_path / "held.jsonl", [f"held prompt {i}" for i in range(10)])
    base = ["data=jsonl", f"data.paths=[{train}]", "data.num_samples=10", "eval.num_prompts=4"]
    cfg = _compose(tmp_path, base + [f"eval.paths=[{train}]"])
    with pytest.raises(ValueError, match="eval.paths.*data.paths") as e:
        heldout_text_prompts(cfg)
    assert "\n" not in str(e.value)
    ok = heldout_text_prompts(_compose(tmp_path, base + [f"eval.paths=[{held}]"]))
    assert ok == [f"held prompt {i}" for i in range(4)]


def test_published_drafter_eval_prompts_need_no_training_size(tmp_path):
    """The README's command for a published drafter (`data=jsonl data.paths=[...]`, jsonl.yaml's
    num_samples=800000): the rows are the eval prompts, not 'training rows' to skip."""
    from dflash.eval.sets import heldout_text_prompts

    rows = _jsonl(tmp_path / "prompts.jsonl", [f"p{i}" for i in range(6)])
    cfg = _compose(tmp_path, ["data=jsonl", f"data.paths=[{rows}]", "eval.num_prompts=4"])
    assert cfg.data.num_samples == 800000
    with pytest.raises(ValueError, match="no held-out prompts left"):
        heldout_text_prompts(cfg)  # our own run's semantics: every row is a training row
    assert heldout_text_prompts(cfg, exclude_training=False) == ["p0", "p1", "p2", "p3"]


def test_eval_cli_treats_a_checkpoint_without_run_config_as_published(tmp_path, monkeypatch):
    from test_drafter import _drafter

    import dflash.eval.cli as ec
    from dflash.drafter.checkpoint import save_drafter

    save_drafter(str(tmp_path / "pub"), _drafter())
    seen = {}

    class Stop(Exception):
        pass

    def fake_build(rc, target, cache_dir, log=print, exclude_training=True, read_dirs=()):
        seen["exclude_training"], seen["read_dirs"] = exclude_training, read_dirs
        raise Stop

    monkeypatch.setattr(ec, "build_eval_set", fake_build)
    monkeypatch.setattr(ec, "_target_for", lambda rc, spec: None)
    rc = _compose(tmp_path, [f"ckpt={tmp_path / 'pub'}"])
    with pytest.raises(Stop):
        ec.run_eval(rc, str(tmp_path / "out"), [])
    assert seen == {"exclude_training": False, "read_dirs": ()}  # no run: no run cache


def test_resume_restores_only_this_devices_cuda_rng(monkeypatch):
    """An 8-GPU checkpoint resumed with 2 visible GPUs: this rank's device gets its own state,
    devices that do not exist are not touched (the saved list no longer raises IndexError)."""
    import dflash.train.resume as ck

    calls = []

    def fake_set(state, device="cuda"):
        idx = device if isinstance(device, int) else torch.device(device).index or 0
        if idx >= 2:
            raise IndexError(f"device {idx} does not exist")
        calls.append((idx, int(state[0])))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake_set)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", fake_set)
    st = {
        "torch": torch.get_rng_state(),
        "python": __import__("random").getstate(),
        "numpy": __import__("numpy").random.get_state(),
        "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)],
    }
    ck._set_rng_state(st)
    assert calls == [(1, 1)]


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from test_drafter import _drafter

    import dflash.train.resume as ck

    d = _drafter()
    prev = ck.save_checkpoint(str(tmp_path), 2, d, {"x": 1})
    before = {k: v.clone() for k, v in ck.load_drafter(prev)[0].state_dict().items()}
    with torch.no_grad():
        d.fc.weight.add_(1.0)
    real_save = torch.save

    def crash(obj, path, *a, **k):  # the serving weights are on disk, the state write dies
        real_save({"partial": True}, path)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ck.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(str(tmp_path), 4, d, {"x": 1})
    monkeypatch.setattr(ck.torch, "save", real_save)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    assert ck.find_checkpoint(str(tmp_path)) == prev
    after = ck.load_drafter(ck.find_checkpoint(str(tmp_path)))[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    state = torch.load(os.path.join(prev, ck.STATE_FILE), weights_only=False)
    assert state["step"] == 2


def test_greedy_agreement_counts_response_tokens_within_their_sample():
    """TargetBatch.greedy_agreement against a loop over packed rows: a response token counts
    when it follows a token of its own sample, and hits when it is the target's greedy token
    after it; padding and prompts never count."""
    from dflash.data.batch import Sample, collate

    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (L, P) in enumerate([(9, 3), (5, 2), (12, 4), (6, 5)]):
        mask = torch.zeros(L, dtype=torch.bool)
        mask[P:] = True
        samples.append(Sample(i, torch.randint(0, 6, (L,), generator=g), mask))
    tb = collate(samples, pack_to=16)
    N, T = tb.input_ids_NT.shape
    nxt = torch.randint(0, 6, (N, T), generator=g)
    tb = TargetBatch(*(getattr(tb, f) for f in tb.__dataclass_fields__), next_token_NT=nxt)
    hits = total = 0
    for r in range(N):
        for t in range(1, T):
            seg = tb.segment_ids_NT[r]
            if tb.loss_mask_NT[r, t] and seg[t] == seg[t - 1] and seg[t] >= 0:
                total += 1
                hits += int(nxt[r, t - 1] == tb.input_ids_NT[r, t])
    assert total == sum(int(s.loss_mask.sum()) for s in samples)  # none of them starts a row
    assert tb.greedy_agreement().tolist() == [hits, total] and 0 < hits < total


def test_text_the_target_would_not_write_is_measured_and_warned_about(tmp_path, capsys):
    """data.answers=given with answers the target did not write: the first step says how many
    response tokens are its greedy tokens and warns; regenerated answers agree to the token."""
    from dflash.train.colocated import run_colocated

    rows = [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": f"Say something about {i}."},
                {"role": "assistant", "content": f"Here is a sentence about {i}, not mine."},
            ],
        }
        for i in range(8)
    ]
    f = tmp_path / "given.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [
        "target=tiny_llama",
        "data.source=jsonl",
        f"data.paths=[{f}]",
        "data.num_samples=8",
        "data.max_length=96",
        "train.steps=2",
        "train.micro_batch_size=4",
        "train.log_every=1",
        "eval.enabled=false",
        "logger=console",
        f"out_root={tmp_path}",
        f"data.cache_dir={tmp_path}/cache",
    ]
    out = run_colocated(_compose(tmp_path, base + ["data.answers=given"]), str(tmp_path / "given"))
    log = capsys.readouterr().out
    assert "data: regenerating" not in log  # nothing reached the target's decoder
    assert out["train/greedy_agreement"] < 0.5
    assert "of its response tokens are the target's greedy tokens" in log
    assert "warning: only" in log and "were the answers generated by this target" in log
    out = run_colocated(_compose(tmp_path, base), str(tmp_path / "regen"))
    log = capsys.readouterr().out
    assert out["train/greedy_agreement"] == 1.0
    assert "100.00% of its response tokens" in log and "warning: only" not in log
