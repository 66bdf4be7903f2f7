"""The fused lm_head + CE (gradient formed in the forward) equals the checkpointed plain path."""

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
