"""Sampled decoding (dflash.decoding.sampled): at T=0 the greedy decoders exactly; at T>0 the
output is distributed as plain sampling from the target; a drafter whose q is the target's p
has every draft accepted."""

import math
from collections import Counter

import pytest
import torch
from conftest import get_target, make_drafter

from dflash.decoding import Sampling, generate_ar, generate_chain, sample_ar, sample_chain
from dflash.decoding.rejection import warp
from dflash.tools.testing import OracleDrafter

torch.set_num_threads(1)

TARGETS = ["tiny_llama", "tiny_qwen3_5"]


def _prompt(seed, length=10):
    return torch.randint(0, 511, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


_MEMO = {}


def _logits(target, ids):
    """The target's next-token logits after `ids`, from a fresh full forward (no cache)."""
    key = (id(target), tuple(ids))
    if key not in _MEMO:
        with torch.no_grad():
            _MEMO[key] = target.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return _MEMO[key]


@pytest.mark.parametrize("name", TARGETS)
def test_temperature_zero_is_the_greedy_decoder(name):
    """Not a dispatch: the sampling code path itself (warp, multinomial, rejection rule) at T=0
    gives greedy's tokens and chain's per-round acceptances, for zero, partial and full ones."""
    target = get_target(name)
    base = make_drafter(target, block_size=8)
    for i in range(1):
        prompt = _prompt(i)
        ar = generate_ar(target, prompt, 24)
        assert sample_ar(target, prompt, 24, Sampling(0.0, seed=i)).tokens == ar.tokens
        for pattern in ("none", "mixed", "full"):
            drafter = OracleDrafter(base, target.lm_head.weight, prompt + ar.tokens, pattern, i)
            ch = generate_chain(target, drafter, prompt, 24)
            sc = sample_chain(target, drafter, prompt, 24, Sampling(0.0, top_p=0.5, seed=7 + i))
            assert sc.tokens == ar.tokens and sc.accepted == ch.accepted, (pattern, i)
            assert sc.drafts == ch.drafts


def _sequential_oracle(target, prompt, sampling, noise=0.0, seed=0):
    """A drafter that draws its drafts one by one from the target's own warped distribution
    (q_i = p_i given the drafts before it), optionally with Gaussian noise on the logits."""
    hist = list(prompt)
    gen = torch.Generator().manual_seed(seed)

    def draft(ds, start, bonus):
        hist[start:] = [bonus]
        rows, toks = [], []
        for _ in range(ds.spec.block_size - 1):
            lg = _logits(target, hist)
            if noise:
                lg = lg + noise * torch.randn(lg.shape, generator=gen)
            rows.append(lg)
            toks.append(int(torch.multinomial(sampling.probs(lg), 1, generator=gen)))
            hist.append(toks[-1])
        return torch.stack(rows), torch.tensor(toks)

    return draft


@pytest.mark.parametrize("name", TARGETS)
def test_drafter_equal_to_target_has_every_draft_accepted(name):
    target = get_target(name)
    drafter = make_drafter(target, block_size=5)
    for s, sampling in enumerate(
        [Sampling(0.8, seed=1), Sampling(1.0, top_p=0.9, top_k=20, seed=2)]
    ):
        prompt = _prompt(10 + s)
        res = sample_chain(
            target,
            drafter,
            prompt,
            30,
            sampling,
            draft_fn=_sequential_oracle(target, prompt, sampling),
        )
        done, want = 1, []
        for _ in res.accepted:
            want.append(min(4, 30 - done))
            done += want[-1] + 1
        assert res.accepted == want and len(res.tokens) == 30
        # and the drafts are not trivially the greedy tokens (the rule is exercised at T>0)
        assert res.tokens != generate_ar(target, prompt, 30).tokens


def _exact_joint(target, prompt, sampling, n_tok):
    """P(first n_tok sampled tokens) of plain sampling from the target, by enumeration."""
    joint = {(): 1.0}
    for _ in range(n_tok):
        nxt = {}
        for seq, pr in joint.items():
            p = sampling.probs(_logits(target, prompt + list(seq)))
            for x in torch.nonzero(p).flatten().tolist():
                nxt[seq + (x,)] = pr * float(p[x])
        joint = nxt
    return joint


def _tv(joint: dict, samples: list) -> float:
    emp = Counter(samples)
    n = len(samples)
    keys = set(joint) | set(emp)
    return 0.5 * sum(abs(joint.get(k, 0.0) - emp.get(k, 0) / n) for k in keys)


def _marginal(joint: dict, pos: int) -> dict:
    out = Counter()
    for seq, p in joint.items():
        out[seq[pos]] += p
    return out


def _bound(dist: dict, n: int, fail_prob: float = 1e-5) -> float:
    """E[TV] <= 0.5 sum sqrt(p(1-p)/n) (Jensen), and one sample moves TV by at most 1/n, so
    P(TV > that + t) <= exp(-2 n t^2) (McDiarmid): a correct sampler fails w.p. <= fail_prob."""
    mean = 0.5 * sum((p * (1 - p) / n) ** 0.5 for p in dist.values())
    return mean + math.sqrt(math.log(1 / fail_prob) / (2 * n))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3_5"])
def test_sampled_output_is_distributed_as_target_sampling(name):
    """The 2nd and 3rd tokens of spec decoding (a noisy drafter: accepted, rejected-and-resampled
    and capped rounds all occur) over N seeds vs the exact distribution of plain sampling
    (enumerated): total variation within a bound a correct sampler exceeds w.p. <= 1e-5. The same
    check passes `sample_ar`; sampling at a wrong temperature is farther than twice the bound
    (the bound has power)."""
    target = get_target(name)
    drafter = make_drafter(target, block_size=4)
    prompt = _prompt(3, length=8)
    # the tiny targets' logits spread ~0.1: T=0.02 makes a peaked top-3
    joint = _exact_joint(target, prompt, Sampling(0.02, top_k=3), 3)
    N = 600
    spec, accepted = [], Counter()
    for seed in range(N):
        s = Sampling(0.02, top_k=3, seed=seed)
        oracle = _sequential_oracle(target, prompt, s, noise=0.01, seed=seed + 10_000)
        res = sample_chain(target, drafter, prompt, 3, s, draft_fn=oracle)
        spec.append(tuple(res.tokens))
        accepted[res.accepted[0]] += 1
    assert set(accepted) == {0, 1, 2}, accepted  # rejections, partial and capped acceptances
    ar = [
        tuple(sample_ar(target, prompt, 3, Sampling(0.02, top_k=3, seed=s)).tokens)
        for s in range(N)
    ]
    wrong = _exact_joint(target, prompt, Sampling(0.3, top_k=3), 3)
    for pos in (1, 2):
        want = _marginal(joint, pos)
        bound = _bound(want, N)
        got = {k: _tv(want, [x[pos] for x in runs]) for k, runs in (("spec", spec), ("ar", ar))}
        assert got["spec"] < bound and got["ar"] < bound, (pos, got, bound)
        far = _marginal(wrong, pos)
        assert 0.5 * sum(abs(want[k] - far[k]) for k in set(want) | set(far)) > 2 * bound


def test_seeded():
    target = get_target("tiny_llama")
    drafter = make_drafter(target, block_size=4)
    prompt = _prompt(5)
    runs = [
        sample_chain(target, drafter, prompt, 20, Sampling(1.0, seed=s)).tokens for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] != runs[2]


def test_warp_is_applied_to_both_sides():
    """top_k=1 at any temperature is greedy: warp leaves one token on each side."""
    target = get_target("tiny_llama")
    prompt = _prompt(6)
    assert torch.equal(warp(torch.tensor([1.0, 3.0, 2.0]), 5.0, top_k=1), torch.tensor([0.0, 1, 0]))
    drafter = OracleDrafter(make_drafter(target, block_size=8), target.lm_head.weight, [], "none")
    got = sample_chain(target, drafter, prompt, 16, Sampling(3.0, top_k=1, seed=3))
    assert got.tokens == generate_ar(target, prompt, 16).tokens
    assert got.accepted == generate_chain(target, drafter, prompt, 16).accepted


def test_eval_reports_real_decoding_beside_offline():
    """eval.real_decode_prompts: real sampled decoding's tau next to the offline expected tau_t on
    the same prompts; at T=0 the two are the same number (the offline walk is exact there). The
    toy target (6 tokens, spread logits) has peaked distributions at T=1, so sampled drafts are
    accepted there too (on the tiny targets nearly uniform T=1 text accepts none)."""
    from test_sampling import _toy_target

    from dflash.config import EvalConfig
    from dflash.eval.decode import decode_report
    from dflash.eval.sets import consistent_greedy

    target = _toy_target()
    prompt = [1, 3, 0, 2, 4, 1]
    item = consistent_greedy(target, prompt, generate_ar(target, prompt, 24).tokens)
    truth = prompt + item.completion_ids.tolist()
    drafter = OracleDrafter(
        make_drafter(target, block_size=4), target.lm_head.weight, truth, "mixed"
    )
    rep = decode_report(target, drafter, [item], 1, EvalConfig(temperatures=[0.0, 1.0], seed=5))
    assert rep["decode_prompts"] == 1 and rep["decode_rounds_t0"] > 0
    assert rep["decode_tau_t0"] == pytest.approx(rep["decode_offline_tau_t0"], abs=1e-12)
    assert rep["decode_tau_t0"] > 1.5  # the mixed oracle accepts: the equality is not 1 == 1
    # T=1: the real figure is 1 + the accepted drafts per round of that seeded sampled decode,
    # the offline ones are the eval's upper estimate and lower bound on the same item
    from dflash.eval.offline import evaluate
    from dflash.target.shape import Heads

    res = sample_chain(target, drafter, prompt, len(item.completion_ids), Sampling(1.0, seed=5))
    assert len(res.accepted) == rep["decode_rounds_t1"] >= 3 and sum(res.accepted) > 0
    assert rep["decode_tau_t1"] == 1 + sum(res.accepted) / len(res.accepted)
    heads = Heads(target.embed_tokens, target.lm_head)
    _, offline = evaluate(drafter, heads, [item], [64], temperatures=[1.0])
    assert rep["decode_offline_tau_t1"] == offline["tau_t1"] > offline["tau_t1_lower"]
    assert rep["decode_offline_tau_t1_lower"] == offline["tau_t1_lower"] > 1.0
