import torch

torch.set_num_threads(1)

import math  # noqa: E402

import pytest  # noqa: E402

from dflash.decoding.ddtree import build_ddtree  # noqa: E402
from dflash.eval.metrics import (  # noqa: E402
    evaluate_prompt,
    position_accuracy,
    position_hits,
    summarize,
    walk_chain,
    walk_ddtree,
)

G = -7  # garbage token: never a greedy token in these tests


# ---------------------------------------------------------------------------------------
# hand-computed cases


def test_walk_chain_hand_example():
    g = torch.arange(10, 20)  # L = 10, g[i] = 10 + i
    D = 3
    draft = torch.full((10, D), G)
    draft[0] = torch.tensor([11, 12, 99])  # ✓✓✗ acc 2 -> anchor 3
    draft[3] = torch.tensor([14, 98, 16])  # ✓✗✓ acc 1 -> anchor 5 (the late ✓ is wasted)
    draft[5] = torch.tensor([97, 17, 18])  # ✗✓✓ acc 0 -> anchor 6
    draft[6] = torch.tensor([17, 96, 19])  # ✓✗✓ acc 1 -> anchor 8
    draft[8] = torch.tensor([19, 20, 21])  # only 1 position left (g[9]): ✓ acc 1 -> 10, end
    draft[4] = torch.tensor([15, 16, 17])  # perfect but never an anchor
    w = walk_chain(draft, g)
    assert w.anchors == [0, 3, 5, 6, 8]
    assert w.available == [3, 3, 3, 3, 1]
    assert w.accepted == [2, 1, 0, 1, 1]
    assert w.matches == ["✓✓✗", "✓✗✓", "✗✓✓", "✓✗✓", "✓"]
    assert w.num_rounds == 5
    assert w.streak == pytest.approx(5 / 5)
    assert w.tau == pytest.approx(2.0)
    # the walk reads only rows 0..L-2
    assert walk_chain(draft[:9], g).accepted == w.accepted


def test_walk_chain_and_position_accuracy_second_hand_example():
    g = torch.tensor([1, 2, 3, 4, 5])
    draft = torch.tensor([[2, 9], [3, 4], [9, 5], [5, 7], [G, G]])
    # anchor 0: ✓✗ acc 1 -> 2; anchor 2: ✗✓ acc 0 -> 3; anchor 3: ✓ (1 avail) acc 1 -> 5
    w = walk_chain(draft, g)
    assert (w.anchors, w.accepted, w.matches) == ([0, 2, 3], [1, 0, 1], ["✓✗", "✗✓", "✓"])
    assert w.streak == pytest.approx(2 / 3)
    assert w.tau == pytest.approx(5 / 3)
    # pos 1: anchors 0..3 -> ✓✓✗✓ = 3/4; pos 2: anchors 0..2 -> ✗✓✓ = 2/3
    hits, totals = position_hits(draft, g)
    assert hits.tolist() == [3, 2] and totals.tolist() == [4, 3]
    assert position_accuracy(draft, g).tolist() == pytest.approx([0.75, 2 / 3])


def test_position_accuracy_nan_when_position_never_available():
    g = torch.tensor([1, 2])
    acc = position_accuracy(torch.tensor([[2, 3, 4], [G, G, G]]), g)
    assert acc[0] == 1.0 and math.isnan(acc[1]) and math.isnan(acc[2])


def test_degenerate_lengths():
    assert walk_chain(torch.zeros(1, 3, dtype=torch.long), torch.tensor([5])).num_rounds == 0
    assert math.isnan(
        walk_chain(torch.zeros(0, 3, dtype=torch.long), torch.tensor([], dtype=torch.long)).streak
    )
    with pytest.raises(ValueError):
        walk_chain(torch.zeros(3, 2, dtype=torch.long), torch.arange(6))  # needs 5 rows


# ---------------------------------------------------------------------------------------
# next-anchor rule


