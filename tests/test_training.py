"""Training guarantees: exact gradient accumulation, clean labels under noise, loss math,
save -> resume -> continue equals an uninterrupted run."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter

from dflash.config import TrainConfig
from dflash.data.batch import Sample, add_input_noise, collate, target_forward
from dflash.target.shape import Heads
from dflash.train.losses import position_weights, weighted_ce_sum
from dflash.train.step import DrafterTrainer


def _samples(target, n=4, L=20, P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, target.vocab_size - 1, (L + i,), generator=g)
        lm = torch.zeros(L + i, dtype=torch.bool)
        lm[P:] = True
        out.append(Sample(i, ids, lm))
    return out


def _trainer(target, drafter, **over):
    cfg = TrainConfig(steps=10, max_anchors=6, lr=1e-2, **over)
    return DrafterTrainer(
        drafter, Heads(target.embed_tokens, target.lm_head), cfg, torch.device("cpu")
    )


def _grads(trainer, micro):
    trainer.opt.zero_grad(set_to_none=True)
    prepared = [trainer.prepare(tb, 0) for tb in micro]
    denom = sum(p.weights_NAK.sum() for p in prepared)
    for tb, p in zip(micro, prepared):
        (trainer.forward_sums(tb, p)[0] / denom).backward()
    return {k: v.grad.clone() for k, v in trainer.drafter.named_parameters()}


def _step_grads(trainer, micro) -> dict:
    """The gradients the trainer's own step hands to the optimizer (read just before it)."""
    grads, real_step = {}, trainer.par.step

    def spy():
        grads.update({k: v.grad.clone() for k, v in trainer.drafter.named_parameters()})
        return real_step()

    trainer.par.step = spy
    trainer.train_step(micro)
    return grads


def test_grad_accumulation_equals_one_big_batch(tiny_qwen):
    """Through the trainer's step: micro-batches of 1, 2 and 1 samples (different label counts)
    give the gradient of one batch of all 4, and that gradient is sum(w * CE) / sum(w) over the
    whole batch (computed here without the trainer's step)."""
    import copy

    s = _samples(tiny_qwen)
    drafter = make_drafter(tiny_qwen)
    big = [target_forward(tiny_qwen, collate(s))]
    small = [
        target_forward(tiny_qwen, collate(s[:1])),
        target_forward(tiny_qwen, collate(s[1:3])),
        target_forward(tiny_qwen, collate(s[3:])),
    ]
    labels = [float(_trainer(tiny_qwen, drafter).prepare(tb, 0).weights_NAK.sum()) for tb in small]
    assert len(set(labels)) > 1  # a per-micro-batch denominator would weigh them differently
    g_big = _step_grads(_trainer(tiny_qwen, copy.deepcopy(drafter)), big)
    g_small = _step_grads(_trainer(tiny_qwen, copy.deepcopy(drafter)), small)
    g_ref = _grads(_trainer(tiny_qwen, copy.deepcopy(drafter)), big)
    for k in g_big:
        assert torch.allclose(g_big[k], g_small[k], atol=1e-6, rtol=1e-4), k
        assert torch.allclose(g_big[k], g_ref[k], atol=1e-6, rtol=1e-4), k
    assert any(g.abs().sum() > 0 for g in g_big.values())


def test_train_step_accumulation_matches_big_batch(tiny_qwen):
    """Same through the full step (clip, AdamW): two micro-batches == one batch."""
    s = _samples(tiny_qwen)
    d1, d2 = make_drafter(tiny_qwen), make_drafter(tiny_qwen)
    t1, t2 = _trainer(tiny_qwen, d1), _trainer(tiny_qwen, d2)
    m1 = t1.train_step([target_forward(tiny_qwen, collate(s))])
    m2 = t2.train_step(
        [target_forward(tiny_qwen, collate(s[:2])), target_forward(tiny_qwen, collate(s[2:]))]
    )
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-5)
    # Adam's first update is ~lr * sign(g): compare the updates, with the tolerance that rounding
    # in g can flip for entries whose gradient is ~0.
    for (k, a), b in zip(d1.named_parameters(), d2.parameters()):
        frac_bad = ((a - b).abs() > 1e-6).float().mean().item()
        assert frac_bad < 1e-3, (k, frac_bad, (a - b).abs().max().item())


