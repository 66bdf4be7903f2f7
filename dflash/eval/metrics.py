"""Exact offline greedy simulation of speculative decoding (chain and DDTree).

Inputs for one eval prompt (any device; moved to CPU here):
  greedy_L           the target's greedy completion; g[0] is the first generated token, i.e.
                     the bonus token of round 1.
  draft_LD           draft_LD[i, k-1] = drafted token for completion index i+k when the block
                     is anchored at completion index i (holding g[i]); D = block_size - 1.
                     Rows 0..L-2 are read (anchor L-1 has nothing left to verify).
  topk_logprobs_LDK  optional per-anchor, per-position draft top-k log probs (DDTree), with
  topk_ids_LDK       their token ids.

Walk (what a serving engine does at temperature 0): anchor i = 0; while i < L-1:
avail = min(D, L-1-i) positions can be verified, accepted = leading matches of the draft with
g[i+1 : i+1+avail], next anchor i + accepted + 1 (the target's token at the first miss, or
after the last accepted token, is the next bonus). Because the drafter's block at anchor i
depends only on the committed prefix g[:i+1], which is the same in every round that reaches
i, one batched drafter pass over all anchors gives the exact per-round drafts.

Match strings: one character per available position of a round, '✓' if that drafted token
equals the greedy token at its position, '✗' otherwise, judged per position *independently*
of earlier misses (so '✓✗✓' means accepted = 1, and the third token was right but wasted).
Accepted = the number of leading '✓'.

Aggregation (``summarize``): micro-average over rounds of all prompts, e.g. streak =
sum(accepted) / total rounds, tau = streak + 1 = generated tokens / rounds: the figure an
engine reports over a workload. Long prompts weigh more than short ones. Position accuracy
is micro-averaged over all (anchor, position) pairs with that position available.

Shape legend: L completion length, D drafted positions per block, K stored top-k columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .ddtree import cond_accept_many, ddtree_accept_many

__all__ = [
    "ChainWalk",
    "TreeWalk",
    "PromptReport",
    "walk_chain",
    "walk_ddtree",
    "position_hits",
    "position_accuracy",
    "evaluate_prompt",
    "summarize",
]

HIT, MISS = "✓", "✗"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


@dataclass
class ChainWalk:
    """Rounds of chain speculative decoding on one prompt.

    anchors[r]   completion index of round r's bonus token
    available[r] positions verifiable in round r (min(D, L-1-anchor))
    accepted[r]  drafted tokens accepted in round r
    matches[r]   per-position match string of round r (see module docstring)
    """

    anchors: list[int] = field(default_factory=list)
    available: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    matches: list[str] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.accepted)

    @property
    def streak(self) -> float:
        """Mean accepted drafted tokens per round (nan without rounds)."""
        return _mean(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, bonus included = streak + 1."""
        return self.streak + 1.0


@dataclass
class TreeWalk:
    """Rounds of DDTree speculative decoding at one budget on one prompt."""

    budget: int
    anchors: list[int] = field(default_factory=list)
    available: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.accepted)

    @property
    def dds(self) -> float:
        """dds@b: mean accepted drafted tokens per round (comparable to streak)."""
        return _mean(self.accepted)

    @property
    def tau(self) -> float:
        return self.dds + 1.0


def _as_long_cpu(x) -> Tensor:
    return torch.as_tensor(x).detach().to(device="cpu", dtype=torch.long)


def _match_matrix(draft_LD: Tensor, greedy_L: Tensor) -> tuple[Tensor, Tensor]:
    """hit[i, k] = draft[i, k] == g[i+k+1], and avail[i, k] = i+k+1 <= L-1; rows 0..L-2."""
    L, D = greedy_L.numel(), draft_LD.shape[1]
    n = L - 1  # callers guarantee L >= 2
    if draft_LD.shape[0] < n:
        raise ValueError(f"draft has {draft_LD.shape[0]} anchor rows, completion needs {n} (L-1)")
    idx_nD = torch.arange(n).unsqueeze(1) + torch.arange(1, D + 1).unsqueeze(0)
    avail_nD = idx_nD <= L - 1
    target_nD = greedy_L[idx_nD.clamp(max=L - 1)]
    hit_nD = (draft_LD[:n] == target_nD) & avail_nD
    return hit_nD, avail_nD