def _perfect_on_path_poisoned_elsewhere(L, D, step):
    """Drafts that are perfect only at anchors 0, step, 2*step, ... (step = D + 1)."""
    g = torch.arange(100, 100 + L)
    idx = (torch.arange(L)[:, None] + torch.arange(1, D + 1)[None, :]).clamp(max=L - 1)
    draft = g[idx].clone()
    off_path = torch.arange(L) % step != 0
    draft[off_path] = G
    return g, draft, off_path


def test_next_anchor_is_anchor_plus_accepted_plus_one():
    L, D = 43, 4
    g, draft, off_path = _perfect_on_path_poisoned_elsewhere(L, D, D + 1)
    w = walk_chain(draft, g)
    # an off-by-one next anchor (a + accepted or a + accepted + 2) lands on a poisoned row;
    # comparing draft[a, k-1] with g[a+k-1] (label shift) misses everywhere
    assert w.anchors == list(range(0, L - 1, D + 1))
    assert w.accepted == [D] * (len(w.anchors) - 1) + [min(D, L - 1 - w.anchors[-1])]
    assert all(m == "✓" * len(m) for m in w.matches)

    # DDTree: stored top-k holds the greedy token on the path, never off the path
    V, K = 1000, 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(L, D, V, generator=gen)
    on_path_tok = (
        g[(torch.arange(L)[:, None] + torch.arange(1, D + 1)[None, :]).clamp(max=L - 1)] - 100
    ) % V
    logits.scatter_(2, on_path_tok.unsqueeze(-1), 30.0)
    logits[off_path] = logits[off_path].scatter(2, on_path_tok[off_path].unsqueeze(-1), -30.0)
    vals, ids = torch.topk(torch.log_softmax(logits, -1), K, dim=-1)
    walks = walk_ddtree(vals, ids, g - 100, [D, 8, 64])  # peaked: the b >= D trees hold the chain
    for b, tw in walks.items():
        assert tw.anchors == w.anchors, b
        assert tw.accepted == w.accepted, b


# ---------------------------------------------------------------------------------------
# DDTree walk vs chain walk: what really holds


def test_ddtree_budget_one_equals_chain_of_depth_one():
    # the 1-node tree is the argmax token of position 1 only
    gen = torch.Generator().manual_seed(1)
    L, D, V = 200, 7, 6
    lp = torch.log_softmax(torch.randn(L, D, V, generator=gen), -1)
    g = torch.randint(0, V, (L,), generator=gen)
    chain1 = walk_chain(lp.argmax(-1)[:, :1], g)
    tw = walk_ddtree(lp, None, g, [1])[1]
    assert tw.anchors == chain1.anchors and tw.accepted == chain1.accepted
    assert 0 < sum(tw.accepted) < len(tw.accepted)  # non-degenerate


def test_ddtree_budget_D_with_peaked_drafts_equals_chain_of_argmax():
    # top-1 prob ~0.99 everywhere: the D best prefixes are exactly the argmax chain's prefixes
    # (any other prefix has a factor <= 0.01 < 0.99**D), so tree@D == chain of argmaxes
    gen = torch.Generator().manual_seed(2)
    L, D, V = 300, 15, 50
    g = torch.randint(0, V, (L,), generator=gen)
    target_LD = g[(torch.arange(L)[:, None] + torch.arange(1, D + 1)[None, :]).clamp(max=L - 1)]
    right = torch.rand(L, D, generator=gen) < 0.85
    top = torch.where(
        right, target_LD, (target_LD + 1 + torch.randint(0, V - 1, (L, D), generator=gen)) % V
    )
    logits = torch.randn(L, D, V, generator=gen).scatter(2, top.unsqueeze(-1), 12.0)
    lp = torch.log_softmax(logits, -1)
    assert float(lp.max(-1).values.exp().min()) > 0.98
    chain = walk_chain(lp.argmax(-1), g)
    vals, ids = torch.topk(lp, 32, dim=-1)
    walks = walk_ddtree(vals, ids, g, [1, D, 32])
    assert walks[D].anchors == chain.anchors and walks[D].accepted == chain.accepted
    assert walks[1].dds <= 1 < walks[D].dds
    assert chain.streak > 2  # non-degenerate


