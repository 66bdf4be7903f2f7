"""The fused lm_head + CE (gradient formed in the forward) equals the checkpointed plain path."""

import pytest
import torch

from dflash.train.fused_ce import fused_weighted_ce_sum
from dflash.train.losses import weighted_ce_sum


def test_fused_ce_matches_plain_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    M, H, V = 37, 16, 50
    h = torch.randn(M, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (M,), generator=g)
    weights = torch.rand(M, generator=g, dtype=torch.float64)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    l1, c1 = weighted_ce_sum(h1, w, labels, weights, chunk=8)
    l2, c2 = fused_weighted_ce_sum(h2, w, labels, weights, chunk=8, dtype=torch.float64)
    (3.0 * l1).backward()
    (3.0 * l2).backward()
    assert torch.allclose(l1.double(), l2.double(), rtol=1e-6)
    assert torch.allclose(c1.double(), c2.double())
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)


def test_fused_ce_without_grad():
    h = torch.randn(5, 4)
    w = torch.randn(7, 4)
    lab = torch.tensor([0, 1, 2, 3, 6])
    l1, _ = weighted_ce_sum(h, w, lab, torch.ones(5))
    l2, _ = fused_weighted_ce_sum(h, w, lab, torch.ones(5))
    assert torch.allclose(l1, l2, atol=1e-5)


def test_fused_ce_applies_and_differentiates_the_logit_transform():
    """output_multiplier and final_logit_softcapping: same value and gradient as the plain path
    with the drafter's transform."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(20, 8, generator=g, dtype=torch.float64) * 3
    w = torch.randn(30, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (20,), generator=g)
    weights = torch.rand(20, generator=g, dtype=torch.float64)
    m, c = 0.7, 5.0

    def transform(x):
        return torch.tanh(x * m / c) * c

    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    l1, c1 = weighted_ce_sum(h1, w, labels, weights, chunk=7, logit_transform=transform)
    l2, c2 = fused_weighted_ce_sum(
        h2, w, labels, weights, chunk=7, dtype=torch.float64, output_multiplier=m, softcap=c
    )
    l1.backward()
    l2.backward()
    assert torch.allclose(l1.double(), l2.double(), rtol=1e-6)
    assert torch.allclose(c1.double(), c2.double())
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)


def test_chunks_are_never_one_row_long():
    """A 1-row chunk would make the compiled CE stats recompile mid-run (0/1 specialization)."""
    from dflash.train.fused_ce import chunk_bounds

    for chunk in (3, 4, 8, 4096):
        for M in range(2, 3 * chunk + 2 if chunk < 100 else 2):
            b = chunk_bounds(M, chunk)
            assert b[0][0] == 0 and b[-1][1] == M
            assert all(e0 == s1 for (_, e0), (s1, _) in zip(b, b[1:]))  # contiguous
            assert all(2 <= e - s <= chunk for s, e in b), (M, chunk, b)
    assert chunk_bounds(4097, 4096) == [(0, 4095), (4095, 4097)]


def test_fused_ce_with_a_one_row_tail_and_a_single_row_matches_plain():
    g = torch.Generator().manual_seed(2)
    for M, chunk in ((17, 8), (1, 8)):  # 17 = 2 x 8 + 1: the tail takes a row from the chunk before
        h = torch.randn(M, 6, generator=g, dtype=torch.float64)
        w = torch.randn(11, 6, generator=g, dtype=torch.float64)
        labels = torch.randint(0, 11, (M,), generator=g)
        weights = torch.rand(M, generator=g, dtype=torch.float64)
        h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
        l1, c1 = weighted_ce_sum(h1, w, labels, weights, chunk=chunk)
        l2, c2 = fused_weighted_ce_sum(h2, w, labels, weights, chunk=chunk, dtype=torch.float64)
        l1.backward()
        l2.backward()
        assert torch.allclose(l1.double(), l2.double(), rtol=1e-6)
        assert torch.allclose(c1.double(), c2.double())
        assert h2.grad.shape == (M, 6) and torch.allclose(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)


def test_fused_ce_adds_the_heads_bias_like_the_plain_path():
    """A target whose lm_head has a bias: both paths compute CE over h @ W.T + b (the value
    against an explicit nn.Linear), with the same gradient."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(20, 8, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(8, 30, bias=True).double()
    with torch.no_grad():
        head.bias.copy_(torch.randn(30, generator=g) * 3)
    labels = torch.randint(0, 30, (20,), generator=g)
    weights = torch.rand(20, generator=g, dtype=torch.float64)
    ref = (torch.nn.functional.cross_entropy(head(h), labels, reduction="none") * weights).sum()
    w, b = head.weight.detach(), head.bias.detach()
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    l1, _ = weighted_ce_sum(h1, w, labels, weights, chunk=7, lm_head_b_V=b)
    l2, _ = fused_weighted_ce_sum(
        h2, w, labels, weights, chunk=7, dtype=torch.float64, lm_head_b_V=b
    )
    l1.backward()
    l2.backward()
    assert torch.allclose(l1, ref.detach()) and torch.allclose(l2.double(), ref.detach())
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- DFlash2's selection
def _selector(V, H, rank=5, k=4, seed=3):
    from dflash.drafter.dflash2 import CandidateSelector

    sel = CandidateSelector(V, H, rank, k).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # off the zero start, so the pair term and its gradients matter
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return sel