def walk_chain(draft_LD: Tensor, greedy_L: Tensor) -> ChainWalk:
    """Chain speculative decoding rounds (see module docstring)."""
    draft_LD, greedy_L = _as_long_cpu(draft_LD), _as_long_cpu(greedy_L).reshape(-1)
    L, D = greedy_L.numel(), draft_LD.shape[1]
    walk = ChainWalk()
    if L < 2 or D == 0:
        return walk
    hit_nD, _ = _match_matrix(draft_LD, greedy_L)
    # leading hits per anchor; unavailable positions are misses, so this is capped by avail
    lead_n = hit_nD.to(torch.long).cumprod(dim=1).sum(dim=1).tolist()
    hits = hit_nD.tolist()
    i = 0
    while i < L - 1:
        avail = min(D, L - 1 - i)
        acc = lead_n[i]
        walk.anchors.append(i)
        walk.available.append(avail)
        walk.accepted.append(acc)
        walk.matches.append("".join(HIT if h else MISS for h in hits[i][:avail]))
        i += acc + 1
    return walk


def walk_ddtree(
    topk_logprobs_LDK: Tensor,
    topk_ids_LDK: Tensor | None,
    greedy_L: Tensor,
    budgets: Sequence[int],
    *,
    full_vocab: bool = False,
    tree_rows=None,
) -> dict[int, TreeWalk]:
    """DDTree rounds, each budget walked as its own sequence of rounds.

    ``tree_rows`` (dflash.decoding.ddtree.TreeRows over the anchors, instead of the top-k
    inputs): a drafter whose positions depend on the token before (DFlash2), its tree over
    each candidate's own children.

    ``topk_ids_LDK=None`` means ``topk_logprobs_LDK`` holds full-vocab log probs [L, D, V].
    Top-k inputs need K >= max(budgets) unless ``full_vocab=True``. Near the end of the
    completion the tree is still built over all D positions and acceptance is capped at the
    available positions. One heap run per anchor serves every budget.
    """
    budgets = sorted({int(b) for b in budgets})
    greedy_L = _as_long_cpu(greedy_L).reshape(-1)
    source = tree_rows.cand if tree_rows is not None else topk_logprobs_LDK
    L, D = greedy_L.numel(), source.shape[1]
    walks = {b: TreeWalk(budget=b) for b in budgets}
    if L < 2 or D == 0 or not budgets:
        return walks
    if source.shape[0] < L - 1:
        raise ValueError(f"draft has {source.shape[0]} anchor rows, completion needs {L - 1}")
    if topk_ids_LDK is not None:  # top-k inputs are small: one transfer, not one per anchor
        topk_logprobs_LDK, topk_ids_LDK = (
            topk_logprobs_LDK.detach().cpu(),
            topk_ids_LDK.detach().cpu(),
        )
    # every anchor at once (batched sorts, one heap run each): ~2x faster than one call per
    # visited anchor, though walks visit ~3/4 of them
    tail = torch.cat([greedy_L[1:], greedy_L.new_full((D,), -1)])
    targets = tail.unfold(0, D, 1)[: L - 1]  # -1 past the completion: caps acceptance
    if tree_rows is not None:
        table = cond_accept_many(tree_rows[: L - 1], targets, budgets).tolist()
    else:
        table = ddtree_accept_many(
            topk_logprobs_LDK[: L - 1],
            None if topk_ids_LDK is None else topk_ids_LDK[: L - 1],
            targets,
            budgets,
            full_vocab=full_vocab,
            chunk=L,
        ).tolist()
    for j, b in enumerate(budgets):
        walk, i = walks[b], 0
        while i < L - 1:
            acc = table[i][j]
            walk.anchors.append(i)
            walk.available.append(min(D, L - 1 - i))
            walk.accepted.append(acc)
            i += acc + 1
    return walks


def position_hits(draft_LD: Tensor, greedy_L: Tensor) -> tuple[Tensor, Tensor]:
    """(hits[D], totals[D]) of drafted position k over every anchor where it is available."""
    draft_LD, greedy_L = _as_long_cpu(draft_LD), _as_long_cpu(greedy_L).reshape(-1)
    D = draft_LD.shape[1]
    if greedy_L.numel() < 2:
        z = torch.zeros(D, dtype=torch.long)
        return z, z.clone()
    hit_nD, avail_nD = _match_matrix(draft_LD, greedy_L)
    return hit_nD.sum(0), avail_nD.sum(0)


def position_accuracy(draft_LD: Tensor, greedy_L: Tensor) -> Tensor:
    """Unconditional pos-k accuracy [D] (float64; nan where no anchor has position k)."""
    hits, totals = position_hits(draft_LD, greedy_L)
    return hits.double() / totals.double()