def test_noise_never_touches_labels(tiny_qwen):
    s = _samples(tiny_qwen)
    tb = target_forward(tiny_qwen, collate(s))
    clean_labels, clean_aux = tb.next_token_NT.clone(), tb.aux_NTF.clone()
    noisy = add_input_noise(tb, 0.5, torch.Generator().manual_seed(0))
    # values, against copies taken before: the batches share tensors (dataclasses.replace)
    assert torch.equal(noisy.next_token_NT, clean_labels)
    assert torch.equal(tb.aux_NTF, clean_aux) and not torch.allclose(noisy.aux_NTF, clean_aux)
    tr = _trainer(tiny_qwen, make_drafter(tiny_qwen), noise_std=0.5)
    with pytest.raises(ValueError, match="clean target forward"):
        tr.prepare(noisy, 0)
    # a noised training step leaves the batch's labels (and clean aux) as they were
    tr.train_step([tb])
    assert torch.equal(tb.next_token_NT, clean_labels) and torch.equal(tb.aux_NTF, clean_aux)
    # labels are the clean target's greedy tokens: next_token[a+k-1]
    prep = tr.prepare(tb, 0)
    valid = prep.label_valid_NAK
    assert valid.any()
    clean = tiny_qwen.model(tb.input_ids_NT[:1, : s[0].input_ids.numel()]).logits.argmax(-1)
    assert torch.equal(tb.next_token_NT[0, : clean.shape[1]], clean[0])


def test_position_weights_and_weighted_ce():
    w = position_weights(16)
    assert w.shape == (15,) and w[0] == 1 and torch.allclose(w[7], torch.exp(torch.tensor(-1.0)))
    assert position_weights(8)[4] == pytest.approx(float(torch.exp(torch.tensor(-1.0))))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 8, generator=g, requires_grad=True)
    W = torch.randn(11, 8, generator=g)
    y = torch.randint(0, 11, (37,), generator=g)
    wt = torch.rand(37, generator=g)
    s, _ = weighted_ce_sum(h, W, y, wt, chunk=5)
    ref = (F.cross_entropy(h @ W.t(), y, reduction="none") * wt).sum()
    assert torch.allclose(s, ref, atol=1e-5)
    (gh,) = torch.autograd.grad(s, h)
    (gr,) = torch.autograd.grad(ref, h)
    assert torch.allclose(gh, gr, atol=1e-5)


def _run_cfg(tmp_path, steps, resume=None, **train):
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from dflash.run.cli import setup, typed

    setup()
    over = [
        f"train.steps={steps}",
        "train.save_every=2",
        "train.eval_every=1000",
        "train.log_every=1",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.max_anchors=6",
        "data.num_samples=8",
        "data.response_len=12",
        "eval.enabled=false",
        "logger=none",
        f"out_root={tmp_path}",
        f"data.cache_dir={tmp_path}/cache",
        "train.noise_std=0.1",
        "train.keep_last=5",
    ]
    over += [f"train.{k}={v}" for k, v in train.items()]
    if resume:
        over.append(f"resume={resume}")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return typed(compose("config", overrides=over))


def test_resume_equals_uninterrupted(tmp_path):
    from dflash.train.colocated import run_colocated

    full = _run_cfg(tmp_path, 6)
    run_colocated(full, str(tmp_path / "full"))
    run_colocated(_run_cfg(tmp_path, 6), str(tmp_path / "part"), stop_at=4)  # an interrupted run
    # a fresh process would see steps=6 and resume from step 4 of the partial run
    cont = _run_cfg(tmp_path, 6, resume=str(tmp_path / "part" / "checkpoints" / "step_00000004"))
    out = run_colocated(cont, str(tmp_path / "cont"))
    # the fp32 master weights (what training continues from), not the bf16 serving copy
    a = _master(tmp_path / "full" / "checkpoints" / "step_00000006")
    b = _master(out["checkpoint"])
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-7), (k, (a[k] - b[k]).abs().max())
    # and the stop point differs from the end point (the test is not vacuous)
    c = _master(tmp_path / "part" / "checkpoints" / "step_00000004")
    assert not torch.allclose(c["fc.weight"], a["fc.weight"])


