"""Block-sparse drafter attention (flex + BlockMask) against the dense mask and the eager
per-anchor reference. Flex runs eagerly on CPU here; the GPU tier checks the compiled kernel."""

import pytest
import torch
from test_drafter import _drafter, _reference, _row

from dflash.drafter.attention import block_mask_from_dense, resolve_kernel, to_kernel_masks
from dflash.drafter.blocks import build_blocks, candidate_anchors, mask_rules, sample_anchors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _blocks(drafter, ids, pos, seg, anchors, valid):
    s = drafter.spec
    return build_blocks(ids, pos, seg, anchors, valid, s.block_size, s.mask_token_id, mask_rules(s))


@torch.no_grad()  # flex has no backward on CPU; training with it is CUDA-only
def _run(drafter, embed, blk, aux, pos, kernel):
    masks = to_kernel_masks(blk.masks, kernel)
    return drafter(embed(blk.block_ids_NQ), blk.block_pos_NQ, masks, aux_NTF=aux, ctx_pos_NT=pos)


def test_block_mask_tiles_equal_dense():
    """Every 128x128 tile is classified right (skipped / full / partial) at ragged sizes."""
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(2, 1, 300, 420, generator=g) < 0.5
    dense[:, :, :128, :256] = False  # an empty tile row
    dense[:, :, 128:256, 128:256] = True  # a full tile
    bm = block_mask_from_dense(dense)
    back = bm.to_dense()  # tile-level [N, 1, Qb, Kb] (partial or full)
    tiles = torch.nn.functional.pad(dense, (0, 512 - 420, 0, 384 - 300)).view(2, 1, 3, 128, 4, 128)
    assert torch.equal(back.bool(), tiles.any(5).any(3))
    assert bm.seq_lengths == (300, 420)


@pytest.mark.parametrize("window", [64, 5])
def test_flex_matches_dense_and_reference(window):
    torch.manual_seed(1)
    drafter = _drafter(window=window, block_size=4)
    embed = torch.nn.Embedding(512, 128)
    ids, aux, pos, seg = _row(T=200)
    anchors = torch.arange(3, 190, 4)[None]  # 47 anchors x 4 = 188 queries: two query tiles
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blk = _blocks(drafter, ids, pos, seg, anchors, valid)
    dense = _run(drafter, embed, blk, aux, pos, "sdpa")
    flex = _run(drafter, embed, blk, aux, pos, "flex")
    assert torch.allclose(flex, dense, atol=2e-5), (flex - dense).abs().max()
    with torch.no_grad():
        ref = _reference(drafter, embed, ids, aux, anchors[:, ::9])
    got = flex.view(anchors.shape[1], 4, -1)[::9]
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


def test_flex_matches_dense_packed_rows_with_invalid_anchors():
    """Several samples per row, padding and rows with fewer anchors (invalid slots)."""
    torch.manual_seed(2)
    drafter = _drafter(window=16, block_size=4)
    embed = torch.nn.Embedding(512, 128)
    N, T = 3, 150
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (N, T), generator=g)
    seg = torch.full((N, T), -1)
    pos = torch.zeros(N, T, dtype=torch.long)
    for r, cuts in enumerate([(0, 60, 150), (0, 100), (0, 40, 90, 140)]):
        for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            seg[r, a:b], pos[r, a:b] = s, torch.arange(b - a)
    loss = (seg >= 0) & (torch.rand(N, T, generator=g) < 0.7)
    loss[1, 50:] = False  # row 1 has fewer candidates: invalid anchor slots
    anchors, valid = sample_anchors(candidate_anchors(seg, loss), 40, [0, 1, 2])
    assert not bool(valid.all())
    aux = torch.randn(N, T, 384, generator=g)
    blk = _blocks(drafter, ids, pos, seg, anchors, valid)
    dense = _run(drafter, embed, blk, aux, pos, "sdpa")
    flex = _run(drafter, embed, blk, aux, pos, "flex")
    assert torch.allclose(flex, dense, atol=2e-5), (flex - dense).abs().max()


def test_kernel_choice():
    assert resolve_kernel("auto", torch.device("cpu")) == "sdpa"
    for bad in ("dense", "flex"):  # flex trains on CUDA only (no CPU backward)
        with pytest.raises(ValueError, match="train.attn_kernel"):
            resolve_kernel(bad, torch.device("cpu"))


def test_flex_drafter_traced_whole_is_one_graph_and_equals_eager():
    """train.compile traces the whole drafter, flex BlockMasks included: the same output as the
    eager drafter, and one graph for two batches of one shape with different masks (dynamo's
    eager backend here; inductor's kernels are the GPU tier's)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(4)
    drafter = _drafter(window=64, block_size=4)
    embed = torch.nn.Embedding(512, 128)
    ids, aux, pos, seg = _row(T=200)
    torch._dynamo.reset()
    traced = torch.compile(drafter, backend="eager", dynamic=False)
    graphs = []
    for start in (3, 5):  # two anchor sets, same count: same shapes, different masks
        anchors = torch.arange(start, start + 160, 4)[None]
        blk = _blocks(drafter, ids, pos, seg, anchors, torch.ones_like(anchors, dtype=torch.bool))
        want = _run(drafter, embed, blk, aux, pos, "flex")
        got = _run(traced, embed, blk, aux, pos, "flex")
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert graphs[0] >= 1 and graphs[1] == graphs[0]
    torch._dynamo.reset()
