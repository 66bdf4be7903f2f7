"""eval.tree_rules: DDTree walked with other ways of scoring the tree, beside the drafter's own.

Each rule's figures equal a brute-force search (every prefix of a short block scored, the best b
kept, the deepest greedy prefix among them accepted, rounds walked as an engine would), and
`coverage` with the selector's pair term at zero is DDTree over softmax(logits) exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import get_target
from test_dflash2 import _dflash2

from dflash.config.eval import EvalConfig, TreeRule
from dflash.decoding import generate_ar
from dflash.decoding.steps import DrafterState
from dflash.eval.offline import evaluate
from dflash.eval.sets import consistent_greedy
from dflash.target.shape import Heads
from dflash.tools.testing import OracleDrafter


def test_rule_names_parse_and_bad_ones_are_refused():
    assert TreeRule.parse("t0.7") == TreeRule("t0.7", 0.7, False)
    assert TreeRule.parse("coverage") == TreeRule("coverage", None, True)  # own temperature
    assert TreeRule.parse("coverage_t1.5") == TreeRule("coverage_t1.5", 1.5, True)
    for bad in ("t0", "t-1", "tx", "wide", "coverage_coverage", "t0.5_", "tinf"):
        with pytest.raises(ValueError, match="tree rule"):
            TreeRule.parse(bad)
    with pytest.raises(ValueError, match="twice"):
        EvalConfig(tree_rules=["t2", "t2"]).validate()
    with pytest.raises(ValueError, match="unknown part 'deep'"):
        EvalConfig(tree_rules=["deep"]).validate()


def _setup(block_size, zero_pair=False):
    target = get_target("tiny_llama")
    heads = Heads(target.embed_tokens, target.lm_head)
    prompt = list(range(3, 19))
    ar = generate_ar(target, prompt, 40)
    item = consistent_greedy(target, prompt, ar.tokens)
    truth = prompt + item.completion_ids.tolist()
    base = _dflash2(target, block_size=block_size)
    if zero_pair:
        with torch.no_grad():
            base.candidate_selector.successor_codebook.zero_()
    d = OracleDrafter(base, target.lm_head.weight, truth, pattern="mixed", seed=3)
    return target, heads, prompt, item, d


def _brute_force_tau(target, d, prompt, item, rule: TreeRule, budget: int) -> float:
    """Every prefix of every anchor's block scored by `rule`, the best `budget` kept."""
    ds = DrafterState(target, d)
    comp = item.completion_ids.tolist()
    P, L = len(prompt), len(comp)
    i, accepted = 0, []
    while i < L - 1:
        ds.ctx_kv, ds.T = None, 0  # the context up to the anchor, as decoding holds it
        ds.append(item.aux_TF[: P + i])
        with torch.no_grad():
            h = ds.draft_hidden(P + i, comp[i])[None]
            logits = d.logits(h, target.lm_head.weight)
            scores, cand = d.tree_scores(h, logits, torch.tensor([comp[i]]), 1.0)
        T = rule.temperature or d.tree_temperature  # the drafter's own: DFlash2 1.5
        lp = torch.log_softmax(scores[0].double() / T, -1)  # [D, P, K]
        if rule.coverage:
            lg = logits[0].double()
            mass = torch.logsumexp(lg.gather(-1, cand[0]), -1) - torch.logsumexp(lg, -1)
            lp = lp + mass[:, None, None]
        D, K = cand.shape[1:]
        scored = []  # (score, candidate indices) of every prefix
        for d_ in range(1, D + 1):
            for path in itertools.product(range(K), repeat=d_):
                s, prev = 0.0, 0
                for t, c in enumerate(path):
                    s += float(lp[t, prev, c])
                    prev = c
                scored.append((s, path))
        scored.sort(key=lambda x: -x[0])
        tree = {tuple(int(cand[0, t, c]) for t, c in enumerate(p)) for _, p in scored[:budget]}
        avail = min(D, L - 1 - i)
        acc = 0
        while acc < avail and tuple(comp[i + 1 : i + 2 + acc]) in tree:
            acc += 1
        accepted.append(acc)
        i += acc + 1
    return 1.0 + sum(accepted) / len(accepted)


@pytest.mark.parametrize("rule", ["t1", "t1.5", "t0.5", "coverage", "coverage_t0.6"])
def test_rule_figures_equal_brute_force(rule):
    target, heads, prompt, item, d = _setup(block_size=4)
    budgets = [3, 9]
    _, summary = evaluate(d, heads, [item], budgets, tree_rules=[rule])
    r = TreeRule.parse(rule)
    for b in budgets:
        want = _brute_force_tau(target, d, prompt, item, r, b)
        assert summary[f"rule/{rule}/tau@{b}"] == pytest.approx(want, abs=1e-12), (rule, b)
        # the drafter's own figures are untouched: its scores at its tree_temperature (1.5)
        own = _brute_force_tau(target, d, prompt, item, TreeRule(), b)
        assert summary[f"tau@{b}"] == pytest.approx(own, abs=1e-12)
        if rule == "t1.5":
            assert summary[f"rule/{rule}/tau@{b}"] == summary[f"tau@{b}"]


def test_rules_change_the_tree():
    """Not a no-op: across temperatures the figures at some budget differ (a sharper or flatter
    tree spends the budget elsewhere)."""
    _, heads, _, item, d = _setup(block_size=6)
    rules = ["t0.3", "t3"]
    _, s = evaluate(d, heads, [item], [2, 4, 8], tree_rules=rules)
    assert any(s[f"rule/t0.3/tau@{b}"] != s[f"rule/t3/tau@{b}"] for b in (2, 4, 8)), s


def test_coverage_without_pair_term_is_ddtree_over_the_logits():
    """With the selector's pair term at zero its rows are softmax over the K candidates of the
    logits; coverage turns them into softmax(logits) itself, so the tree is DFlash's per-position
    DDTree (exact for budgets <= K)."""
    _, heads, _, item, d = _setup(block_size=6, zero_pair=True)
    budgets = [2, 5]  # selector_top_k = 5
    _, cov = evaluate(d, heads, [item], budgets, tree_rules=["coverage_t1"])
    d.tree_scores = lambda *a: None  # the drafter's tree becomes the per-position one
    _, flat = evaluate(d, heads, [item], budgets, tree_rules=["t1"])
    for b in budgets:
        got, want = cov[f"rule/coverage_t1/tau@{b}"], flat[f"rule/t1/tau@{b}"]
        assert got == pytest.approx(want, abs=1e-12), b
    assert cov["tau"] == flat["tau"]


def test_coverage_is_refused_for_a_dflash_tree():
    _, heads, _, item, d = _setup(block_size=4)
    d.tree_scores = lambda *a: None
    _, s = evaluate(d, heads, [item], [4], tree_rules=["t0.5"])  # a temperature is fine
    assert "rule/t0.5/tau@4" in s
    with pytest.raises(ValueError, match="coverage applies to DFlash2"):
        evaluate(d, heads, [item], [4], tree_rules=["coverage"])
