"""The block losses beyond hard CE (train.loss=variable_prefix, dpace) and DFlash2's selection
loss: each against a brute-force computation on a tiny batch, and each through the trainer's
sum-then-divide normalization (gradient accumulation here; data parallelism, FSDP in the slow
test) exactly as hard CE."""

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import assert_same_adam_steps, make_drafter
from test_training import _master, _run_cfg, _samples

from dflash.config import TrainConfig
from dflash.data.batch import collate, target_forward
from dflash.drafter.blocks import sample_prefix_lengths
from dflash.target.shape import Heads
from dflash.tools.testing import rank_env
from dflash.train.losses import dpace_weights
from dflash.train.step import DrafterTrainer

GAMMA = 3.0
_HEAD = {False: "plain", True: "fused", "tiles": "tiles"}  # train.fused_head (auto: plain on CPU)


def _trainer(target, drafter, **over):
    cfg = TrainConfig(steps=10, max_anchors=6, lr=1e-2, gamma=GAMMA, **over)
    return DrafterTrainer(
        drafter, Heads(target.embed_tokens, target.lm_head), cfg, torch.device("cpu")
    )


def _hidden(tr, tb, p):
    """The drafter's final hidden states [N, A, B, H] of a prepared micro-batch."""
    N, A = p.blocks.anchors_NA.shape
    with torch.no_grad():
        h = tr.drafter(
            tr.heads.embed(p.blocks.block_ids_NQ),
            p.blocks.block_pos_NQ,
            p.blocks.masks,
            aux_NTF=tb.aux_NTF,
            ctx_pos_NT=tb.position_ids_NT,
        )
    return h.view(N, A, tr.spec.block_size, -1)


def _block_ce(tr, h_BH, labels_K):
    logits = tr.drafter.logits(h_BH[1:], tr.heads.lm_head.weight)
    return F.cross_entropy(logits, labels_K, reduction="none"), logits


# ----------------------------------------------------------------------------- D-PACE
def _dpace_brute(ce, valid, alpha):
    """speculators' dpace_loss_decay written as loops: w_k = sum_{t>=k valid} prod_{j<=t} s_j."""
    n, K = ce.shape
    w = torch.zeros(n, K, dtype=torch.float64)
    for b in range(n):
        s = [
            (1 - alpha) * math.exp(-float(ce[b, j])) + alpha if valid[b, j] else 1.0
            for j in range(K)
        ]
        for k in range(K):
            if not valid[b, k]:
                continue
            w[b, k] = sum(math.prod(s[: t + 1]) for t in range(k, K) if valid[b, t])
    return w


def test_dpace_weights_match_brute_force():
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(6, 7, generator=g) * 4
    valid = torch.ones(6, 7, dtype=torch.bool)
    valid[1, 4:] = False  # a block cut by the end of its sample
    valid[2] = False
    valid[3, 0] = False
    for alpha in (0.0, 0.5, 1.0):
        got = dpace_weights(ce, valid, alpha).double()
        assert torch.allclose(got, _dpace_brute(ce, valid, alpha), atol=1e-6), alpha
    # alpha = 1: every s_j = 1, so w_k = the number of valid positions from k on
    assert torch.equal(dpace_weights(ce, valid, 1.0)[0], torch.arange(7, 0, -1).float())


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_dpace_loss_is_brute_force_through_the_trainer(tiny_qwen, variant):
    d = make_drafter(tiny_qwen, variant=variant, selector_rank=8, selector_top_k=4)
    tr = _trainer(tiny_qwen, d, loss="dpace", dpace_alpha=0.3, selector_loss_weight=0.0)
    tb = target_forward(tiny_qwen, collate(_samples(tiny_qwen)))
    p = tr.prepare(tb, 0)
    assert torch.equal(p.weights_NAK, p.label_valid_NAK.float())  # denominator: label count
    loss, correct = tr.forward_sums(tb, p)
    h = _hidden(tr, tb, p)
    want, hits = 0.0, 0.0
    N, A, K = p.labels_NAK.shape
    for n in range(N):
        for a in range(A):
            ce, logits = _block_ce(tr, h[n, a], p.labels_NAK[n, a])
            valid = p.label_valid_NAK[n, a]
            w = _dpace_brute(ce[None], valid[None], 0.3)[0]
            want += float((w * ce.double()).sum())
            hits += float(((logits.argmax(-1) == p.labels_NAK[n, a]) & valid).sum())
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert correct.item() == hits  # accuracy per label, not per D-PACE weight


