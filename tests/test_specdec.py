"""Real speculative decoding (dflash.decoding): identity with greedy decoding, agreement with the
offline simulation, and the hybrid-cache rollback."""

import math

import pytest
import torch
from conftest import get_target, make_drafter

from dflash.decoding import generate_ar, generate_chain, generate_tree, new_cache
from dflash.eval.metrics import summarize
from dflash.eval.offline import draft_all_anchors, evaluate
from dflash.eval.sets import consistent_greedy
from dflash.target.cache import crop_attention, restore_linear_state, snapshot_linear_state
from dflash.target.shape import Heads
from dflash.tools.testing import CropRollback, OracleDrafter

torch.set_num_threads(1)

TARGETS = ["tiny_llama", "tiny_qwen3_5"]
B = 8  # block size of the test drafters (D = 7 drafted positions)
D = B - 1


def _prompts(n, seed, length=12, vocab=511):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _base_drafter(target):
    # one sliding (causal in block, window 64) + one full layer: both mask rules are exercised
    return make_drafter(
        target,
        block_size=B,
        layer_types=("sliding_attention", "full_attention"),
        window=64,
        seed=0,
        std=0.05,
    )


@pytest.mark.parametrize("name", TARGETS)
def test_outputs_identical_to_greedy(name):
    """chain and tree outputs == plain greedy, with drafters that accept nothing (random),
    partially / fully (oracle 'mixed') and always fully (oracle 'full')."""
    target = get_target(name)
    base = _base_drafter(target)
    budgets = (1, 16, 64) if name == "tiny_llama" else (1, 16)
    n_new = 32
    chain_acc = []
    for i, prompt in enumerate(_prompts(2, seed=1)):
        ar = generate_ar(target, prompt, n_new)
        assert len(ar.tokens) == n_new and ar.num_rounds == 0 and math.isnan(ar.tau)
        # the random drafter (one token per round: slow on the hybrid tree path) on one prompt
        for pattern in ("none", "mixed", "full") if i == 0 else ("mixed", "full"):
            drafter = OracleDrafter(
                base, target.lm_head.weight, prompt + ar.tokens, pattern=pattern, seed=i
            )
            ch = generate_chain(target, drafter, prompt, n_new)
            assert ch.tokens == ar.tokens, (name, pattern, "chain")
            # every round commits accepted + 1 tokens (last round capped at max_new_tokens)
            assert (
                1 + sum(a + 1 for a in ch.accepted) >= n_new > sum(a + 1 for a in ch.accepted[:-1])
            )
            assert ch.tau == pytest.approx(sum(ch.accepted) / len(ch.accepted) + 1)
            assert ch.tokens_per_s > 0
            if pattern == "none":
                assert sum(ch.accepted) <= 2  # a random drafter accepts (almost) nothing
            if pattern == "full":
                assert all(a == min(D, n) for a, n in zip(ch.accepted, _remaining(ch, n_new)))
            if pattern == "mixed":
                chain_acc += ch.accepted
            for b in budgets:
                tr = generate_tree(target, drafter, prompt, n_new, b)
                assert tr.tokens == ar.tokens, (name, pattern, f"tree@{b}")
                assert max(tr.tree_sizes) <= b and max(tr.accepted) <= min(b, D)
    # the mixed oracle produced zero, partial and full-block acceptances
    assert 0 in chain_acc and D in chain_acc and any(0 < a < D for a in chain_acc), chain_acc


def _remaining(res, n_new):
    """Tokens still to produce before each round (the end-of-generation cap)."""
    out, done = [], 1
    for a in res.accepted:
        out.append(n_new - done)
        done += a + 1
    return out


