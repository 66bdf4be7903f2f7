"""The per-row draws of a training step (anchors, kept labels, prefix lengths): uniform, and a
function of the row's seed alone, never of the other rows, the batch's shapes or how many draws
the batch uses (micro-batches and ranks then cut a batch without changing any row's draw)."""

import math

import numpy as np
import pytest
import torch

from dflash.drafter.blocks import (
    row_uniforms,
    sample_anchors,
    sample_kept_labels,
    sample_prefix_lengths,
)


def test_row_uniforms_are_uniform_independent_and_prefix_stable():
    u = row_uniforms([7, 8, 2**62 - 1], 50_000)
    assert u.shape == (3, 50_000) and u.min() >= 0.0 and u.max() < 1.0
    for row in u:  # mean, variance and 10 bins of U(0, 1)
        assert abs(row.mean() - 0.5) < 0.01 and abs(row.var() - 1 / 12) < 0.003
        hist = torch.histc(torch.from_numpy(row), bins=10, min=0, max=1) / row.size
        assert (hist - 0.1).abs().max() < 0.006
    # neighbouring seeds and neighbouring draws are uncorrelated
    a, b = row_uniforms([1000, 1001], 50_000)
    corr = lambda x, y: float(np.corrcoef(x, y)[0, 1])  # noqa: E731
    assert abs(corr(a, b)) < 0.02 and abs(corr(a[:-1], a[1:])) < 0.02
    # a row's draws: the same alone, among other rows, and as the prefix of a longer draw
    assert (row_uniforms([8], 100)[0] == u[1, :100]).all()
    assert not (row_uniforms([9], 100)[0] == u[1, :100]).any()


def test_anchors_are_a_uniform_sorted_sample_of_the_candidates():
    T, A = 40, 8
    cand = torch.zeros(1, T, dtype=torch.bool)
    cand[0, 5:35] = True  # 30 candidates
    hits = torch.zeros(T)
    trials = 3000
    for s in range(trials):
        anchors, valid = sample_anchors(cand, A, [s])
        a = anchors[0][valid[0]]
        assert a.numel() == A and torch.equal(a, a.sort().values) and cand[0, a].all()
        assert a.unique().numel() == A  # without replacement
        hits[a] += 1
    rate = hits[5:35] / trials  # each candidate with probability 8 / 30
    sd = math.sqrt(A / 30 * (1 - A / 30) / trials)
    assert (rate - A / 30).abs().max() < 5 * sd and hits[:5].sum() == hits[35:].sum() == 0


def test_anchors_of_a_row_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    cand = torch.rand(5, 60, generator=g) < 0.5
    cand[3] = False  # a row without candidates
    cand[4, :] = False
    cand[4, [7, 9]] = True  # a row with fewer candidates than max_anchors
    seeds = [11, 12, 13, 14, 15]
    anchors, valid = sample_anchors(cand, 10, seeds)
    padded, pvalid = sample_anchors(cand, 10, seeds, pad=True)
    assert anchors.shape == (5, 10) and padded.shape == (5, 10)
    for n in range(5):
        alone, avalid = sample_anchors(cand[n : n + 1], 10, seeds[n : n + 1])
        wider = torch.cat([cand[n : n + 1], torch.zeros(1, 25, dtype=torch.bool)], 1)
        w, wvalid = sample_anchors(wider, 10, seeds[n : n + 1])  # a longer padded row
        want = anchors[n][valid[n]]
        for got, ok in ((alone, avalid), (w, wvalid), (padded[n : n + 1], pvalid[n : n + 1])):
            assert torch.equal(got[0][ok[0]], want)
    assert valid.sum(1).tolist() == [10, 10, 10, 0, 2]
    assert anchors[4][:2].tolist() == [7, 9] and (anchors[~valid] == 0).all()  # padding: 0
    assert (valid[:, :-1] >= valid[:, 1:]).all()  # real anchors first
    # pad=True: max_anchors columns even when every row has fewer candidates
    few, fvalid = sample_anchors(cand[3:5], 10, seeds[3:5], pad=True)
    assert few.shape == (2, 10) and fvalid.sum() == 2
    # the draw changes with the seed
    assert not torch.equal(sample_anchors(cand[:1], 10, [99])[0], anchors[:1])


@pytest.mark.parametrize("A", [3, 16])
def test_kept_labels_keep_each_position_at_its_rate_whatever_the_padding(A):
    keep = torch.tensor([1.0, 0.7, 0.3, 0.05])
    seeds = list(range(2000))
    kept = sample_kept_labels(keep, seeds, (2000, A, 4))
    rate = kept.double().mean((0, 1))
    sd = (keep * (1 - keep) / (2000 * A)).sqrt()
    assert kept[..., 0].all() and ((rate - keep).abs() <= 5 * sd + 1e-12).all()
    full = sample_kept_labels(keep, seeds[:5], (5, 16, 4))
    assert torch.equal(kept[:5], full[:, :A])  # a row's draw of anchor a: the same at any A


def test_prefix_lengths_follow_the_prior_whatever_the_padding():
    lengths = sample_prefix_lengths(list(range(50)), (50, 400), 6, 0.5, 2)
    assert lengths.min() >= 2 and lengths.max() <= 5 and lengths.dtype == torch.long
    freq = torch.bincount(lengths.flatten(), minlength=6)[2:].double() / lengths.numel()
    prior = torch.tensor([0.5**l for l in range(2, 6)], dtype=torch.float64)
    assert torch.allclose(freq, prior / prior.sum(), atol=0.01)
    a = sample_prefix_lengths([5, 9], (2, 3), 8, 0.9, 2)
    assert torch.equal(a[1], sample_prefix_lengths([9], (1, 6), 8, 0.9, 2)[0, :3])