@pytest.mark.parametrize(
    "M,chunk,transform,bias,V,tiles",
    [
        (37, 8, False, False, 13, False),
        (17, 8, True, True, 13, False),
        (1, 8, False, True, 13, False),
        (0, 8, False, False, 13, False),
        (23, 8, True, False, 128 * 64, False),  # wide enough for tiled_topk's two passes
        (23, 8, True, True, 128 * 64, True),  # the CE stats tile by tile (fused_head=tiles)
        (9, 8, False, False, 128 * 64, True),  # with a one-row tail
        (17, 8, False, False, 13, True),  # too narrow for tiles: the row stats
    ],
)
def test_fused_selection_matches_the_plain_path(M, chunk, transform, bias, V, tiles):
    """fused_ce_selection_sum = ce_selection_sum: the loss, the correct count (with separate
    correct weights, as D-PACE passes them) and the gradients of h and of every selector weight,
    with the logit transform, a head bias, a one-row tail, a single row, no row at all, a
    vocabulary whose candidates come from tiled_topk's tiles, and the CE stats tile by tile."""
    from dflash.train.fused_ce import fused_ce_selection_sum
    from dflash.train.losses import ce_selection_sum

    g = torch.Generator().manual_seed(M)
    H = 6
    h = torch.randn(M, H, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (M,), generator=g)
    labels[::2] = (h @ w.t()).argmax(-1)[::2]  # among the candidates in a wide vocabulary too
    prev = torch.randint(0, V, (M,), generator=g)
    weights = torch.rand(M, generator=g, dtype=torch.float64)
    cw = torch.rand(M, generator=g, dtype=torch.float64)
    m, c = (0.7, 5.0) if transform else (1.0, None)

    def tf(x):
        x = x * m
        return torch.tanh(x / c) * c if c else x

    out = []
    for fused in (False, True):
        sel, hh = _selector(V, H), h.clone().requires_grad_()
        kw = dict(selection_weight=0.6, chunk=chunk, lm_head_b_V=b, correct_weights_M=cw)
        if fused:
            kw.update(dtype=torch.float64, output_multiplier=m, softcap=c, tiles=tiles)
            loss, corr = fused_ce_selection_sum(hh, w, labels, weights, prev, sel, **kw)
        else:
            loss, corr = ce_selection_sum(
                hh, w, labels, weights, prev, sel, logit_transform=tf, **kw
            )
        (2.0 * loss).backward()
        grads = {n: p.grad.clone() for n, p in sel.named_parameters()}
        out.append((loss.detach().double(), corr.double(), hh.grad, grads))
    (l1, c1, g1, s1), (l2, c2, g2, s2) = out
    assert torch.allclose(l1, l2, rtol=1e-6)  # the fused stats sum in float32
    assert torch.allclose(c1, c2)
    # the fused CE stats run in float32 (logits of ~20 here): ~1e-6 off where the gradient is
    # near 0, by the CPU's float32 exp (1.5e-6 seen on one machine, under 1e-6 on another)
    assert g2.shape == (M, H) and torch.allclose(g1, g2, rtol=1e-5, atol=1e-5)
    for n in s1:
        assert torch.allclose(s1[n], s2[n], rtol=1e-5, atol=1e-5), n
    if M > 1:  # the selection term is there and sends gradient to the selector
        assert all(s1[n].abs().sum() > 0 for n in s1)