@dataclass
class PromptReport:
    """Everything the evaluation reports for one prompt; ``summarize`` aggregates these."""

    chain: ChainWalk
    trees: dict[int, TreeWalk]
    pos_hits: Tensor  # [D] long
    pos_totals: Tensor  # [D] long
    prompt_id: str | int | None = None
    # DDTree walks of the trees of other rules (eval.tree_rules): rule name -> budget -> walk
    rule_trees: dict[str, dict[int, TreeWalk]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Per-prompt figures (JSON-friendly)."""
        out: dict = {
            "prompt_id": self.prompt_id,
            "num_rounds": self.chain.num_rounds,
            "streak": self.chain.streak,
            "tau": self.chain.tau,
            "matches": list(self.chain.matches),
        }
        for b, w in sorted(self.trees.items()):
            out[f"dds@{b}"] = w.dds
            out[f"tau@{b}"] = w.tau
        for rule, walks in self.rule_trees.items():
            for b, w in sorted(walks.items()):
                out[f"rule/{rule}/tau@{b}"] = w.tau
        acc = self.pos_hits.double() / self.pos_totals.double()
        for k, a in enumerate(acc.tolist(), start=1):
            out[f"acc_pos_{k}"] = a
        return out


def evaluate_prompt(
    draft_LD: Tensor,
    greedy_L: Tensor,
    topk_logprobs_LDK: Tensor | None = None,
    topk_ids_LDK: Tensor | None = None,
    *,
    budgets: Sequence[int] = (),
    full_vocab: bool = False,
    prompt_id: str | int | None = None,
    tree_rows=None,
) -> PromptReport:
    """Chain walk, DDTree walks (when top-k inputs, or a conditional drafter's TreeRows, and
    budgets are given), pos-k accuracy."""
    trees: dict[int, TreeWalk] = {}
    if (topk_logprobs_LDK is not None or tree_rows is not None) and budgets:
        trees = walk_ddtree(
            topk_logprobs_LDK,
            topk_ids_LDK,
            greedy_L,
            budgets,
            full_vocab=full_vocab,
            tree_rows=tree_rows,
        )
    hits, totals = position_hits(draft_LD, greedy_L)
    return PromptReport(walk_chain(draft_LD, greedy_L), trees, hits, totals, prompt_id)


def _tree_figures(out: dict, trees: list[dict], prefix: str) -> None:
    """dds@b, tau@b, num_rounds@b over the prompts' walks (budget -> TreeWalk each)."""
    for b in sorted({b for t in trees for b in t}):
        walks = [t[b] for t in trees if b in t]
        n = sum(w.num_rounds for w in walks)
        dds = sum(sum(w.accepted) for w in walks) / n if n else math.nan
        out[f"{prefix}dds@{b}"] = dds
        out[f"{prefix}tau@{b}"] = dds + 1.0
        out[f"{prefix}num_rounds@{b}"] = n


def summarize(reports: Sequence[PromptReport]) -> dict[str, float]:
    """Aggregate figures, micro-averaged over rounds (and over anchors for acc_pos_k).

    Keys: num_prompts, num_rounds, streak, tau, dds@{b}, tau@{b}, num_rounds@{b},
    acc_pos_{k} (1-based k), and per other tree rule rule/{name}/dds@{b} (tau@, num_rounds@).
    A budget is aggregated over the prompts that report it. Means with no rounds are nan.
    """
    out: dict[str, float] = {"num_prompts": len(reports)}
    rounds = sum(r.chain.num_rounds for r in reports)
    accepted = sum(sum(r.chain.accepted) for r in reports)
    out["num_rounds"] = rounds
    out["streak"] = accepted / rounds if rounds else math.nan
    out["tau"] = out["streak"] + 1.0
    _tree_figures(out, [r.trees for r in reports], "")
    for rule in dict.fromkeys(k for r in reports for k in r.rule_trees):
        _tree_figures(out, [r.rule_trees.get(rule, {}) for r in reports], f"rule/{rule}/")
    if reports:
        D = max(r.pos_hits.numel() for r in reports)
        hits = torch.zeros(D, dtype=torch.long)
        totals = torch.zeros(D, dtype=torch.long)
        for r in reports:
            hits[: r.pos_hits.numel()] += r.pos_hits
            totals[: r.pos_totals.numel()] += r.pos_totals
        for k, (h, t) in enumerate(zip(hits.tolist(), totals.tolist()), start=1):
            out[f"acc_pos_{k}"] = h / t if t else math.nan
    return out
