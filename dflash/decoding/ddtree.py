"""DDTree: draft trees from block-diffusion per-position distributions (acceptance of a
greedy continuation by such a tree, for the offline evaluation: dflash.eval.ddtree).

Ringel & Romano 2026, "Accelerating Speculative Decoding with Block Diffusion Draft Trees".

A DFlash drafter emits, for one block anchored at the bonus token, D = B-1 independent
per-position distributions q_1..q_D. A *prefix* is a token tuple (u_1..u_d), 1 <= d <= D,
scored by log prod_i q_i(u_i). The best draft tree of b nodes is the set of the b most
probable prefixes; it is prefix-closed (a prefix of a member scores at least as high), so
it is a tree under the implicit root (the bonus token, not counted in b).

Ordering and tie-breaking
-------------------------
Every prefix gets the key ``(-score, depth, rank tuple)``, where the rank tuple holds, per
depth, the position of the token in that depth's distribution sorted by logprob descending
(``torch.topk`` order for full-vocab inputs; a stable descending sort of the given columns
for top-k inputs, so equal logprobs keep their stored order). The b-tree is the b smallest
keys. The key strictly increases from a node to its first child (depth grows, score cannot
grow) and to its next sibling (same depth, larger rank tuple), so a best-first search that
pops the smallest key and pushes its next sibling and its first child pops *every* prefix
in exact key order, and ancestors always pop before descendants. Node index = pop order
(0-based); ``pop rank`` below is 1-based.

Exactness of top-k inputs
-------------------------
A token of rank >= b at some depth is preceded in key order by its b better siblings, so the
b-tree never uses it: keeping ``k = min(V, b)`` columns per position is exact. Callers that
store only the top-K per position get exact results for every budget <= K (or any budget
when the K columns are the whole vocabulary: pass ``full_vocab=True``).

Shape legend: D drafted positions (block_size - 1), V vocab, K stored top-k columns,
N anchors, b budget (nodes, root excluded).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DDTree",
    "TreeRows",
    "build_ddtree",
    "build_cond_tree",
    "sorted_topk",
    "heap_rows",
]


@dataclass(frozen=True)
class DDTree:
    """A draft tree of ``b`` nodes; node index = best-first pop order.

    tokens      [b] long   token id of each node
    parents     [b] long   parent node index, -1 = child of the root (bonus token);
                           always smaller than the node's own index
    depths      [b] long   1-based depth = drafted position (position offset from the bonus)
    logprobs    [b] float64 cumulative log prob of the node's prefix
    visibility  [b, b] bool visibility[i, j] = j is i or an ancestor of i: the ancestor-only
                           attention mask among tree nodes for tree verification (every node
                           also sees the bonus token and the committed context)
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    logprobs: Tensor
    visibility: Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @property
    def position_offsets(self) -> Tensor:
        """Position of node i = bonus position + position_offsets[i] (the depth)."""
        return self.depths

    def paths(self) -> list[tuple[int, ...]]:
        """Token tuple (u_1..u_d) of every node, root excluded."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        out: list[tuple[int, ...]] = []
        for i, p in enumerate(parents):
            out.append((out[p] if p >= 0 else ()) + (tokens[i],))
        return out


def sorted_topk(
    logprobs_DK: Tensor, ids_DK: Tensor | None, k: int, *, full_vocab: bool
) -> tuple[Tensor, Tensor]:
    """Rows sorted by logprob descending, truncated to k columns (k >= 1)."""
    if ids_DK is None:
        # full-vocab input: topk (on the input's device) is exact, see module docstring
        vals, ids = torch.topk(logprobs_DK.detach(), min(k, logprobs_DK.shape[-1]), dim=-1)
        return vals.cpu(), ids.cpu()
    logprobs_DK = logprobs_DK.detach().to("cpu")
    ids_DK = ids_DK.detach().to("cpu")
    if ids_DK.shape != logprobs_DK.shape:
        raise ValueError(f"top-k ids {tuple(ids_DK.shape)} != logprobs {tuple(logprobs_DK.shape)}")
    if logprobs_DK.shape[-1] < k and not full_vocab:
        raise ValueError(
            f"budget {k} > stored top-k columns {logprobs_DK.shape[-1]}: the tree may need tokens "
            "that were not stored; store more columns, or pass full_vocab=True if the columns "
            "are the whole vocabulary"
        )
    if logprobs_DK.shape[-1] > 1 and not bool(
        (logprobs_DK[..., 1:] <= logprobs_DK[..., :-1]).all()
    ):
        logprobs_DK, order = torch.sort(logprobs_DK, dim=-1, descending=True, stable=True)
        ids_DK = torch.gather(ids_DK, -1, order)
    return logprobs_DK[..., :k], ids_DK[..., :k]


def heap_rows(vals_xDK: Tensor, budget: int) -> list[list[list[float]]]:
    """Python rows for the heap, per leading index, dropping columns that cannot pop.

    Converting tensors to python floats dominates small trees, so columns are cut by a
    score bound first. For any depth d, the ``budget`` prefixes (argmax_1..argmax_{d-1}, r-th
    token at d), r < budget, show that the budget-th best score is at least
    S = max_d (M_{d-1} + lp_d[budget-1]), M_{d-1} = sum of the top-1 logprobs before d. A node
    at depth d in column r scores at most M_{d-1} + lp_d[r]; if that is below S it is not in
    the tree, and neither are its descendants or later siblings. Exact (with a tiny slack for
    summation order); rows keep at least one column.
    """
    v = vals_xDK.detach().to("cpu", torch.float64)
    *_, D, K = v.shape
    v = v.reshape(-1, D, K)
    keep = torch.full((v.shape[0], D), K, dtype=torch.long)
    if 0 < budget <= K:
        m = torch.cat([torch.zeros_like(v[:, :1, 0]), v[:, :-1, 0].cumsum(1)], dim=1)  # M_{d-1}
        s_lb = (m + v[:, :, budget - 1]).amax(1, keepdim=True)
        thr = s_lb - m - 1e-9 * (1.0 + s_lb.abs() + m.abs())
        thr = torch.where(torch.isfinite(s_lb), thr, torch.full_like(thr, -float("inf")))
        keep = (v >= thr.unsqueeze(-1)).sum(-1).clamp(min=1)
    mask = torch.arange(K) < keep.unsqueeze(-1)
    flat = v[mask].tolist()
    out, pos = [], 0
    for counts in keep.tolist():
        rows = []
        for c in counts:
            rows.append(flat[pos : pos + c])
            pos += c
        out.append(rows)
    return out


# ----------------------------------------------------------------------------------------
# best-first search cores (pure python on lists: per-element tensor access is far slower)
#
# Heap entry: (neg_score, depth, code, rank, parent_neg_score, payload). ``code`` encodes the
# rank tuple as a base-K integer, so (depth, code) orders same-depth nodes like their rank
# tuples and entries never compare past it (codes are unique per depth).


def _best_first_tree(lp_rows: list[list[float]], budget: int) -> list[tuple[int, int, int, float]]:
    """Pop the ``budget`` best prefixes; returns (depth, rank, parent_index, score) per node."""
    D, K = len(lp_rows), max(map(len, lp_rows))  # K: base of the rank-tuple code
    nodes: list[tuple[int, int, int, float]] = []
    heap = [(-lp_rows[0][0], 1, 0, 0, 0.0, -1)]
    while heap and len(nodes) < budget:
        neg, d, code, r, pneg, parent = heap[0]
        idx = len(nodes)
        nodes.append((d, r, parent, -neg))
        if r + 1 < len(lp_rows[d - 1]):
            heapq.heapreplace(
                heap, (pneg - lp_rows[d - 1][r + 1], d, code + 1, r + 1, pneg, parent)
            )
        else:
            heapq.heappop(heap)
        if d < D:
            heapq.heappush(heap, (neg - lp_rows[d][0], d + 1, code * K, 0, neg, idx))
    return nodes


# ----------------------------------------------------------------------------------------
# public API


def build_ddtree(
    logprobs_DV: Tensor,
    budget: int,
    topk_ids_DK: Tensor | None = None,
    *,
    full_vocab: bool = False,
) -> DDTree:
    """Best DDTree of ``budget`` nodes (the ``budget`` most probable prefixes).

    ``logprobs_DV`` [D, V]: per-position log probs (any device). With ``topk_ids_DK`` given,
    ``logprobs_DV`` is instead [D, K] top-k logprobs (any column order) and their token ids;
    K >= budget is required unless ``full_vocab=True`` (columns = whole vocabulary).
    The tree has min(budget, number of prefixes) nodes. O(D k + b log b) for k = min(V, b).
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if logprobs_DV.dim() != 2:
        raise ValueError(f"logprobs must be [D, V], got {tuple(logprobs_DV.shape)}")
    D = logprobs_DV.shape[0]
    if budget == 0 or D == 0:
        e = torch.empty(0, dtype=torch.long)
        return DDTree(
            e,
            e.clone(),
            e.clone(),
            torch.empty(0, dtype=torch.float64),
            torch.empty(0, 0, dtype=torch.bool),
        )
    vals_DK, ids_DK = sorted_topk(logprobs_DV, topk_ids_DK, budget, full_vocab=full_vocab)
    nodes = _best_first_tree(heap_rows(vals_DK, budget)[0], budget)
    depths = torch.tensor([n[0] for n in nodes], dtype=torch.long)
    ranks = torch.tensor([n[1] for n in nodes], dtype=torch.long)
    parents = torch.tensor([n[2] for n in nodes], dtype=torch.long)
    logprobs = torch.tensor([n[3] for n in nodes], dtype=torch.float64)
    tokens = ids_DK[depths - 1, ranks]
    return DDTree(tokens, parents, depths, logprobs, _ancestor_mask(parents, D))