def test_walk_ddtree_full_vocab_equals_topk_and_truncates_at_end():
    gen = torch.Generator().manual_seed(3)
    L, D, V = 60, 5, 50
    lp = torch.log_softmax(torch.randn(L, D, V, generator=gen) * 2, -1)
    g = torch.randint(0, V, (L,), generator=gen)
    right = torch.rand(L, generator=gen) < 0.7
    g[1:] = torch.where(right[1:], lp[:-1, 0].argmax(-1), g[1:])  # position 1 often right
    budgets = [1, 3, 10, 40]
    full = walk_ddtree(lp, None, g, budgets)
    vals, ids = torch.topk(lp, 40, dim=-1)
    top = walk_ddtree(vals, ids, g, budgets)
    perm = torch.randperm(V, generator=gen)
    whole = walk_ddtree(lp[..., perm], perm.expand(L, D, V), g, [100], full_vocab=True)[100]
    assert whole.accepted == walk_ddtree(lp, None, g, [100])[100].accepted
    for b in budgets:
        assert full[b].accepted == top[b].accepted and full[b].anchors == top[b].anchors
        w = full[b]
        assert all(a <= av for a, av in zip(w.accepted, w.available))
        assert w.available[-1] == min(D, L - 1 - w.anchors[-1])
        assert sum(a + 1 for a in w.accepted) in (L - 1, L)  # every token committed once
    assert full[40].dds > full[1].dds > 0
    with pytest.raises(ValueError):
        walk_ddtree(vals, ids, g, [41])  # top-40 cannot answer budget 41


# ---------------------------------------------------------------------------------------
# against a simulated serving engine


def _toy_target(prefix: tuple[int, ...], V: int) -> int:
    return (prefix[-1] * 7 + len(prefix) * 3 + (prefix[-2] if len(prefix) > 1 else 0)) % V


def _toy_draft_logprobs(prefix: tuple[int, ...], D: int, V: int) -> torch.Tensor:
    """Deterministic drafter: sees the committed prefix only; right often, not always."""
    gen = torch.Generator().manual_seed(hash(prefix) % (2**31))
    logits = torch.randn(D, V, generator=gen)
    seq = list(prefix)
    for k in range(D):
        seq.append(_toy_target(tuple(seq), V))
        logits[k, seq[-1]] += 3.0 - 0.3 * k  # confidence decays with depth
    return torch.log_softmax(logits, -1)


def _engine(first: int, L: int, D: int, V: int, budget: int | None):
    """Greedy speculative decoding of L tokens, verifying each round like an engine would.

    budget None = chain (draft = per-position argmax); else a DDTree of ``budget`` nodes whose
    children are followed along the target's own argmax. Returns (tokens, accepted per round).
    """
    out, accepted = [first], []
    while len(out) < L:
        lp = _toy_draft_logprobs(tuple(out), D, V)
        avail = min(D, L - len(out))  # the completion ends (EOS) after L tokens
        new = []
        if budget is None:
            for tok in lp.argmax(-1).tolist()[:avail]:
                if tok != _toy_target(tuple(out + new), V):
                    break
                new.append(tok)
        else:
            tree = build_ddtree(lp, budget)
            children: dict[int, dict[int, int]] = {}
            for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
                children.setdefault(p, {})[t] = i
            node = -1
            while len(new) < avail:
                want = _toy_target(tuple(out + new), V)
                if want not in children.get(node, {}):
                    break
                node = children[node][want]
                new.append(want)
        accepted.append(len(new))
        out += new
        if len(out) < L:
            out.append(_toy_target(tuple(out), V))  # bonus token from the verify pass
    return out, accepted


