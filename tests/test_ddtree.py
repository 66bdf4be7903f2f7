import torch

torch.set_num_threads(1)

import itertools  # noqa: E402

import pytest  # noqa: E402

from dflash.decoding.ddtree import build_ddtree  # noqa: E402
from dflash.eval.ddtree import ddtree_accept, ddtree_accept_many, ddtree_accept_topk  # noqa: E402

# ---------------------------------------------------------------------------------------
# brute-force references


def brute_prefixes(lp_DV: torch.Tensor) -> list[tuple[tuple[int, ...], float]]:
    """Every prefix (u_1..u_d), 1 <= d <= D, with its score, best first.

    Scores are summed left to right in double, the same arithmetic as the heap, so the order
    is bit-exact; random continuous logits make exact ties (where tie-breaking would matter)
    practically impossible.
    """
    rows = lp_DV.double().tolist()
    D, V = len(rows), len(rows[0])
    out = []
    for d in range(1, D + 1):
        for toks in itertools.product(range(V), repeat=d):
            s = 0.0
            for i, t in enumerate(toks):
                s += rows[i][t]
            out.append((toks, s))
    out.sort(key=lambda x: (-x[1], len(x[0])))
    return out


def brute_accept(prefixes, target, b: int) -> int:
    top = {p for p, _ in prefixes[:b]}
    acc = 0
    for d in range(1, len(target) + 1):
        if target[d - 1] < 0 or tuple(target[:d]) not in top:
            break
        acc = d
    return acc


def random_lp(gen, D, V, scale=2.0):
    return torch.log_softmax(torch.randn(D, V, generator=gen) * scale, dim=-1)


def peaked_lp(gen, D, V):
    """Drafter-like: top-1 prob from 0.95 (position 1) down to 0.5, the rest spread thinly."""
    logits = torch.randn(D, V, generator=gen, dtype=torch.float64) * 1.5
    p_top = torch.linspace(0.95, 0.5, D, dtype=torch.float64)
    top = torch.randint(0, V, (D,), generator=gen)
    rest = logits.scatter(1, top[:, None], -float("inf")).logsumexp(-1)
    logits[torch.arange(D), top] = torch.log(p_top / (1 - p_top)) + rest
    return torch.log_softmax(logits, dim=-1).float()


def check_tree_structure(tree, D):
    b = tree.num_nodes
    paths = tree.paths()
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (b,)
    assert tree.visibility.shape == (b, b) and tree.visibility.dtype == torch.bool
    for i, p in enumerate(tree.parents.tolist()):
        assert p < i  # ancestors pop first: node indices are topologically sorted
        assert tree.depths[i] == len(paths[i]) <= D
        if p < 0:
            assert len(paths[i]) == 1
        else:
            assert paths[p] == paths[i][:-1]
    assert len(set(paths)) == b
    expected = torch.tensor(
        [[paths[i][: len(paths[j])] == paths[j] for j in range(b)] for i in range(b)],
        dtype=torch.bool,
    )
    assert torch.equal(tree.visibility, expected)
    assert torch.equal(tree.position_offsets, tree.depths)
    # pop order is best-first
    assert bool((tree.logprobs[1:] <= tree.logprobs[:-1]).all())


# ---------------------------------------------------------------------------------------
# build_ddtree