def _master(step_dir) -> dict:
    from dflash.common.layout import STATE_FILE

    return torch.load(os.path.join(step_dir, STATE_FILE), weights_only=False)["drafter_fp32"]


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_colocated_bad_sample_is_reported_at_the_log_step(tmp_path, monkeypatch, policy):
    """A non-finite aux state in the colocated loop (screened without a per-step sync): skip
    trains on and counts the sample in pipe/bad_samples; stop ends the run naming it."""
    import dflash.train.build as build
    from dflash.train.colocated import run_colocated

    real = build.target_forward
    calls = []

    def poisoned(target, batch, with_final_hidden=False):
        tb = real(target, batch, with_final_hidden)
        calls.append(1)
        if len(calls) == 2:  # the second micro-batch: one position of its first sample
            first = tb.segment_ids_NT == 0
            tb.aux_NTF[first.nonzero()[0].tolist()] = float("nan")
        return tb

    monkeypatch.setattr(build, "target_forward", poisoned)
    cfg = _run_cfg(tmp_path, 2, log_every=2)
    cfg.topology.on_bad_batch = policy
    if policy == "stop":
        with pytest.raises(build.BadBatchError, match="non-finite target aux states in samples"):
            run_colocated(cfg, str(tmp_path / "run"))
        return
    out = run_colocated(cfg, str(tmp_path / "run"))
    assert out["pipe/bad_samples"] == 1 and math.isfinite(out["train/loss"])


def test_labels_picked_on_the_host_select_what_the_boolean_mask_selects(tiny_qwen):
    """prepare() picks anchors and labelled positions from the batch's host copy (no device
    read): its index selection equals boolean-mask indexing of the block outputs, and a batch
    without its host copy (e.g. streamed from a worker) gets the same anchors."""
    import dataclasses

    s = _samples(tiny_qwen, n=5)
    tb = target_forward(tiny_qwen, collate(s, pack_to=50))
    assert tb.host is not None and tb.segment_ids_NT.unique().numel() > 2  # packed rows
    tr = _trainer(tiny_qwen, make_drafter(tiny_qwen))
    p = tr.prepare(tb, 3)
    N, A = p.blocks.anchors_NA.shape
    B = tr.spec.block_size
    assert p.num_labels == int(p.label_valid_NAK.sum()) > 0
    assert torch.equal(p.select(p.labels_NAK), p.labels_NAK[p.label_valid_NAK])
    h = torch.randn(N, A * B, 7)
    assert torch.equal(
        h.reshape(N * A * B, -1).index_select(0, p.hidden_index_M),
        h.view(N, A, B, -1)[:, :, 1:][p.label_valid_NAK],
    )
    q = tr.prepare(dataclasses.replace(tb, host=None), 3)
    assert torch.equal(q.blocks.anchors_NA, p.blocks.anchors_NA)
    assert torch.equal(q.weights_NAK, p.weights_NAK)


def test_sample_dropped_after_the_host_copy_weighs_nothing(tiny_qwen):
    """A deferred screen zeroes a bad sample's loss mask on the device after the host copy was
    taken: its labels get zero weight, the others keep theirs, and the step stays finite."""
    from dflash.train.build import screen_batch

    s = _samples(tiny_qwen, n=4)
    tb = target_forward(tiny_qwen, collate(s))
    tr = _trainer(tiny_qwen, make_drafter(tiny_qwen))
    clean = tr.prepare(tb, 0)
    tb.aux_NTF[1, 3, 0] = float("nan")  # sample 1 (row 1) goes bad
    out, pending = screen_batch(tb, "skip", defer=True)
    p = tr.prepare(out, 0)
    assert torch.equal(p.blocks.anchors_NA, clean.blocks.anchors_NA)  # chosen on the host
    assert p.weights_NAK[1].sum() == 0 and clean.weights_NAK[1].sum() > 0
    assert torch.equal(p.weights_NAK[[0, 2, 3]], clean.weights_NAK[[0, 2, 3]])
    m = tr.train_step([out])
    assert math.isfinite(m["train/loss"]) and pending.read() == [1]


def test_interval_counts_sum_every_step_since_the_last_read(tiny_qwen):
    """step_async leaves the figures on the device; interval_counts() sums the tokens and labels
    of every step since it was last called (the loop's tokens/s over a log interval)."""
    s = _samples(tiny_qwen)
    tr = _trainer(tiny_qwen, make_drafter(tiny_qwen))
    figs = [tr.step_async([target_forward(tiny_qwen, collate(s[i : i + 2]))]) for i in (0, 1, 2)]
    read = [f.read() for f in figs]
    got = tr.interval_counts()
    assert got["tokens"] == sum(r["train/tokens"] for r in read) > 0
    assert got["labels"] == sum(r["train/labels"] for r in read) > 0
    assert tr.interval_counts() == {"tokens": 0.0, "labels": 0.0}
    assert all(
        r["train/tokens"] == sum(x.input_ids.numel() for x in s[i : i + 2])
        for i, r in enumerate(read)
    )


