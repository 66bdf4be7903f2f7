"""train.compile: every batch padded to one row length and the anchors to max_anchors, so the
drafter is one static graph (compiled once, not once per batch length), with the same loss and
updates as the eager step; a compile that fails at the first step leaves the run eager."""

import copy

import pytest
import torch
from conftest import make_drafter

from dflash.config import RunConfig, TrainConfig
from dflash.data.batch import Sample, collate, target_forward
from dflash.target.shape import Heads
from dflash.train.build import static_length
from dflash.train.step import DrafterTrainer


def _samples(target, lengths, P=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, L in enumerate(lengths):
        lm = torch.zeros(L, dtype=torch.bool)
        lm[P:] = True
        out.append(Sample(i, torch.randint(0, target.vocab_size - 1, (L,), generator=g), lm))
    return out


def _trainer(target, drafter, **over):
    cfg = TrainConfig(steps=10, max_anchors=8, lr=1e-2, **over)
    return DrafterTrainer(
        drafter, Heads(target.embed_tokens, target.lm_head), cfg, torch.device("cpu")
    )


@pytest.fixture
def eager_backend(monkeypatch):
    """torch.compile with dynamo's eager backend: traced and guarded as on CUDA, no codegen."""
    real = torch.compile

    def compile_eager(model, **kw):
        return real(model, backend="eager", **kw)

    monkeypatch.setattr(torch, "compile", compile_eager)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_static_length_follows_train_compile():
    cfg = RunConfig()
    assert static_length(cfg) is None
    cfg.train.compile = True
    assert static_length(cfg) == cfg.data.max_length
    cfg.data.pack_to = 96
    assert static_length(cfg) == 96


@pytest.mark.parametrize(
    "variant,loss",
    [
        ("dflash", "hard_ce"),
        ("dflash", "variable_prefix"),
        ("dflash", "dpace"),
        ("dflash2", "hard_ce"),
    ],
)
def test_compiled_step_is_one_graph_and_equals_eager(tiny_qwen, eager_backend, variant, loss):
    """Every drafter of the family and every block loss (the recipes' train.compile=true)."""
    from torch._dynamo.utils import counters

    drafter = make_drafter(tiny_qwen, variant=variant)
    eager = _trainer(tiny_qwen, copy.deepcopy(drafter), loss=loss)
    comp = _trainer(tiny_qwen, copy.deepcopy(drafter), compile=True, loss=loss)
    L = 48
    groups = [[14, 30, 22], [40, 12, 19], [25, 25, 33]]  # three batch lengths, some < 8 anchors
    batches = [_samples(tiny_qwen, g, seed=i) for i, g in enumerate(groups)]
    shapes, graphs = set(), []
    for s in batches:
        tb = target_forward(tiny_qwen, collate(s))
        tb_static = target_forward(tiny_qwen, collate(s, pad_to=L))
        assert tb_static.input_ids_NT.shape[1] == L and tb.input_ids_NT.shape[1] < L
        p = comp.prepare(tb_static, comp.step)
        shapes.add((tuple(p.blocks.block_ids_NQ.shape), tuple(tb_static.aux_NTF.shape)))
        a, b = eager.train_step([tb]), comp.train_step([tb_static])
        graphs.append(counters["stats"]["unique_graphs"])
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/labels"] == a["train/labels"]
    assert len(shapes) == 1  # one shape for every batch
    assert graphs[0] >= 1 and graphs[-1] == graphs[0]  # compiled at the first step only
    for (k, x), y in zip(eager.drafter.named_parameters(), comp.drafter.parameters()):
        # fp32 rounding of other shapes, through Adam (lr 1e-2: a wrong update is ~1e-2 off);
        # a weight whose gradient is near zero may take Adam's step a little differently
        d = (x - y).abs()
        assert (d > 2e-4).float().mean() < 1e-3 and d.max() < 2e-3, (k, d.max())


def test_failed_compile_goes_on_eager_with_a_warning(tiny_qwen, monkeypatch):
    class Broken(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *a, **k):
            raise RuntimeError("inductor could not lower flex_attention")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken(model))
    drafter = make_drafter(tiny_qwen)
    eager = _trainer(tiny_qwen, copy.deepcopy(drafter))
    comp = _trainer(tiny_qwen, copy.deepcopy(drafter), compile=True)
    tb = target_forward(tiny_qwen, collate(_samples(tiny_qwen, [20, 26])))
    a = eager.train_step([tb])
    with pytest.warns(UserWarning, match="train.compile.*could not lower"):
        b = comp.train_step([tb])
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-6)
    assert comp.step == 1
    for x, y in zip(eager.drafter.parameters(), comp.drafter.parameters()):
        assert torch.allclose(x, y, atol=1e-7)
    comp.train_step([tb])  # later steps: eager, no second attempt


def test_packed_batches_have_one_row_count_under_compile(tiny_qwen):
    """data.pack_to packs a micro-batch into as many rows as its lengths need (here 1 to 3): under
    train.compile every batch is padded to micro_batch_size rows, so the drafter keeps one
    shape, and the padding rows change nothing (same loss as the unpadded batch)."""
    from dflash.train.build import make_batch

    cfg = RunConfig()
    cfg.train.compile, cfg.train.micro_batch_size, cfg.data.pack_to = True, 4, 64
    groups = [[14, 12, 10, 9], [40, 30, 20, 12], [60, 50, 45, 7]]
    samples = [s for i, g in enumerate(groups) for s in _samples(tiny_qwen, g, seed=i)]
    samples = [Sample(i, s.input_ids, s.loss_mask) for i, s in enumerate(samples)]
    rows, shapes = [], set()
    for k in range(3):
        idx = list(range(4 * k, 4 * k + 4))
        plain = collate([samples[i] for i in idx], pack_to=64)
        rows.append(plain.input_ids_NT.shape[0])
        tb = make_batch(tiny_qwen, samples, idx, cfg)
        shapes.add(tuple(tb.input_ids_NT.shape))
        assert tb.row_seeds[: len(plain.row_seeds)] == plain.row_seeds
        drafter = make_drafter(tiny_qwen)
        eager = _trainer(tiny_qwen, copy.deepcopy(drafter))
        a = eager.train_step([target_forward(tiny_qwen, plain)])
        b = _trainer(tiny_qwen, copy.deepcopy(drafter)).train_step([tb])
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/labels"] == a["train/labels"]
    assert len(set(rows)) == 3  # packing alone: three row counts
    assert shapes == {(4, 64)}
