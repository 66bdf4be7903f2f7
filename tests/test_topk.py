"""tiled_topk (DFlash2's candidates over the vocabulary) returns torch.topk's values, in its order,
for every row shape the drafter gives it, eager and traced."""

import pytest
import torch

from dflash.drafter.topk import tiled_topk

torch.set_num_threads(1)


def _same_as_torch(x, k, tile=128):
    v, i = tiled_topk(x, k, tile)
    want_v, want_i = x.topk(k, dim=-1)
    assert torch.equal(v, want_v)
    return v, i, want_i


@pytest.mark.parametrize(
    "shape",
    [(9, 151936), (2, 3, 128 * 80), (128 * 70,), (6, 128 * 64), (5, 128 * 64 + 1), (3, 8064)],
)
def test_values_and_indices_are_torch_topks_without_ties(shape):
    """float32 normal rows have no ties: the same values and the same indices, with leading
    dims, for a 1-d row, and where torch.topk itself runs: a row that is not a whole number of
    tiles, or narrower than 4k tiles."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    _, i, want_i = _same_as_torch(x, 16)
    assert torch.equal(i, want_i)


def test_the_winners_packed_in_one_tile_at_the_end_or_among_minus_inf():
    """All k winners in one tile (the other k - 1 chosen tiles hold none of them), in the last
    tile, or a row of 3 finite values: the rest of its top-k is -inf, at distinct columns."""
    V, k = 128 * 70, 16
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    x[0, 256 : 256 + k] = 10 + torch.arange(k, dtype=torch.float32)
    x[1, -7:] = 20 + torch.arange(7, dtype=torch.float32)
    x[2, : V - 3] = float("-inf")
    x[2, -3:] = torch.tensor([1.0, 2.0, 3.0])
    v, i, want_i = _same_as_torch(x, k)
    assert torch.equal(i[:2], want_i[:2])
    assert sorted(i[0].tolist()) == list(range(256, 256 + k))
    assert i[1, :7].tolist() == list(range(V - 1, V - 8, -1))
    assert i[2, :3].tolist() == [V - 1, V - 2, V - 3] and i[2].unique().numel() == k


def test_bfloat16_ties_give_the_same_values_at_distinct_indices():
    """bf16 rows of the Qwen vocab width tie often: the values are torch.topk's, each index
    holds its value, and no index repeats."""
    x = torch.randn(64, 151936, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[:, 1000:1040] = 8.0  # 40 equal maxima across the tile boundary at 1024: ties at the top
    v, i, _ = _same_as_torch(x, 16)
    assert torch.equal(x.gather(1, i), v)
    assert all(row.unique().numel() == 16 for row in i)
    assert ((i >= 1000) & (i < 1040)).all()


def test_traces_as_one_graph_with_dynamic_rows():
    """The compiled drafter step traces it (fullgraph, rows dynamic as the packed batches)."""
    torch._dynamo.reset()
    f = torch.compile(tiled_topk, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (5, 12):
        x = torch.randn(rows, 128 * 70, generator=torch.Generator().manual_seed(rows))
        v, i = f(x, 16)
        assert torch.equal(v, x.topk(16, dim=-1).values) and torch.equal(i, x.topk(16, -1).indices)
