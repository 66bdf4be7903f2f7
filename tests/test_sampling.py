"""Acceptance at temperature > 0: the warp against hand-computed cases, the expected accepted
length against exact enumeration and against Monte-Carlo runs of the rejection rule, and the
offline eval's tau_t{T} against a brute force over the greedy walk."""

import itertools
import math

import pytest
import torch
from conftest import make_drafter

from dflash.decoding.rejection import expected_accept_length, rejection_sample_block, warp


def test_warp_hand_computed():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0])
    e = [math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)]
    assert torch.equal(warp(x, 0.0), torch.tensor([1.0, 0, 0, 0]))
    assert torch.allclose(warp(x, 1.0), torch.tensor(e) / sum(e))
    e2 = [math.exp(v / 0.5) for v in (2.0, 1.0, 0.0, -1.0)]
    assert torch.allclose(warp(x, 0.5), torch.tensor(e2) / sum(e2))
    top2 = torch.tensor([e[0], e[1], 0, 0]) / (e[0] + e[1])
    assert torch.allclose(warp(x, 1.0, top_k=2), top2)
    p = [v / sum(e) for v in e]  # 0.644, 0.237, 0.087, 0.032
    # top_p=0.7: the smallest prefix with mass >= 0.7 is the first two tokens
    assert torch.allclose(warp(x, 1.0, top_p=0.7), torch.tensor([p[0], p[1], 0, 0]) / (p[0] + p[1]))
    assert torch.allclose(warp(x, 1.0, top_p=0.5), torch.tensor([1.0, 0, 0, 0]))
    with pytest.raises(ValueError, match="top_p"):
        warp(x, 1.0, top_p=0.0)


