"""DDTree acceptance at temperature 0: how deep the target's greedy continuation goes inside
the best draft tree of each budget (the tree and its ordering: dflash.decoding.ddtree).

The target's greedy continuation t_1..t_D is accepted up to the deepest greedy prefix
(t_1..t_d) inside the tree. Pop ranks grow along a path, so greedy prefix p_d is in the
b-tree iff its pop rank <= b, and a single heap run to max(budgets) answers every budget.
The tree is always built over all D positions (an engine does not know where the completion
ends); a shorter target (or a negative target token) only limits how deep acceptance can go.

Shape legend: D drafted positions (block_size - 1), V vocab, K stored top-k columns,
N anchors, b budget (nodes, root excluded).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence

import torch
from torch import Tensor

from ..decoding.ddtree import TreeRows, heap_rows, sorted_topk


def _check_budgets(budgets: Sequence[int]) -> list[int]:
    budgets = [int(b) for b in budgets]
    if any(b < 0 for b in budgets):
        raise ValueError(f"budgets must be >= 0, got {budgets}")
    return budgets


def _greedy_ranks(ids_xDK: Tensor, target_xD: Tensor) -> Tensor:
    """Column of the target token at each depth, -1 when absent/unavailable; [..., D]."""
    D = ids_xDK.shape[-2]
    target_xD = target_xD.to(device="cpu", dtype=torch.long)
    if target_xD.shape[-1] < D:  # target shorter than the block: the rest is unavailable
        pad = target_xD.new_full((*target_xD.shape[:-1], D - target_xD.shape[-1]), -1)
        target_xD = torch.cat([target_xD, pad], dim=-1)
    target_xD = target_xD[..., :D]
    match = (ids_xDK == target_xD.unsqueeze(-1)) & (target_xD >= 0).unsqueeze(-1)
    has = match.any(-1)
    rank = match.to(torch.uint8).argmax(-1)
    return torch.where(has, rank, torch.full_like(rank, -1))


def _path_prefix(ranks_D: list[int]) -> list[int]:
    """Greedy ranks up to (excluding) the first missing depth."""
    for d, r in enumerate(ranks_D):
        if r < 0:
            return ranks_D[:d]
    return ranks_D


def _greedy_pop_ranks(
    lp_rows: list[list[float]], path_ranks: list[int], max_pops: int
) -> list[int]:
    """1-based pop ranks of the greedy prefixes p_1, p_2, ... that pop within ``max_pops``.

    ``path_ranks[d-1]`` is the column of the greedy token at depth d (all >= 0). The result is
    increasing; accepted depth at budget b = number of entries <= b.
    """
    m = len(path_ranks)
    if m == 0 or max_pops <= 0:
        return []
    D, K = len(lp_rows), max(map(len, lp_rows))
    lens = [len(row) for row in lp_rows]
    g = path_ranks + [-1] * (D - m + 1)  # depth > m is never on the path
    out: list[int] = []
    pops = 0
    heap = [(-lp_rows[0][0], 1, 0, 0, 0.0, True)]  # payload: parent is on the greedy path
    heappush, heapreplace, heappop = heapq.heappush, heapq.heapreplace, heapq.heappop
    while heap:
        neg, d, code, r, pneg, parent_on = heap[0]
        pops += 1
        on = parent_on and g[d - 1] == r
        if on:
            out.append(pops)
            if len(out) == m:
                break
        if pops >= max_pops:
            break
        if r + 1 < lens[d - 1]:
            heapreplace(heap, (pneg - lp_rows[d - 1][r + 1], d, code + 1, r + 1, pneg, parent_on))
        else:
            heappop(heap)
        if d < D:
            heappush(heap, (neg - lp_rows[d][0], d + 1, code * K, 0, neg, on))
    return out


def _accepted_per_budget(pop_ranks: list[int], budgets: list[int]) -> list[int]:
    return [bisect_right(pop_ranks, b) for b in budgets]


def ddtree_accept(
    draft_logprobs_DV: Tensor, target_tokens_D: Tensor, budgets: Sequence[int]
) -> dict[int, int]:
    """Accepted depth at T=0 for each budget, from full-vocab draft log probs [D, V].

    ``target_tokens_D``: the target's greedy tokens after the bonus, aligned with the drafted
    positions; it may be shorter than D (end of completion) and a negative token marks an
    unavailable position. Returns {budget: accepted drafted tokens (0..D)}.
    """
    budgets = _check_budgets(budgets)
    if not budgets or draft_logprobs_DV.shape[0] == 0 or max(budgets) == 0:
        return {b: 0 for b in budgets}
    vals_DK, ids_DK = sorted_topk(draft_logprobs_DV, None, max(budgets), full_vocab=True)
    return _accept_prepared(vals_DK, ids_DK, torch.as_tensor(target_tokens_D), budgets)


def ddtree_accept_topk(
    topk_logprobs_DK: Tensor,
    topk_ids_DK: Tensor,
    target_tokens_D: Tensor,
    budgets: Sequence[int],
    *,
    full_vocab: bool = False,
) -> dict[int, int]:
    """``ddtree_accept`` from stored top-k per position ([D, K] logprobs and ids).

    Exact when K >= max(budgets), or for any budget with ``full_vocab=True`` (K == V);
    otherwise raises ValueError. Columns may be in any order (stably re-sorted).
    """
    budgets = _check_budgets(budgets)
    if not budgets or topk_logprobs_DK.shape[0] == 0 or max(budgets) == 0:
        return {b: 0 for b in budgets}
    vals_DK, ids_DK = sorted_topk(
        topk_logprobs_DK, topk_ids_DK, max(budgets), full_vocab=full_vocab
    )
    return _accept_prepared(vals_DK, ids_DK, torch.as_tensor(target_tokens_D), budgets)


def _accept_prepared(
    vals_DK: Tensor, ids_DK: Tensor, target: Tensor, budgets: list[int]
) -> dict[int, int]:
    path = _path_prefix(_greedy_ranks(ids_DK, target).tolist())
    if not path:
        return {b: 0 for b in budgets}
    pop_ranks = _greedy_pop_ranks(heap_rows(vals_DK, max(budgets))[0], path, max(budgets))
    return dict(zip(budgets, _accepted_per_budget(pop_ranks, budgets)))


def ddtree_accept_many(
    topk_logprobs_NDK: Tensor,
    topk_ids_NDK: Tensor | None,
    target_tokens_ND: Tensor,
    budgets: Sequence[int],
    *,
    full_vocab: bool = False,
    chunk: int = 16,
) -> Tensor:
    """Batched ``ddtree_accept_topk`` over N anchors -> LongTensor [N, len(budgets)].

    Negative target tokens mark unavailable positions (pad with -1 at the end of a
    completion). Sorting and target lookup are batched; the heap runs once per anchor.
    ``topk_ids_NDK=None``: full-vocab log probs [N, D, V] (as ``ddtree_accept``).
    """
    budgets = _check_budgets(budgets)
    N, D = topk_logprobs_NDK.shape[0], topk_logprobs_NDK.shape[1]
    out = torch.zeros(N, len(budgets), dtype=torch.long)
    if N == 0 or D == 0 or not budgets or max(budgets) == 0:
        return out
    bmax = max(budgets)
    for s in range(0, N, chunk):
        vals, ids = sorted_topk(
            topk_logprobs_NDK[s : s + chunk],
            None if topk_ids_NDK is None else topk_ids_NDK[s : s + chunk],
            bmax,
            full_vocab=full_vocab,
        )
        ranks = _greedy_ranks(ids, torch.as_tensor(target_tokens_ND[s : s + chunk])).tolist()
        rows = heap_rows(vals, bmax)
        for n, (lp_rows, r) in enumerate(zip(rows, ranks)):
            path = _path_prefix(r)
            if path:
                pops = _greedy_pop_ranks(lp_rows, path, bmax)
                out[s + n] = torch.tensor(_accepted_per_budget(pops, budgets))
    return out


def _cond_greedy_pop_ranks(lp, order, path_c: list[int], max_pops: int) -> list[int]:
    """1-based pop ranks of the greedy prefixes p_1, p_2, ... (``path_c[d-1]``: the candidate
    index of the greedy token at depth d) that pop within ``max_pops``; as
    ``_greedy_pop_ranks`` with each node's children read from its own row."""
    m = len(path_c)
    if m == 0 or max_pops <= 0:
        return []
    D, K = len(lp), len(lp[0][0])
    out: list[int] = []
    pops = 0
    heap = [(-lp[0][0][0], 1, 0, 0, 0.0, True, 0)]  # payload: parent on the greedy path
    heappush, heapreplace, heappop = heapq.heappush, heapq.heapreplace, heapq.heappop
    while heap:
        neg, d, code, r, pneg, parent_on, pc = heap[0]
        c = order[d - 1][pc][r]
        pops += 1
        on = parent_on and d <= m and path_c[d - 1] == c
        if on:
            out.append(pops)
            if len(out) == m:
                break
        if pops >= max_pops:
            break
        if r + 1 < K:
            heapreplace(
                heap, (pneg - lp[d - 1][pc][r + 1], d, code + 1, r + 1, pneg, parent_on, pc)
            )
        else:
            heappop(heap)
        if d < D:
            heappush(heap, (neg - lp[d][c][0], d + 1, code * K, 0, neg, on, c))
    return out


def cond_accept_many(rows: TreeRows, target_tokens_nD: Tensor, budgets: Sequence[int]) -> Tensor:
    """``ddtree_accept_many`` for a drafter whose positions depend on the token before
    (dflash.decoding.ddtree.TreeRows: DFlash2's selector) -> LongTensor [n, len(budgets)]."""
    budgets = _check_budgets(budgets)
    n, D = rows.cand.shape[:2]
    out = torch.zeros(n, len(budgets), dtype=torch.long)
    if n == 0 or D == 0 or not budgets or max(budgets) == 0:
        return out
    ranks = _greedy_ranks(rows.cand, torch.as_tensor(target_tokens_nD)).tolist()
    for a, r in enumerate(ranks):
        path = _path_prefix(r)
        if path:
            lp, order = rows.logprobs[a].tolist(), rows.order[a].tolist()
            pops = _cond_greedy_pop_ranks(lp, order, path, max(budgets))
            out[a] = torch.tensor(_accepted_per_budget(pops, budgets))
    return out