def test_overlapped_capture_trains_on_the_same_batches_and_resumes_exactly(tmp_path):
    """topology.overlap_capture captures each step's batches one step ahead (on a side CUDA
    stream on GPUs): the same weights as capturing in step, and a resume continues exactly."""
    from dflash.train.colocated import run_colocated

    def cfg(resume=None, overlap=True):
        c = _run_cfg(tmp_path, 6, resume=resume)
        c.topology.overlap_capture = overlap
        return c

    run_colocated(cfg(overlap=False), str(tmp_path / "base"))
    run_colocated(cfg(), str(tmp_path / "full"))
    run_colocated(cfg(), str(tmp_path / "part"), stop_at=4)
    out = run_colocated(
        cfg(str(tmp_path / "part" / "checkpoints" / "step_00000004")), str(tmp_path / "cont")
    )
    a = _master(tmp_path / "base" / "checkpoints" / "step_00000006")
    for b in (
        _master(tmp_path / "full" / "checkpoints" / "step_00000006"),
        _master(out["checkpoint"]),
    ):
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=0, atol=1e-7), (k, (a[k] - b[k]).abs().max())


def test_label_sampling_by_weight_is_unbiased_and_seeded(tiny_qwen):
    """train.label_sampling=by_weight keeps block position k's label with probability w_k / w_1
    and weighs a kept label w_k / p_k: per position the keep rate matches p_k, the expected
    loss weight is the full weight (so the expected loss and gradient are the full ones), the
    denominator is unchanged, position 1 is always kept, and the draw is a function of the
    step and the row's sample (same on a re-run and in a smaller micro-batch)."""
    s = _samples(tiny_qwen, n=4, L=40)
    tb = target_forward(tiny_qwen, collate(s))
    drafter = make_drafter(tiny_qwen)
    full, tr = (
        _trainer(tiny_qwen, drafter),
        _trainer(tiny_qwen, drafter, label_sampling="by_weight"),
    )
    p_k = tr.keep_p_k
    assert p_k[0] == 1 and torch.all(p_k[1:] < p_k[:-1])
    n, kept, real, lw_sum, w_full, loss, ref_loss = 300, 0, 0, 0, 0, 0.0, 0.0
    with torch.no_grad():
        for step in range(n):
            p, ref = tr.prepare(tb, step), full.prepare(tb, step)  # the same anchors
            assert torch.equal(p.weights_NAK, ref.weights_NAK)  # the denominator is unchanged
            mask = torch.zeros(p.labels_NAK.numel(), dtype=torch.bool)
            mask[p.label_index_M] = True
            mask = mask.view_as(p.label_valid_NAK)
            assert not (mask & ~ref.label_valid_NAK).any()  # only real labels are kept
            assert mask[..., 0].equal(ref.label_valid_NAK[..., 0])  # position 1: always
            assert torch.allclose(p.loss_weights_NAK * p_k, p.weights_NAK)
            kept = kept + mask.float().sum((0, 1))
            real = real + ref.label_valid_NAK.float().sum((0, 1))
            lw_sum = lw_sum + (p.loss_weights_NAK * mask).sum((0, 1))
            w_full = w_full + ref.weights_NAK.sum((0, 1))
            loss += float(tr.forward_sums(tb, p)[0])
            ref_loss += float(full.forward_sums(tb, ref)[0])
    rate = kept / real
    assert torch.all((rate - p_k).abs() <= 4 * (p_k * (1 - p_k) / real).sqrt() + 1e-6)
    assert torch.allclose(lw_sum, w_full, rtol=0.05)
    assert loss == pytest.approx(ref_loss, rel=0.02)
    # seeded per step and per sample: the same step draws the same labels, in any grouping
    a, b = tr.prepare(tb, 7), tr.prepare(tb, 7)
    assert torch.equal(a.label_index_M, b.label_index_M)
    assert not torch.equal(a.label_index_M, tr.prepare(tb, 8).label_index_M)
    sub = tr.prepare(target_forward(tiny_qwen, collate(s[2:])), 7)
    K = a.labels_NAK.shape[-1]
    keep_a = torch.zeros(a.labels_NAK.numel(), dtype=torch.bool)
    keep_a[a.label_index_M] = True
    keep_sub = torch.zeros(sub.labels_NAK.numel(), dtype=torch.bool)
    keep_sub[sub.label_index_M] = True
    A_sub = sub.labels_NAK.shape[1]
    assert torch.equal(keep_a.view(4, -1, K)[2:, :A_sub], keep_sub.view(2, A_sub, K))
    # the trainer's step divides the kept labels' loss (weights w / p) by the weight sum of ALL
    # real labels (the expectation of the kept ones'), not by the kept labels' weights
    import copy

    stepper = _trainer(tiny_qwen, copy.deepcopy(drafter), label_sampling="by_weight")
    with torch.no_grad():
        kept_sum = float(stepper.forward_sums(tb, stepper.prepare(tb, 0))[0])
    all_w = float(full.prepare(tb, 0).weights_NAK.sum())
    assert all_w > float(
        tr.prepare(tb, 0).weights_NAK.flatten()[tr.prepare(tb, 0).label_index_M].sum()
    )
    got = stepper.train_step([tb])["train/loss"]
    assert got == pytest.approx(kept_sum / all_w, rel=1e-5)