@pytest.mark.parametrize("name", TARGETS)
def test_eos_stops_like_greedy(name):
    target = get_target(name)
    prompt = _prompts(1, seed=3)[0]
    ar_full = generate_ar(target, prompt, 30)
    eos = ar_full.tokens[17]
    ar = generate_ar(target, prompt, 30, eos_token_id=eos)
    assert ar.tokens == ar_full.tokens[: ar_full.tokens.index(eos) + 1]
    drafter = OracleDrafter(
        _base_drafter(target), target.lm_head.weight, prompt + ar_full.tokens, "full"
    )
    assert generate_chain(target, drafter, prompt, 30, eos_token_id=eos).tokens == ar.tokens
    assert generate_tree(target, drafter, prompt, 30, 8, eos_token_id=eos).tokens == ar.tokens


@pytest.mark.parametrize("name", TARGETS)
def test_offline_tau_equals_real_decoding(name):
    """dflash.eval.offline (one batched drafter pass over all anchors, rounds walked offline) and
    real decoding (incremental drafter context, target verifying on its cache) agree exactly:
    same drafted tokens at every visited anchor, same accepted count per round, same tau; also
    for DDTree (offline walk_ddtree vs generate_tree) at two budgets.

    Both walk the same tokens: the eval item's completion is the target's greedy output kept by
    consistent_greedy (cut at the first token a one-shot forward disagrees with, if any), and
    real decoding runs max_new_tokens = that length with the same end cap (acceptance <= tokens
    still needed, walk_chain's avail = min(D, L-1-i)). Drafts are compared exactly: they agree
    unless a near-tie in the drafter's logits flips between the cached and one-shot numerics;
    that would show here as a draft mismatch with a tiny logit margin (none on these seeds).
    """
    target = get_target(name)
    heads = Heads(target.embed_tokens, target.lm_head)
    base = _base_drafter(target)
    budgets = [4, 16]
    L0 = 48
    reports, real_chain, real_tree = [], [], {b: [] for b in budgets}
    for i, prompt in enumerate(_prompts(3, seed=7)):
        ar = generate_ar(target, prompt, L0)
        item = consistent_greedy(target, prompt, ar.tokens)
        L = item.completion_ids.numel()
        assert L >= 40, f"completion cut at {L} by a near-tie"  # stays a meaningful walk
        truth = prompt + item.completion_ids.tolist()
        drafter = OracleDrafter(base, target.lm_head.weight, truth, pattern="mixed", seed=100 + i)

        reps, _ = evaluate(drafter, heads, [item], budgets)
        rep = reps[0]
        draft_LD, _, _ = draft_all_anchors(drafter, heads, item, top_k=0)

        ch = generate_chain(target, drafter, prompt, L)
        assert ch.tokens == item.completion_ids.tolist()
        assert ch.accepted == rep.chain.accepted, (ch.accepted, rep.chain.accepted)
        for r, a in enumerate(rep.chain.anchors):
            assert ch.drafts[r] == draft_LD[a].tolist(), f"round {r}: drafts differ at anchor {a}"
        real_chain.append(ch)
        for b in budgets:
            tr = generate_tree(target, drafter, prompt, L, b)
            assert tr.tokens == item.completion_ids.tolist()
            assert tr.accepted == rep.trees[b].accepted, (b, tr.accepted, rep.trees[b].accepted)
            real_tree[b].append(tr)
        reports.append(rep)

    summary = summarize(reports)
    rounds = sum(c.num_rounds for c in real_chain)
    real_tau = sum(sum(c.accepted) for c in real_chain) / rounds + 1
    assert summary["num_rounds"] == rounds
    assert summary["tau"] == pytest.approx(real_tau, abs=1e-12)
    assert 2.0 < real_tau < B  # a non-trivial acceptance regime
    # the trees accept through the oracle's runner-up positions, beyond the chain
    assert summary["tau@16"] > summary["tau"], summary
    for b in budgets:
        n = sum(t.num_rounds for t in real_tree[b])
        assert summary[f"tau@{b}"] == pytest.approx(
            sum(sum(t.accepted) for t in real_tree[b]) / n + 1, abs=1e-12
        )


def _fresh_state(target, ids):
    cache = new_cache(target.model)
    pos = torch.arange(len(ids))[None]
    target.model(input_ids=torch.tensor([ids]), position_ids=pos, cache=cache, use_cache=True)
    return cache