def test_walks_equal_a_simulated_engine():
    L, D, V, first = 80, 6, 16, 3
    greedy = [first]
    while len(greedy) < L:
        greedy.append(_toy_target(tuple(greedy), V))
    lp_LDV = torch.stack([_toy_draft_logprobs(tuple(greedy[: i + 1]), D, V) for i in range(L)])
    g = torch.tensor(greedy)

    out, acc = _engine(first, L, D, V, None)
    assert out == greedy
    chain = walk_chain(lp_LDV.argmax(-1), g)
    assert chain.accepted == acc and 0 < chain.streak < D

    budgets = [1, 4, 16, 64]
    walks = walk_ddtree(lp_LDV, None, g, budgets)
    for b in budgets:
        out, acc = _engine(first, L, D, V, b)
        assert out == greedy
        assert walks[b].accepted == acc, b
    assert walks[64].dds > chain.streak


# ---------------------------------------------------------------------------------------
# reports


def test_summarize_is_micro_average_over_rounds():
    g1 = torch.arange(10, 20)
    d1 = torch.full((10, 3), G)
    d1[0], d1[3], d1[5] = (
        torch.tensor([11, 12, 99]),
        torch.tensor([14, 98, 16]),
        torch.tensor([97, 17, 18]),
    )
    d1[6], d1[8] = torch.tensor([17, 96, 19]), torch.tensor([19, 20, 21])
    g2 = torch.tensor([1, 2, 3, 4, 5])
    d2 = torch.tensor([[2, 9, G], [3, 4, G], [9, 5, G], [5, 7, G], [G, G, G]])
    r1 = evaluate_prompt(d1, g1, prompt_id="a")  # accepted [2, 1, 0, 1, 1]
    r2 = evaluate_prompt(d2, g2, prompt_id="b")  # accepted [1, 0, 1]
    s = summarize([r1, r2])
    assert s["num_rounds"] == 8 and s["num_prompts"] == 2
    assert s["streak"] == pytest.approx(7 / 8)  # micro; the per-prompt (macro) mean is 5/6
    assert s["tau"] == pytest.approx(15 / 8)
    # pos 1: prompt a hits at anchors 0,3,6,8 of 0..8, prompt b 3 of 4
    assert s["acc_pos_1"] == pytest.approx(7 / 13)
    # pos 3: prompt a hits at anchors 3,5,6 of 0..6, prompt b 0 of 2
    assert s["acc_pos_3"] == pytest.approx(3 / 9)
    d = r1.to_dict()
    assert d["prompt_id"] == "a" and d["matches"][0] == "✓✓✗" and d["streak"] == pytest.approx(1.0)


def test_summarize_tree_keys():
    gen = torch.Generator().manual_seed(4)
    reports = []
    for n, L in enumerate((30, 50)):
        lp = torch.log_softmax(torch.randn(L, 4, 9, generator=gen) * 2, -1)
        g = torch.randint(0, 9, (L,), generator=gen)
        vals, ids = torch.topk(lp, 8, dim=-1)
        reports.append(evaluate_prompt(lp.argmax(-1), g, vals, ids, budgets=[2, 8], prompt_id=n))
    s = summarize(reports)
    for b in (2, 8):
        walks = [r.trees[b] for r in reports]
        n = sum(w.num_rounds for w in walks)
        assert s[f"num_rounds@{b}"] == n
        assert s[f"dds@{b}"] == pytest.approx(sum(sum(w.accepted) for w in walks) / n)
        assert s[f"tau@{b}"] == pytest.approx(s[f"dds@{b}"] + 1)
    assert {f"acc_pos_{k}" for k in range(1, 5)} <= s.keys()
    assert "dds@2" in reports[0].to_dict()
    assert math.isnan(summarize([])["streak"])