def test_fused_selection_term_reaches_h_through_the_candidates_rows():
    """Without the block CE's weight the gradient of h that does not come from the selector's
    hidden projection comes from the K candidates' head rows: zeroing the projection leaves
    exactly sum_k d loss / d unary_k * W[cand_k]."""
    from dflash.train.fused_ce import fused_ce_selection_sum

    g = torch.Generator().manual_seed(0)
    M, H, V = 9, 5, 11
    h = torch.randn(M, H, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (M,), generator=g)
    sel = _selector(V, H, k=3)
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
    loss, _ = fused_ce_selection_sum(
        h,
        w,
        labels,
        torch.zeros(M, dtype=torch.float64).index_fill_(0, torch.tensor([2]), 1.0),
        torch.randint(0, V, (M,), generator=g),
        sel,
        selection_weight=1.0,
        dtype=torch.float64,
    )
    loss.backward()
    # only row 2 has weight; the block CE's gradient of row 2 plus the selection's
    unary, cand = (h.detach() @ w.t()).topk(3, -1)
    u = unary[2].clone().requires_grad_()
    hit = cand[2] == labels[2]
    logits = (h.detach()[2] @ w.t()).requires_grad_()
    ce = torch.nn.functional.cross_entropy(logits[None], labels[2:3])
    term = -torch.log_softmax(u, 0)[hit.float().argmax()] * hit.any()
    (gu,) = (
        torch.autograd.grad(term, u)
        if term.requires_grad
        else (torch.zeros(3, dtype=torch.float64),)
    )
    (gl,) = torch.autograd.grad(ce, logits)
    want = gl @ w + gu @ w[cand[2]]
    assert torch.allclose(h.grad[2], want, rtol=1e-5, atol=1e-6)
    assert h.grad[[0, 1, 3]].abs().max() == 0


# ------------------------------------------------------------------- the CE stats tile by tile
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("transform", [False, True])
def test_tiled_stats_equal_the_row_stats(dtype, transform):
    """_ce_stats_tiled = _ce_stats (loss, correct count, gradient) and its tile maxima are the
    raw logits' own, on rows whose maximum repeats: within a tile, across tiles, and in the
    label's column or not, where the first maximum decides the argmax as in torch.argmax."""
    from dflash.train.fused_ce import _ce_stats, _ce_stats_tiled

    g = torch.Generator().manual_seed(7)
    c, T, n = 12, 8, 6
    x = (torch.randn(c, n * T, generator=g, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, n * T, (c,), generator=g)
    top = x.amax(-1)
    x[0, [5, 6]] = top[0] + 1  # twice in tile 0: column 5 is the argmax
    x[1, [3, 40]] = top[1] + 1  # tiles 0 and 5: column 3
    labels[1] = 40  # the label holds the maximum, but not the first one: not correct
    x[2, [17, 30]] = top[2] + 1  # tiles 2 and 3
    labels[2] = 17  # the first maximum: correct
    labels[3] = x[3].float().argmax()
    w, cw = torch.rand(c, generator=g), torch.rand(c, generator=g)
    m, cap = (0.7, 3.0) if transform else (1.0, None)
    l1, c1, g1 = _ce_stats(x, labels, w, cw, m, cap)
    l2, c2, g2, tmax = _ce_stats_tiled(x, labels, w, cw, m, cap, tile=T)
    assert torch.allclose(l1, l2, rtol=1e-6) and torch.allclose(c1, c2)
    assert c1 == pytest.approx(
        float(cw[2] + cw[3]) + float(cw[4:][labels[4:] == x[4:].float().argmax(-1)].sum())
    )
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-9)
    assert g2.dtype == dtype and torch.allclose(g1.float(), g2.float(), **tol)
    assert torch.equal(tmax, x.view(c, n, T).amax(-1))