# ----------------------------------------------------------------------------- variable prefix
def test_prefix_prior_is_truncated_geometric_and_seeded():
    lengths = sample_prefix_lengths([1, 2, 3, 4], (4, 4000), 8, 0.7, 1)
    assert lengths.min() >= 1 and lengths.max() <= 7
    freq = torch.bincount(lengths.flatten(), minlength=8)[1:].double() / lengths.numel()
    prior = torch.tensor([0.7**l for l in range(1, 8)], dtype=torch.float64)
    assert torch.allclose(freq, prior / prior.sum(), atol=0.01)
    # a row's draw depends on its seed only, not on how many anchors the batch pads to
    a = sample_prefix_lengths([5, 9], (2, 3), 8, 0.9, 2)
    b = sample_prefix_lengths([5], (1, 5), 8, 0.9, 2)
    assert torch.equal(a[0], b[0, :3]) and a.min() >= 2


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_variable_prefix_is_brute_force_through_the_trainer(tiny_qwen, variant):
    d = make_drafter(tiny_qwen, variant=variant, selector_rank=8, selector_top_k=4)
    tr = _trainer(tiny_qwen, d, loss="variable_prefix", prefix_base=0.8, selector_loss_weight=0)
    tb = target_forward(tiny_qwen, collate(_samples(tiny_qwen)))
    p = tr.prepare(tb, 0)
    B, mask = tr.spec.block_size, tr.spec.mask_token_id
    N, A, K = p.labels_NAK.shape
    ids, seg = tb.input_ids_NT, tb.segment_ids_NT
    blocks = p.blocks.block_ids_NQ.view(N, A, B)
    assert (p.prefix_NA[p.blocks.valid_NA] > 1).any()  # some blocks show real tokens
    want, denom = 0.0, 0.0
    h = _hidden(tr, tb, p)
    for n in range(N):
        for a in range(A):
            if not p.blocks.valid_NA[n, a]:
                continue
            anc, l = int(p.blocks.anchors_NA[n, a]), int(p.prefix_NA[n, a])
            expect = [int(ids[n, anc])]
            for k in range(1, B):
                inside = anc + k < ids.shape[1] and seg[n, anc + k] == seg[n, anc]
                expect.append(int(ids[n, anc + k]) if k < l and inside else mask)
            assert blocks[n, a].tolist() == expect, (n, a, l)
            ce, _ = _block_ce(tr, h[n, a], p.labels_NAK[n, a])
            for k in range(1, B):
                real = bool(p.label_valid_NAK[n, a, k - 1])
                assert real == (k >= l and tr.prepare(tb, 0).label_valid_NAK[n, a, k - 1]), k
                if k >= l and real:
                    w = math.exp(-(k - l) / GAMMA)
                    want += w * float(ce[k - 1])
                    denom += w
    loss, _ = tr.forward_sums(tb, p)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert p.weights_NAK.sum().item() == pytest.approx(denom, rel=1e-6)


