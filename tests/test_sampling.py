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


def test_eval_tau_t_matches_brute_force(tiny_qwen):
    """tau_t0 == tau; tau_t{T} = 1 + mean over the greedy walk's rounds of
    sum_k prod_{i<=k} sum_x min(p, q), with p from a plain HF forward of the target and q from
    the training-path drafter forward, per anchor."""
    from test_drafter import _forward

    from dflash.decoding.rejection import overlap
    from dflash.eval.offline import evaluate
    from dflash.eval.sets import consistent_greedy
    from dflash.train.step import Heads

    d = make_drafter(tiny_qwen, block_size=4)
    heads = Heads(tiny_qwen.embed_tokens, tiny_qwen.lm_head)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 500, (8,), generator=g).tolist()
    comp = tiny_qwen.model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False)[
        0, 8:
    ].tolist()
    item = consistent_greedy(tiny_qwen, prompt, comp)
    temps = [0.0, 0.7, 1.0]
    _, summary = evaluate(d, heads, [item], [], temperatures=temps, top_p=0.9, top_k=50)
    assert summary["tau_t0"] == summary["tau"]

    from dflash.eval.metrics import walk_chain

    P, L = len(prompt), item.completion_ids.numel()
    ids = torch.cat([item.prompt_ids, item.completion_ids])[None]
    T = ids.shape[1]
    with torch.no_grad():
        p_logits = tiny_qwen.model(ids).logits[0].float()  # row t: distribution of token t+1
        anchors = torch.arange(P, T)[None]
        h = _forward(
            d,
            heads.embed,
            ids,
            item.aux_TF[None],
            torch.arange(T)[None],
            torch.zeros(1, T, dtype=torch.long),
            anchors,
        )
        q_logits = d.logits(h[:, 1:], heads.lm_head.weight)  # [L, D, V]
    walk = walk_chain(q_logits.argmax(-1), item.completion_ids)
    for temp in (0.7, 1.0):
        total = 0.0
        for s, avail in zip(walk.anchors, walk.available):
            survive = 1.0
            for k in range(1, avail + 1):
                pk = warp(p_logits[P + s + k - 1], temp, 0.9, 50)
                qk = warp(q_logits[s, k - 1], temp, 0.9, 50)
                survive *= float(overlap(pk, qk))
                total += survive
        ref = 1 + total / len(walk.anchors)
        assert summary[f"tau_t{temp:g}"] == pytest.approx(ref, rel=1e-4), temp
    assert L >= 2 and summary["tau_t1"] != summary["tau"]


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
    assert 1.0 <= out["eval/tau_t1"] <= cfg.drafter.block_size