def test_crop_alone_is_wrong_on_hybrid():
    """On the hybrid target, rolling back a partially accepted verify with
    transformers' crop (activate_past_recording + cache.crop: conv window rolled back, the
    Gated-DeltaNet recurrent state not) leaves a state that differs from a fresh prefill of the
    accepted tokens, and decoding with it departs from greedy; snapshot/restore + re-run gives
    the fresh state and greedy output. On the pure-attention target crop is enough."""
    qwen = get_target("tiny_qwen3_5")
    prompt = _prompts(1, seed=11)[0]
    block = [5, 17, 33, 99, 123, 200, 301, 402]  # a verify block; keep its first 3 tokens
    keep = 3
    P = len(prompt)
    want = _fresh_state(qwen, prompt + block[:keep])

    def verify_then_rollback(mode):
        cache = new_cache(qwen.model)
        if mode == "crop":
            cache.activate_past_recording()
        qwen.model(
            input_ids=torch.tensor([prompt]),
            position_ids=torch.arange(P)[None],
            cache=cache,
            use_cache=True,
        )
        snap = snapshot_linear_state(cache)
        qwen.model(
            input_ids=torch.tensor([block]),
            position_ids=torch.arange(P, P + len(block))[None],
            cache=cache,
            use_cache=True,
        )
        if mode == "crop":
            cache.crop(-(len(block) - keep))
        else:
            restore_linear_state(cache, snap)
            crop_attention(cache, len(block))
            qwen.model(
                input_ids=torch.tensor([block[:keep]]),
                position_ids=torch.arange(P, P + keep)[None],
                cache=cache,
                use_cache=True,
            )
        return cache

    def max_diff(cache, attr):
        d = 0.0
        for got, ref in zip(cache.layers, want.layers):
            if hasattr(ref, attr):
                g, r = getattr(got, attr), getattr(ref, attr)
                g, r = (g[0], r[0]) if isinstance(r, dict) else (g, r)
                assert g.shape == r.shape
                d = max(d, float((g - r).abs().max()))
        return d

    good, bad = verify_then_rollback("auto"), verify_then_rollback("crop")
    assert good.get_seq_length() == bad.get_seq_length() == P + keep
    for attr in ("keys", "conv_states", "recurrent_states"):
        assert max_diff(good, attr) < 1e-5, attr
    assert max_diff(bad, "conv_states") < 1e-5  # crop does roll back the conv window...
    assert max_diff(bad, "recurrent_states") > 1e-3  # ...but not the recurrent state

    # the next token's logits after each rollback vs after the fresh prefill
    nxt = torch.tensor([[7]])
    pos = torch.tensor([[P + keep]])
    ref = qwen.model(input_ids=nxt, position_ids=pos, cache=want, use_cache=True).logits
    lg_good = qwen.model(input_ids=nxt, position_ids=pos, cache=good, use_cache=True).logits
    lg_bad = qwen.model(input_ids=nxt, position_ids=pos, cache=bad, use_cache=True).logits
    assert float((lg_good - ref).abs().max()) < 1e-5
    assert float((lg_bad - ref).abs().max()) > 1e-3

    # end to end, random drafter (every round rolls back): crop departs from greedy on the
    # hybrid target (late: the tiny random target's recurrent contribution is small, so the
    # wrong state flips an argmax only after ~20 tokens), never on the attention target
    for name in ("tiny_qwen3_5", "tiny_llama"):
        target = get_target(name)
        drafter = _base_drafter(target)
        crop_ok = []
        for p in _prompts(2 if name == "tiny_qwen3_5" else 1, seed=12):
            ar = generate_ar(target, p, 32)
            assert generate_chain(target, drafter, p, 32).tokens == ar.tokens
            crop_ok.append(
                generate_chain(target, drafter, p, 32, rollback=CropRollback()).tokens == ar.tokens
            )
        assert all(crop_ok) == (name == "tiny_llama"), (name, crop_ok)