def _rand_dists(D, V, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(D + 1, V, generator=g).double().mul(1.5).softmax(-1)
    q = torch.randn(D, V, generator=g).double().mul(1.5).softmax(-1)
    return p, q


def test_expected_length_equals_enumeration():
    """sum over all draft tuples (x_i ~ q_i) of P(tuple) * E[accepted | tuple], with
    P(position i accepts | x_i) = min(1, p_i(x_i) / q_i(x_i))."""
    D, V = 3, 4
    p, q = _rand_dists(D, V, 0)
    total = 0.0
    for xs in itertools.product(range(V), repeat=D):
        prob = math.prod(float(q[i, x]) for i, x in enumerate(xs))
        survive, acc = 1.0, 0.0
        for i, x in enumerate(xs):
            survive *= min(1.0, float(p[i, x] / q[i, x]))
            acc += survive
        total += prob * acc
    assert expected_accept_length(p[:D], q) == pytest.approx(total, abs=1e-12)


def test_rejection_rule_monte_carlo():
    """Drafting x_i ~ q_i and running the rule: mean accepted -> the expectation; the token
    emitted at position 0 (accepted draft or resample) is distributed as p_0."""
    D, V, n = 3, 4, 6000
    p, q = _rand_dists(D, V, 1)
    p, q = p.float(), q.float()
    g = torch.Generator().manual_seed(2)
    acc, first = [], torch.zeros(V)
    for _ in range(n):
        draft = torch.multinomial(q, 1, generator=g).flatten()
        a, nxt = rejection_sample_block(p, q, draft, g)
        acc.append(a)
        first[int(draft[0]) if a > 0 else nxt] += 1
    mean, sd = sum(acc) / n, torch.tensor(acc, dtype=torch.float64).std().item()
    assert abs(mean - expected_accept_length(p[:D], q)) < 4 * sd / math.sqrt(n)
    assert (first / n - p[0]).abs().max() < 4 * math.sqrt(0.25 / n)


def test_all_accepted_samples_the_bonus_from_the_last_distribution():
    D, V = 2, 3
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample_block(p, q, torch.tensor([1, 2]), torch.Generator().manual_seed(0)) == (
        D,
        0,
    )
    # a rejected draft (p(x)=0): resampled from max(p - q, 0)
    q2 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample_block(p, q2, torch.tensor([0, 2]), torch.Generator()) == (0, 1)
    assert V == 3


def _toy_target():
    """A random llama with a 6-token vocabulary: every sampled block of 3 drafts (6^3) can be
    enumerated. lm_head_scale spreads the logits, so the distributions are far from uniform."""
    from dflash.config import TargetConfig
    from dflash.target.load import load_target

    cfg = dict(
        model_type="llama",
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    tcfg = TargetConfig(
        name="toy6", config=cfg, device="cpu", dtype="float32", init_std=0.2, lm_head_scale=3.0
    )
    return load_target(tcfg, num_aux=2)


def _enumerate_round(target, q_DV, prefix, greedy, avail, temp, top_p, mode):
    """E[accepted drafts] of one verify round by enumerating every block x ~ prod q_i: position
    i accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)), p_i the target's distribution
    given the prefix and x_1..x_{i-1} ("exact"), or along the greedy completion ("greedy_p":
    what the offline eval assumes), or along it counting only x_i = g_i ("greedy_only")."""
    D, V = q_DV.shape
    cache = {}

    def p_at(tokens):
        key = tuple(tokens)
        if key not in cache:
            with torch.no_grad():
                logits = target.model(torch.tensor([list(prefix) + list(tokens)])).logits[0, -1]
            cache[key] = warp(logits, temp, top_p)
        return cache[key]

    total = 0.0
    for xs in itertools.product(range(V), repeat=D):
        prob = math.prod(float(q_DV[i, x]) for i, x in enumerate(xs))
        survive, acc = 1.0, 0.0
        for i in range(min(D, avail)):
            x = xs[i]
            if mode == "greedy_only" and x != greedy[i]:
                break
            ctx = xs[:i] if mode == "exact" else greedy[:i]
            survive *= min(1.0, float(p_at(ctx)[x] / q_DV[i, x]))
            acc += survive
        total += prob * acc
    return total


def test_eval_tau_t_equals_an_enumeration_of_sampled_blocks():
    """tau_t{T} and tau_t{T}_lower against every sampled block of every round of the greedy walk
    on a toy target (V=6, 3 drafts): the upper estimate is the enumeration with the target's
    distributions kept on the greedy path, the lower bound the enumeration counting greedy
    tokens only; the exact expectation (the target conditioned on the sampled drafts) lies at or
    above the lower bound and, here, below the upper estimate."""
    from test_drafter import _reference

    from dflash.eval.metrics import walk_chain
    from dflash.eval.offline import evaluate
    from dflash.eval.sets import consistent_greedy
    from dflash.target.shape import Heads

    target = _toy_target()
    d = make_drafter(target, block_size=4, std=0.3)
    heads = Heads(target.embed_tokens, target.lm_head)
    prompt = [1, 3, 0, 2, 4, 1]
    ids = list(prompt)
    with torch.no_grad():  # greedy by hand: generate() would stop at the config's eos id
        for _ in range(12):
            ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
    item = consistent_greedy(target, prompt, ids[len(prompt) :])
    temps, top_p = [0.0, 0.7, 1.0], 0.9
    _, summary = evaluate(d, heads, [item], [], temperatures=temps, top_p=top_p)
    assert summary["tau_t0"] == summary["tau"] and "tau_t0_lower" not in summary

    P, L = len(prompt), item.completion_ids.numel()
    ids = torch.cat([item.prompt_ids, item.completion_ids])[None]
    with torch.no_grad():  # q: an independent per-anchor drafter forward
        h = _reference(d, heads.embed, ids, item.aux_TF[None], torch.arange(P, P + L)[None])
        q_logits = d.logits(h[:, 1:], heads.lm_head.weight)  # [L, D, V]
    walk = walk_chain(q_logits.argmax(-1), item.completion_ids)
    assert L >= 6 and len(walk.anchors) >= 3
    for temp in (0.7, 1.0):
        sums = dict(exact=0.0, greedy_p=0.0, greedy_only=0.0)
        for s, avail in zip(walk.anchors, walk.available):
            q = warp(q_logits[s], temp, top_p)
            prefix = ids[0, : P + s + 1].tolist()
            greedy = item.completion_ids[s + 1 : s + 1 + avail].tolist()
            for mode in sums:
                sums[mode] += _enumerate_round(target, q, prefix, greedy, avail, temp, top_p, mode)
        tau = {m: 1 + v / len(walk.anchors) for m, v in sums.items()}
        print(
            f"T={temp}: exact {tau['exact']:.4f}",
            summary[f"tau_t{temp:g}"],
            summary[f"tau_t{temp:g}_lower"],
        )
        assert summary[f"tau_t{temp:g}"] == pytest.approx(tau["greedy_p"], rel=1e-5), temp
        assert summary[f"tau_t{temp:g}_lower"] == pytest.approx(tau["greedy_only"], rel=1e-5)
        assert tau["greedy_only"] <= tau["exact"] + 1e-9


def test_in_loop_eval_reports_tau_per_temperature(tmp_path):
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from dflash.run.cli import setup, typed
    from dflash.train.colocated import run_colocated

    setup()
    over = [
        "train.steps=2",
        "train.eval_every=2",
        "train.save_every=1000",
        "train.micro_batch_size=2",
        "data.num_samples=4",
        "data.response_len=8",
        "eval.num_prompts=2",
        "eval.completion_len=12",
        "eval.temperatures=[0.0,1.0]",
        "logger=none",
        f"out_root={tmp_path}",
        f"data.cache_dir={tmp_path}/cache",
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = typed(compose("config", overrides=over))
    out = run_colocated(cfg, str(tmp_path / "run"))
    assert out["eval/tau_t0"] == out["eval/tau"]
    # T=1: what eval.py computes on the checkpoint saved at that step (its bf16 serving weights,
    # the run's cached eval set)
    from dflash.drafter.checkpoint import load_drafter
    from dflash.eval.offline import evaluate
    from dflash.eval.sets import build_eval_set
    from dflash.target.shape import Heads
    from dflash.train.build import build_target

    target = build_target(cfg)
    items = build_eval_set(cfg, target, str(tmp_path / "cache"), log=lambda *_: None)
    drafter, _ = load_drafter(out["checkpoint"])
    heads = Heads(target.embed_tokens, target.lm_head)
    _, ref = evaluate(drafter, heads, items, cfg.eval.budgets, temperatures=[0.0, 1.0])
    assert out["eval/tau_t1"] == pytest.approx(ref["tau_t1"], rel=1e-6)
    assert out["eval/tau_t1_lower"] == pytest.approx(ref["tau_t1_lower"], rel=1e-6)
    assert out["eval/tau_t1"] != out["eval/tau_t1_lower"]
