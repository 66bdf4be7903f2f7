"""The top-k of each row of a wide matrix (DFlash2's candidates over the vocabulary) in two
short passes instead of one radix select over the whole row.

Legend: c rows, V columns (a multiple of T), T columns a tile, n = V / T tiles.

Each row is cut into tiles of T columns. A row's k largest values all lie in the k tiles with
the largest maxima: were one of them in another tile, the k tiles ranked above it would each hold
a larger value, k values above one of the k largest. So one max-reduction over the row ([c, n]
tile maxima), a top-k over those n maxima, and a top-k over the k x T values of the chosen tiles
give the same values as `torch.topk` over the row, in the same (descending) order. Tied values
may come back with other indices than `torch.topk`'s (which promises no order among ties either).
On CUDA the radix select over a 151,936-wide bf16 row is several passes over it; the max is one.
"""

from __future__ import annotations

import torch

TILE = 128  # columns a tile: the Qwen vocab (151,936) is 1,187 tiles of 128


def tiled_topk(
    x: torch.Tensor, k: int, tile: int = TILE, tile_max: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries along the last dim, descending, as
    ``x.topk(k, dim=-1)``. A row that is not a whole number of tiles, or narrower than 4k
    tiles, takes ``torch.topk`` itself (vocabularies are padded to multiples of 128 as a rule:
    Qwen2.5's 151,936, Qwen3.6's 248,320, SmolLM2's 49,152). `tile_max`: the [c, n] tile
    maxima where a pass over x already formed them (the fused head's tiled CE stats)."""
    V = x.shape[-1]
    if k < 1 or V % tile or V // tile < 4 * k or x.numel() == 0:
        return x.topk(min(k, V), dim=-1)
    lead = x.shape[:-1]
    x_cnT = x.reshape(-1, V).unflatten(1, (V // tile, tile))
    if tile_max is None:
        tile_max = x_cnT.amax(-1)
    tiles = tile_max.reshape(-1, V // tile).topk(k, dim=-1).indices  # [c, k]
    cand = x_cnT.gather(1, tiles[..., None].expand(-1, -1, tile))  # [c, k, T], no index copy
    v, j = cand.flatten(1).topk(k, dim=-1)
    cols = tiles.gather(1, j // tile) * tile + j % tile
    return v.reshape(*lead, k), cols.reshape(*lead, k)