def _ancestor_mask(parents_b: Tensor, max_depth: int) -> Tensor:
    """visibility[i, j] = j is i or an ancestor of i; D vectorised hops up the tree."""
    b = parents_b.numel()
    vis = torch.eye(b, dtype=torch.bool)
    rows = torch.arange(b)
    cur = parents_b.clone()
    for _ in range(max_depth):
        ok = cur >= 0
        if not bool(ok.any()):
            break
        vis[rows[ok], cur[ok]] = True
        cur = torch.where(ok, parents_b[cur.clamp(min=0)], cur)
    return vis


# ----------------------------------------------------------------------------------------
# conditional trees: a drafter whose distribution at a position depends on the token before it
# (DFlash2's selector: each position's top-K candidates, scored given the predecessor)


@dataclass(frozen=True)
class TreeRows:
    """The children of every node, for drafters whose position t+1 depends on the token at t.

    Over anchors a, depths t (0 = the bonus token, the root) and the candidates p of depth t
    (the root's row is the same for every p; only p = 0 is read):

    logprobs [n, D, K, K] float  log q(child | parent) of the children at depth t+1 of candidate
                                 p, best first (a stable descending sort)
    order    [n, D, K, K] long   the candidate index (at depth t+1) of each child in that order
    cand     [n, D, K]    long   token id of candidate j at depth t+1

    A prefix (u_1..u_d) scores sum_t log q(u_t | u_{t-1}); the best tree of b nodes is again
    the b best prefixes (a child never scores above its parent), found by the same best-first
    search with the children of each node read from its own row: a node's key is
    (-score, depth, rank tuple), the rank of each token in its parent's row. With one row per
    depth shared by every parent this is DDTree over per-position distributions exactly.
    Exact for every budget among the candidates: a token outside a depth's K is never drafted.
    """

    logprobs: Tensor
    order: Tensor
    cand: Tensor

    @classmethod
    def from_scores(
        cls, scores_nDKK: Tensor, cand_nDK: Tensor, log_mass_nD: Tensor | None = None
    ) -> TreeRows:
        """From the children's scores [n, D, K(parent), K(child)] (logits of q(. | parent)),
        on any device; stored on the CPU. ``log_mass_nD`` (log of a mass per depth, e.g. the
        share of softmax(logits) the depth's K candidates hold) is added to every row of that
        depth (eval.tree_rules)."""
        lp = torch.log_softmax(scores_nDKK.detach().double(), -1)
        if log_mass_nD is not None:
            lp = lp + log_mass_nD.detach().double()[:, :, None, None]
        lp, order = torch.sort(lp, dim=-1, descending=True, stable=True)
        return cls(lp.cpu(), order.cpu(), cand_nDK.detach().cpu())

    @staticmethod
    def cat(rows: list[TreeRows]) -> TreeRows:
        """The anchors of several TreeRows, in order."""
        return TreeRows(*(torch.cat(parts) for parts in zip(*(r._parts() for r in rows))))

    def __getitem__(self, anchors) -> TreeRows:
        """The rows of some anchors (a slice or index tensor over n)."""
        return TreeRows(*(x[anchors] for x in self._parts()))

    def _parts(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.logprobs, self.order, self.cand


def _cond_tree_nodes(lp, order, budget: int) -> list[tuple[int, int, int, float]]:
    """Pop the ``budget`` best prefixes of one anchor's rows (python lists [D][K][K]); returns
    (depth, candidate index, parent_index, score) per node, in pop order."""
    D, K = len(lp), len(lp[0][0])
    nodes: list[tuple[int, int, int, float]] = []
    # (neg_score, depth, code, rank, parent_neg_score, parent_index, parent_candidate)
    heap = [(-lp[0][0][0], 1, 0, 0, 0.0, -1, 0)]
    while heap and len(nodes) < budget:
        neg, d, code, r, pneg, parent, pc = heap[0]
        c = order[d - 1][pc][r]
        idx = len(nodes)
        nodes.append((d, c, parent, -neg))
        if r + 1 < K:
            sib = (pneg - lp[d - 1][pc][r + 1], d, code + 1, r + 1, pneg, parent, pc)
            heapq.heapreplace(heap, sib)
        else:
            heapq.heappop(heap)
        if d < D:
            heapq.heappush(heap, (neg - lp[d][c][0], d + 1, code * K, 0, neg, idx, c))
    return nodes


def build_cond_tree(rows: TreeRows, budget: int) -> DDTree:
    """The best tree of ``budget`` nodes of one anchor's conditional rows (``rows`` of n = 1)."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    D = rows.cand.shape[1]
    if budget == 0 or D == 0:
        return build_ddtree(torch.empty(0, 1), 0)
    nodes = _cond_tree_nodes(rows.logprobs[0].tolist(), rows.order[0].tolist(), budget)
    depths = torch.tensor([n[0] for n in nodes], dtype=torch.long)
    cands = torch.tensor([n[1] for n in nodes], dtype=torch.long)
    parents = torch.tensor([n[2] for n in nodes], dtype=torch.long)
    logprobs = torch.tensor([n[3] for n in nodes], dtype=torch.float64)
    tokens = rows.cand[0][depths - 1, cands]
    return DDTree(tokens, parents, depths, logprobs, _ancestor_mask(parents, D))