@pytest.mark.parametrize("transform", [False, True])
def test_tiled_stats_of_a_masked_tile_are_finite(transform):
    """A tile whose logits are all -inf (a masked block of padded vocabulary) adds nothing to
    the log-sum-exp: the tiled stats stay equal to the row stats instead of turning NaN."""
    from dflash.train.fused_ce import _ce_stats, _ce_stats_tiled

    g = torch.Generator().manual_seed(11)
    c, T, n = 6, 8, 5
    x = torch.randn(c, n * T, generator=g, dtype=torch.float64) * 3
    x[:, :T] = float("-inf")  # tile 0 masked on every row
    x[2, 3 * T : 4 * T] = float("-inf")  # and tile 3 on one row
    labels = torch.randint(T, n * T, (c,), generator=g)
    labels[2] = T  # never a masked column
    w = torch.rand(c, generator=g)
    m, cap = (0.7, 3.0) if transform else (1.0, None)
    l1, c1, g1 = _ce_stats(x, labels, w, w, m, cap)
    l2, c2, g2, _ = _ce_stats_tiled(x, labels, w, w, m, cap, tile=T)
    assert torch.isfinite(l2) and torch.allclose(l1, l2, rtol=1e-6) and torch.equal(c1, c2)
    assert torch.allclose(g1, g2, rtol=1e-6, atol=1e-6)  # the stats run in fp32


def test_tiled_topk_takes_the_tile_maxima_it_is_given():
    """tiled_topk(x, k, tile_max=...) reads the maxima it is handed (a pass over x formed them):
    the same values as torch.topk with the true maxima; maxima that point at other tiles give
    those tiles' values, so the argument is used, not recomputed."""
    from dflash.drafter.topk import tiled_topk

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64 * 16, generator=g)
    tmax = x.view(5, 64, 16).amax(-1)
    v, i = tiled_topk(x, 4, tile=16, tile_max=tmax)
    assert torch.equal(v, x.topk(4, -1).values) and torch.equal(x.gather(1, i), v)
    wrong = -tmax  # ranks the tiles with the smallest maxima first
    v2, i2 = tiled_topk(x, 4, tile=16, tile_max=wrong)
    assert not torch.equal(v2, v) and torch.equal(x.gather(1, i2), v2)


def test_compiled_tiled_stats_equal_eager():
    """The tiled stats compiled (Inductor, dynamic shapes, as the fused head compiles them on
    CUDA) equal the eager ones on the CPU, at two row counts."""
    from dflash.train.fused_ce import _ce_stats_tiled

    torch._dynamo.reset()
    comp = torch.compile(_ce_stats_tiled, dynamic=True)
    g = torch.Generator().manual_seed(5)
    for c in (6, 9):
        x = (torch.randn(c, 128 * 8, generator=g) * 3).bfloat16()
        labels = torch.randint(0, 128 * 8, (c,), generator=g)
        w = torch.rand(c, generator=g)
        a, b = _ce_stats_tiled(x, labels, w, w, 0.7, 4.0), comp(x, labels, w, w, 0.7, 4.0)
        for u, v in zip(a, b):
            assert torch.allclose(u.float(), v.float(), rtol=1e-4, atol=1e-5)