@pytest.mark.parametrize("name", TARGETS)
def test_tree_verify_equals_sequential(name):
    """Numerics of one tree round against running each root path as a plain sequence: every
    node's aux features (attention target: one forward with the ancestor-only mask and depth
    positions; hybrid: the batch of root-to-leaf chains) equal those of a sequential forward of
    its path, and after commit the cache equals a fresh prefill of prompt + accepted path."""
    from dflash.decoding.ddtree import build_ddtree
    from dflash.decoding.steps import TargetRunner
    from dflash.decoding.tree import root_to_leaf_paths, tree_forward
    from dflash.target.cache import expand_cache, gather_attention, is_hybrid_cache

    target = get_target(name)
    run = TargetRunner(target)
    prompt = _prompts(1, seed=5)[0]
    P = len(prompt)
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(
        torch.randn(D, target.vocab_size, generator=g) * 4, -1
    )  # peaked: deep and wide
    tree = build_ddtree(lp, 24)
    assert int(tree.depths.max()) >= 3 and (tree.parents == -1).sum() >= 2
    bonus = 42
    cache = new_cache(target.model)
    run(torch.tensor([prompt]), torch.arange(P)[None], cache, last_only=True)
    node_path = {}  # node index -> its root path (node indices)
    for leaf_path in root_to_leaf_paths(tree):
        for j in range(len(leaf_path)):
            node_path[leaf_path[j]] = leaf_path[: j + 1]

    def seq_aux(nodes):
        ids = prompt + [bonus] + tree.tokens[nodes].tolist()
        _, aux = run(torch.tensor([ids]), torch.arange(len(ids))[None], new_cache(target.model))
        return aux[0, P:]

    if not is_hybrid_cache(cache):
        _, aux = tree_forward(run, cache, tree, bonus, P)
        for i, nodes in node_path.items():
            ref = seq_aux(nodes)
            got = aux[0, [0] + [1 + n for n in nodes]]
            assert torch.allclose(got, ref, atol=1e-5), (i, float((got - ref).abs().max()))
        path = max(node_path.values(), key=len)
        gather_attention(cache, torch.cat([torch.arange(P + 1), P + 1 + torch.tensor(path)]))
        want = new_cache(target.model)
        ids = prompt + [bonus] + tree.tokens[path].tolist()
        target.model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.arange(len(ids))[None],
            cache=want,
            use_cache=True,
        )
        for a, b in zip(cache.layers, want.layers):
            assert a.keys.shape == b.keys.shape and torch.allclose(a.keys, b.keys, atol=1e-5)
            assert torch.allclose(a.values, b.values, atol=1e-5)
    else:
        leaves = root_to_leaf_paths(tree)
        L = 1 + max(len(p) for p in leaves)
        rows = torch.full((len(leaves), L), bonus, dtype=torch.long)
        for r, p in enumerate(leaves):
            rows[r, 1 : 1 + len(p)] = tree.tokens[p]
        before = snapshot_linear_state(cache)
        bcache = expand_cache(target.model, cache, len(leaves))
        _, aux = run(rows, torch.arange(P, P + L)[None].expand(len(leaves), L), bcache)
        for r, p in enumerate(leaves):
            ref = seq_aux(p)
            got = aux[r, : 1 + len(p)]
            assert torch.allclose(got, ref, atol=1e-5), (r, float((got - ref).abs().max()))
        after = snapshot_linear_state(cache)  # the committed cache was not touched
        for s0, s1 in zip(before, after):
            assert all(torch.equal(s0[0][k], s1[0][k]) for k in (0, 1))


def test_tree_refuses_an_attention_kernel_that_ignores_its_mask(monkeypatch):
    """A kernel that does not apply the ancestor-only mask (e.g. flash_attention_2) would verify
    every tree node against the whole block: refused, naming the setting."""
    target = get_target("tiny_llama")
    drafter = _base_drafter(target)
    monkeypatch.setattr(target.model.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        generate_tree(target, drafter, _prompts(1, seed=0)[0], 4, 4)