def test_a_diverging_run_stops_naming_the_step_and_never_saves_its_weights(tmp_path, monkeypatch):
    """A NaN loss at step 3 (read at the log step 4, before that step's save): the run stops with
    one line naming step 3; step 2's checkpoint stays the newest and its weights are finite."""
    from dflash.common.layout import find_checkpoint
    from dflash.train.colocated import run_colocated

    real = DrafterTrainer.forward_sums

    def poisoned(self, tb, prepared, model=None):
        loss, correct = real(self, tb, prepared, model)
        return (loss * float("nan") if self.step == 2 else loss), correct

    monkeypatch.setattr(DrafterTrainer, "forward_sums", poisoned)
    cfg = _run_cfg(tmp_path, 8, log_every=4)
    with pytest.raises(ValueError, match=r"^step 3: the loss or the gradient norm is NaN"):
        run_colocated(cfg, str(tmp_path / "run"))
    ck = find_checkpoint(str(tmp_path / "run"))
    assert os.path.basename(ck) == "step_00000002"
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["latest", "step_00000002"]
    assert all(torch.isfinite(v).all() for v in _master(ck).values())


def test_weights_that_are_not_finite_are_never_saved(tiny_qwen, tmp_path):
    from dflash.train.resume import find_checkpoint, save_checkpoint

    d = make_drafter(tiny_qwen)
    good = save_checkpoint(str(tmp_path), 2, d, {})
    with torch.no_grad():
        d.fc.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="not saving step 4: the drafter: 1 weight tensor"):
        save_checkpoint(str(tmp_path), 4, d, {}, keep_last=1)
    assert find_checkpoint(str(tmp_path)) == good and os.path.isdir(good)  # not rotated out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000002"]


def test_steps_without_any_gradient_warn_once_per_stretch():
    from dflash.train.loop import ZERO_GRAD_STEPS, Health
    from dflash.train.step import StepFigures

    h = Health(torch.device("cpu"), lr=1e3)

    def step(n, grad_norm, loss=6.2):
        h.track(StepFigures(torch.tensor([loss, 0.0, 1.0, 1.0, 0.0, grad_norm]), 1.0), n)

    for n in range(1, ZERO_GRAD_STEPS):
        step(n, 0.0)
    assert h.check(ZERO_GRAD_STEPS - 1) is None  # one step short
    step(ZERO_GRAD_STEPS, 0.0)
    warning = h.check(ZERO_GRAD_STEPS)
    assert warning.startswith(
        f"warning: the gradient norm has been exactly 0 for the last {ZERO_GRAD_STEPS} steps"
    )
    step(ZERO_GRAD_STEPS + 1, 0.0)
    assert h.check(ZERO_GRAD_STEPS + 1) is None  # said once for the stretch
    step(ZERO_GRAD_STEPS + 2, 0.5)  # a gradient again: the count restarts
    assert h.check(ZERO_GRAD_STEPS + 2) is None and int(h.state[1]) == 0
    step(ZERO_GRAD_STEPS + 3, float("nan"))
    step(ZERO_GRAD_STEPS + 4, float("inf"), loss=float("nan"))
    with pytest.raises(ValueError, match=f"^step {ZERO_GRAD_STEPS + 3}: "):
        h.check(ZERO_GRAD_STEPS + 4)