# ----------------------------------------------------------------------------- DFlash2 selection
@pytest.mark.parametrize("fused", [False, True, "tiles"], ids=["plain", "fused", "tiles"])
def test_selection_loss_is_brute_force(tiny_qwen, fused, monkeypatch):
    """Every head: the checkpointed plain path (CPU's), the fused one (CUDA's) and the fused one
    with its CE stats tile by tile (tiles of 16 here, so the tiny vocabulary holds 32)."""
    from dflash.train import fused_ce

    if fused == "tiles":
        monkeypatch.setattr(fused_ce, "TILE", 16)
        assert fused_ce.uses_tiles(tiny_qwen.vocab_size, 4, True)
    d = make_drafter(tiny_qwen, variant="dflash2", selector_rank=8, selector_top_k=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a selector that scores pairs (it starts as a no-op)
        d.candidate_selector.successor_codebook.normal_(0, 0.5, generator=g)
        d.candidate_selector.predecessor_codebook.normal_(0, 0.5, generator=g)
        d.candidate_selector.hidden_projection.weight.normal_(0, 0.5, generator=g)
    lam = 0.7
    tr = _trainer(tiny_qwen, d, selector_loss_weight=lam, fused_head=_HEAD[fused])
    assert tr.objective.fused == bool(fused) and tr.objective.tiles == (fused == "tiles")
    tb = target_forward(tiny_qwen, collate(_samples(tiny_qwen)))
    p = tr.prepare(tb, 0)
    h = _hidden(tr, tb, p)
    with torch.no_grad():
        want, absent, present = _selection_brute(tr, p, h, lam)
    assert absent > 0 and present > 0  # both cases of the rule occur in this batch
    loss, _ = tr.forward_sums(tb, p)
    assert loss.item() == pytest.approx(want, rel=1e-5)


def _selection_brute(tr, p, h, lam):
    sel = tr.drafter.candidate_selector
    A_cb, S_cb, P_w = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    want, absent, present = 0.0, 0, 0
    N, A, K = p.labels_NAK.shape
    for n in range(N):
        for a in range(A):
            ce, logits = _block_ce(tr, h[n, a], p.labels_NAK[n, a])
            anchor_tok = int(p.blocks.block_ids_NQ.view(N, A, -1)[n, a, 0])
            for k in range(1, K + 1):
                if not p.label_valid_NAK[n, a, k - 1]:
                    continue
                w = math.exp(-(k - 1) / GAMMA)
                want += w * float(ce[k - 1])
                label = int(p.labels_NAK[n, a, k - 1])
                prev = anchor_tok if k == 1 else int(p.labels_NAK[n, a, k - 2])
                unary, cand = logits[k - 1].topk(4)
                if label not in cand.tolist():
                    absent += 1
                    continue
                present += 1
                gate = A_cb[prev] * (P_w @ h[n, a, k])
                scores = torch.stack([unary[c] + gate @ S_cb[cand[c]] for c in range(4)])
                nll = -torch.log_softmax(scores, 0)[cand.tolist().index(label)]
                want += lam * w * float(nll)
    return want, absent, present


# ----------------------------------------------------------------------------- normalization
CASES = [  # (variant, loss, fused head)
    ("dflash", "variable_prefix", False),
    ("dflash", "variable_prefix", True),
    ("dflash", "dpace", False),
    ("dflash2", "hard_ce", False),
    ("dflash2", "hard_ce", True),
    ("dflash2", "variable_prefix", False),
    ("dflash2", "variable_prefix", True),
    ("dflash2", "dpace", False),
    ("dflash2", "dpace", True),
]


def _grads(trainer, micro):
    trainer.opt.zero_grad(set_to_none=True)
    prepared = [trainer.prepare(tb, 0) for tb in micro]
    denom = sum(p.weights_NAK.sum() for p in prepared)
    for tb, p in zip(micro, prepared):
        (trainer.forward_sums(tb, p)[0] / denom).backward()
    return {k: v.grad.clone() for k, v in trainer.drafter.named_parameters() if v.grad is not None}


@pytest.mark.parametrize("variant,loss,fused", CASES)
def test_grad_accumulation_equals_one_big_batch(tiny_qwen, variant, loss, fused):
    s = _samples(tiny_qwen)
    d = make_drafter(tiny_qwen, variant=variant, selector_rank=8, selector_top_k=4)
    with torch.no_grad():  # every selector weight gets a gradient
        for n, p in d.named_parameters():
            if n.startswith("candidate_selector."):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    tr = _trainer(tiny_qwen, d, loss=loss, fused_head=_HEAD[fused])
    big = [target_forward(tiny_qwen, collate(s))]
    small = [target_forward(tiny_qwen, collate(s[:1])), target_forward(tiny_qwen, collate(s[1:]))]
    g_big, g_small = _grads(tr, big), _grads(tr, small)
    assert set(g_big) == {n for n, _ in d.named_parameters()}
    for k in g_big:
        assert torch.allclose(g_big[k], g_small[k], atol=1e-6, rtol=1e-4), k
    assert all(g_big[k].abs().sum() > 0 for k in g_big if "candidate_selector" in k)


def _modes():
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return [("ddp", 1), ("fsdp", 1)]
    return [("ddp", 1), ("fsdp", 1), ("deepspeed", 3)]


def _dp_rank(rank, world, port, out_dir):
    rank_env(rank, world, port)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for variant, loss, fused in DP_CASES:
        for mode, stage in _modes():
            out[(variant, loss, fused, f"{mode}{stage}")] = _train_dp(
                rank, world, dist.group.WORLD, variant, loss, mode, stage, fused
            )
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "w.pt"))
    dist.barrier()
    dist.destroy_process_group()