@pytest.mark.parametrize("V,D,seed", [(3, 3, 0), (4, 3, 1), (5, 3, 2), (3, 4, 3), (4, 4, 4)])
def test_build_equals_brute_force_top_b_for_every_budget(V, D, seed):
    gen = torch.Generator().manual_seed(seed)
    lp = random_lp(gen, D, V)
    prefixes = brute_prefixes(lp)
    total = len(prefixes)
    for b in range(1, total + 1):
        tree = build_ddtree(lp, b)
        assert tree.num_nodes == b
        assert set(tree.paths()) == {p for p, _ in prefixes[:b]}, b
        if b in (1, 2, total // 3, total):
            check_tree_structure(tree, D)
    # the full tree: node scores are the brute-force scores, in the same order
    tree = build_ddtree(lp, total)
    assert tree.paths() == [p for p, _ in prefixes]
    assert torch.allclose(
        tree.logprobs, torch.tensor([s for _, s in prefixes], dtype=torch.float64)
    )
    # budget past the number of prefixes: every prefix once
    assert build_ddtree(lp, total + 7).num_nodes == total


def test_build_topk_inputs_match_full_and_are_order_free():
    gen = torch.Generator().manual_seed(5)
    lp = random_lp(gen, 6, 200, scale=3.0)
    for b in (1, 5, 37, 120):
        full = build_ddtree(lp, b)
        vals, ids = torch.topk(lp, b, dim=-1)
        perm = torch.randperm(b, generator=gen)  # stored columns in any order
        for v, i in ((vals, ids), (vals[:, perm], ids[:, perm])):
            t = build_ddtree(v, b, i)
            assert torch.equal(t.tokens, full.tokens)
            assert torch.equal(t.parents, full.parents)
            assert torch.equal(t.visibility, full.visibility)
            assert torch.allclose(t.logprobs, full.logprobs)
    vals, ids = torch.topk(lp, 10, dim=-1)
    with pytest.raises(ValueError):
        build_ddtree(vals, 11, ids)  # would need tokens that were not stored


def test_build_tie_breaking_puts_ancestors_first():
    # position 2 is certain (logprob 0): a child ties its parent's score
    lp = torch.tensor([[0.6, 0.4], [1.0, 0.0]]).log()
    tree = build_ddtree(lp, 4)
    assert tree.paths() == [(0,), (0, 0), (1,), (1, 0)]
    assert tree.parents.tolist() == [-1, 0, -1, 2]
    check_tree_structure(tree, 2)
    # uniform: same-score nodes are ordered by depth, then by rank tuple
    lp = torch.full((2, 3), 1 / 3).log()
    assert build_ddtree(lp, 5).paths() == [(0,), (1,), (2,), (0, 0), (0, 1)]


@pytest.mark.parametrize("peaked", [False, True])
def test_build_large_vocab_matches_beam_reference(peaked):
    # top-b per depth among extensions of the previous depth's top-b, then global top-b:
    # exact because the b-tree is prefix-closed; an independent, vectorised reference.
    # The peaked case is where build's column pruning cuts most rows.
    gen = torch.Generator().manual_seed(6)
    D, V, b = 15, 3000, 300
    lp = (peaked_lp(gen, D, V) if peaked else random_lp(gen, D, V, scale=4.0)).double()
    beam_s, beam_p = torch.zeros(1, dtype=torch.float64), [()]
    all_s, all_p = [], []
    for d in range(D):
        cand = (beam_s[:, None] + lp[d][None, :]).flatten()
        s, idx = torch.topk(cand, min(b, cand.numel()))
        beam_p = [beam_p[i // V] + (i % V,) for i in idx.tolist()]
        beam_s = s
        all_s.append(s)
        all_p += beam_p
    all_s = torch.cat(all_s)
    top = torch.topk(all_s, b).indices.tolist()
    tree = build_ddtree(lp.float(), b)
    assert set(tree.paths()) == {all_p[i] for i in top}
    check_tree_structure(tree, D)


# ---------------------------------------------------------------------------------------
# acceptance


def _targets(gen, lp, V):
    D = lp.shape[0]
    argmax = lp.argmax(-1)
    dev = argmax.clone()
    k = int(torch.randint(0, D, (1,), generator=gen))
    dev[k] = lp[k].topk(2).indices[1]  # the greedy path leaves the argmax at one position
    rand = torch.randint(0, V, (D,), generator=gen)
    short = argmax[: D - 1]  # end of completion: fewer positions than drafted
    holed = argmax.clone()
    holed[D - 2] = -1  # negative = unavailable
    return [argmax, dev, rand, short, holed]


@pytest.mark.parametrize("V,D,seed", [(3, 3, 10), (4, 3, 11), (5, 3, 12), (3, 4, 13), (4, 4, 14)])
def test_accept_equals_brute_force_for_every_budget(V, D, seed):
    gen = torch.Generator().manual_seed(seed)
    for trial in range(6):
        lp = random_lp(gen, D, V, scale=0.5 + trial)  # flat to peaked
        prefixes = brute_prefixes(lp)
        budgets = list(range(0, len(prefixes) + 2))
        vals, ids = torch.topk(lp, V, dim=-1)
        for target in _targets(gen, lp, V):
            expected = {b: brute_accept(prefixes, target.tolist(), b) for b in budgets}
            assert ddtree_accept(lp, target, budgets) == expected
            assert ddtree_accept_topk(vals, ids, target, budgets, full_vocab=True) == expected
            # single-budget calls agree with the one-run-for-all-budgets answer
            for b in (1, 2, V + 1, len(prefixes) // 2):
                assert ddtree_accept(lp, target, [b]) == {b: expected[b]}


def test_accept_topk_and_many_equal_full_variant():
    gen = torch.Generator().manual_seed(20)
    N, D, V = 24, 15, 500
    budgets = [1, 2, 4, 8, 16, 32, 64, 128]
    lp_NDV = torch.log_softmax(torch.randn(N, D, V, generator=gen) * 3, dim=-1)
    tgt_ND = lp_NDV.argmax(-1)
    # perturb the greedy path at random positions: rank 1..5 tokens and a few random ones
    for n in range(N):
        k = int(torch.randint(0, D, (1,), generator=gen))
        r = int(torch.randint(1, 6, (1,), generator=gen))
        tgt_ND[n, k] = lp_NDV[n, k].topk(r + 1).indices[r]
        if n % 5 == 0:
            tgt_ND[n, k:] = torch.randint(0, V, (D - k,), generator=gen)
    tgt_ND[-1, 10:] = -1  # end of completion
    vals, ids = torch.topk(lp_NDV, max(budgets), dim=-1)
    many = ddtree_accept_many(vals, ids, tgt_ND, budgets, chunk=7)
    assert many.shape == (N, len(budgets))
    seen = set()
    for n in range(N):
        full = ddtree_accept(lp_NDV[n], tgt_ND[n], budgets)
        assert ddtree_accept_topk(vals[n], ids[n], tgt_ND[n], budgets) == full
        assert many[n].tolist() == [full[b] for b in budgets]
        assert all(full[a] <= full[b] for a, b in zip(budgets, budgets[1:]))  # monotone
        seen.update(full.values())
    assert len(seen) >= 4  # the cases are not degenerate
    assert many[-1].max() <= 10


@pytest.mark.parametrize("peaked", [False, True])
def test_accept_agrees_with_tree_built_by_build_ddtree(peaked):
    # walking the materialised tree along the target's tokens gives the same depth
    gen = torch.Generator().manual_seed(21)
    D, V = (15, 500) if peaked else (8, 40)
    for trial in range(20):
        lp = peaked_lp(gen, D, V) if peaked else random_lp(gen, D, V, scale=1.0 + trial / 4)
        target = _targets(gen, lp, V)[trial % 3]
        for b in (1, 3, 10, 50, 200):
            tree = build_ddtree(lp, b)
            paths = set(tree.paths())
            walk = 0
            while walk < D and tuple(target[: walk + 1].tolist()) in paths:
                walk += 1
            assert ddtree_accept(lp, target, [b])[b] == walk


def test_accept_budget_one_is_argmax_match():
    gen = torch.Generator().manual_seed(22)
    lp = random_lp(gen, 5, 30)
    target = lp.argmax(-1)
    assert ddtree_accept(lp, target, [1]) == {1: 1}
    target[0] = lp[0].topk(2).indices[1]
    assert ddtree_accept(lp, target, [1, 2])[1] == 0
    assert ddtree_accept(lp, target, [0, 1]) == {0: 0, 1: 0}
    with pytest.raises(ValueError):
        ddtree_accept(lp, target, [-1])
    vals, ids = torch.topk(lp, 4, dim=-1)
    with pytest.raises(ValueError):
        ddtree_accept_topk(vals, ids, target, [5])


# ----------------------------------------------------------------------------- conditional trees
def _cond_rows(n, D, K, seed, shared=False):
    """Random TreeRows: scores [n, D, K, K] (the root's row repeated over parents), candidates of
    distinct tokens per depth; shared=True: one row per depth for every parent."""
    from dflash.decoding.ddtree import TreeRows

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, D, K, K, generator=g, dtype=torch.float64) * 2
    scores[:, 0] = scores[:, 0, :1]  # the root: one parent
    if shared:
        scores[:] = scores[:, :, :1]
    cand = torch.stack([torch.randperm(3 * K, generator=g)[:K] for _ in range(n * D)]).view(n, D, K)
    return TreeRows.from_scores(scores, cand), torch.log_softmax(scores, -1), cand


def _cond_prefixes(lp_DKK, cand_DK):
    """Every prefix of one anchor: (key, tokens), key = (-score, depth, rank tuple), the rank of
    each token in its parent's row sorted descending (stable)."""
    D, K = cand_DK.shape
    order = torch.sort(lp_DKK, dim=-1, descending=True, stable=True).indices.tolist()
    out = []
    for d in range(1, D + 1):
        for cs in itertools.product(range(K), repeat=d):
            score, ranks, pc = 0.0, [], 0
            for t, c in enumerate(cs):
                score += float(lp_DKK[t, pc, c])
                ranks.append(order[t][pc].index(c))
                pc = c
            toks = tuple(int(cand_DK[t, c]) for t, c in enumerate(cs))
            out.append(((-score, d, tuple(ranks)), toks))
    return sorted(out)


@pytest.mark.parametrize("D,K,seed", [(3, 3, 0), (4, 2, 1), (2, 4, 2)])
def test_cond_tree_equals_brute_force_top_b_for_every_budget(D, K, seed):
    """build_cond_tree = the b best prefixes under prod q(u_t | u_{t-1}), in key order; and
    cond_accept_many = the deepest greedy prefix inside that set, for every budget."""
    from dflash.decoding.ddtree import build_cond_tree
    from dflash.eval.ddtree import cond_accept_many

    rows, lp, cand = _cond_rows(3, D, K, seed)
    for a in range(3):
        ranked = _cond_prefixes(lp[a], cand[a])
        one = rows[a : a + 1]
        for b in range(len(ranked) + 2):
            tree = build_cond_tree(one, b)
            assert tree.paths() == [t for _, t in ranked[:b]], (a, b)
            assert torch.allclose(
                tree.logprobs, torch.tensor([-k[0] for k, _ in ranked[:b]], dtype=torch.float64)
            )
            assert all(tree.parents[i] < i for i in range(tree.num_nodes))
        # continuations: the best full path, the same off it at depth 2, absent at depth 1, and
        # the chain of each node's best child
        path = [t for _, t in ranked if len(t) == D][0]
        chain, pc = [], 0
        for t in range(D):
            pc = int(rows.order[a, t, pc, 0])
            chain.append(int(cand[a, t, pc]))
        targets = [list(path), [path[0], -5] + list(path[2:]), [-7] * D, chain]
        budgets = list(range(0, len(ranked) + 1))
        for tgt in targets:
            tgt = torch.tensor(tgt[:D])
            got = cond_accept_many(one, tgt[None], budgets)[0].tolist()
            for b, acc in zip(budgets, got):
                members = {t for _, t in ranked[:b]}
                want = 0
                for d in range(1, D + 1):
                    if tuple(tgt[:d].tolist()) in members:
                        want = d
                    else:
                        break
                assert acc == want, (a, tgt.tolist(), b, acc, want)


def test_cond_tree_with_one_row_per_depth_is_ddtree():
    """When no depth's distribution depends on the token before it, the conditional tree is
    DDTree over the per-position distributions: same nodes, scores and parents."""
    from dflash.decoding.ddtree import build_cond_tree

    rows, lp, cand = _cond_rows(1, 4, 5, 3, shared=True)
    V = 3 * 5
    full = torch.full((4, V), -float("inf"), dtype=torch.float64)
    full.scatter_(1, cand[0], lp[0, :, 0])
    for b in (1, 4, 7, 20, 60):
        a, c = build_ddtree(full, b, full_vocab=True), build_cond_tree(rows, b)
        assert a.paths() == c.paths() and torch.equal(a.parents, c.parents)
        assert torch.allclose(a.logprobs, c.logprobs)