# every plain case, and DFlash2's fused head once (the selector is a module call on both paths)
DP_CASES = [c for c in CASES if not c[2]] + [("dflash2", "hard_ce", True)]


def _train_dp(rank, world, group, variant, loss, mode, stage=1, fused=False):
    from conftest import get_target
    from test_parallelize import _micro

    target = get_target("tiny_qwen3_5")
    d = make_drafter(target, variant=variant, selector_rank=8, selector_top_k=4)
    cfg = TrainConfig(
        steps=10,
        max_anchors=6,
        lr=1e-2,
        grad_accum=2,
        micro_batch_size=4 // world,
        loss=loss,
        dist=mode,
        zero_stage=stage,
        fused_head=_HEAD[fused],
    )
    heads = Heads(target.embed_tokens, target.lm_head)
    tr = DrafterTrainer(d, heads, cfg, torch.device("cpu"), dp_group=group)
    for micro in _micro(target, rank, world):
        tr.train_step(micro)
    return {k: v.detach().clone() for k, v in tr.drafter_for_io().state_dict().items()}


@pytest.mark.slow
def test_data_parallel_equals_one_process(tmp_path):
    """2 ranks (DDP, FSDP, and DeepSpeed ZeRO-3 where installed: the selector runs in the loss,
    outside the drafter's forward) over gloo train each new loss and DFlash2 to the weights one
    process reaches on the whole batch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dp_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "w.pt")
    assert len(got) == len(_modes()) * len(DP_CASES)
    for (variant, loss, fused, mode), weights in got.items():
        ref = _train_dp(0, 1, None, variant, loss, "ddp", fused=fused)
        assert_same_adam_steps(weights, ref, variant, loss, mode)


@pytest.mark.parametrize("loss", ["variable_prefix", "dpace"])
def test_dflash2_resume_equals_uninterrupted(tmp_path, loss):
    """Save -> resume -> continue equals the uninterrupted run for DFlash2 with the new losses
    (the visible prefixes are drawn per step and row, so a resumed step draws the same ones)."""
    import dataclasses

    from dflash.train.colocated import run_colocated

    def cfg(resume=None):
        c = _run_cfg(tmp_path, 6, resume=resume, loss=loss)
        d = dataclasses.replace(c.drafter, variant="dflash2", selector_rank=8, selector_top_k=4)
        return dataclasses.replace(c, drafter=d)

    run_colocated(cfg(), str(tmp_path / "full"))
    run_colocated(cfg(), str(tmp_path / "part"), stop_at=4)
    out = run_colocated(
        cfg(str(tmp_path / "part" / "checkpoints" / "step_00000004")), str(tmp_path / "cont")
    )
    a = _master(tmp_path / "full" / "checkpoints" / "step_00000006")
    b = _master(out["checkpoint"])
    assert any(k.startswith("candidate_selector.") for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-7), (k, (a[k] - b[k]).abs().max())
    c = _master(tmp_path / "part" / "checkpoints" / "step_00000004")
    assert not torch.allclose(
        c["candidate_selector.successor_codebook"], a["candidate_selector.successor_codebook"]
    )
