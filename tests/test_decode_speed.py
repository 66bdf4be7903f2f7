"""eval.real_decode_prompts, greedy part (dflash.eval.speed): real AR / chain / DDTree decoding
of the cached eval prompts, timed, checked token for token against AR, real tau beside the
offline tau."""

import pytest
import torch
from conftest import get_target, make_drafter

import dflash.eval.speed as decode_speed
from dflash.config import EvalConfig
from dflash.decoding import generate_ar
from dflash.eval.decode import decode_report
from dflash.eval.sets import consistent_greedy
from dflash.tools.testing import OracleDrafter

torch.set_num_threads(1)

B = 8
L = 32


@pytest.fixture(scope="module")
def setup():
    """Three prompts that are prefixes of one greedy text S (base prompt + its greedy
    continuation), so one oracle drafter with truth S is oracle-like on all three: each prompt's
    greedy completion is the rest of S."""
    target = get_target("tiny_llama")
    base = torch.randint(0, 511, (10,), generator=torch.Generator().manual_seed(11)).tolist()
    S = base + generate_ar(target, base, 12 + L).tokens
    items = [consistent_greedy(target, S[:p], S[p : p + L]) for p in (10, 16, 22)]
    assert all(it.completion_ids.numel() == L for it in items)  # no near-tie cut
    drafter = OracleDrafter(
        make_drafter(target, block_size=B), target.lm_head.weight, S, "mixed", seed=3
    )
    return target, drafter, items


def _report(setup, log=None, **ecfg):
    target, drafter, items = setup
    cfg = EvalConfig(temperatures=[0.0], decode_tree_budgets=[4, 16], **ecfg)
    return decode_report(target, drafter, items, 3, cfg, log=log or (lambda s: None))


def test_identical_to_ar_and_real_tau_equals_offline(setup):
    rep = _report(setup)
    assert rep["decode_prompts"] == 3 and rep["decode_new_tokens"] == 3 * L
    assert rep["decode_ar_matches_cache"] == 3
    for m in ("chain", "tree@4", "tree@16"):
        assert rep[f"decode_identical_{m}"] == 3, m
        # float32: the offline walk is exact for greedy decoding
        assert rep[f"decode_tau_{m}"] == pytest.approx(rep[f"decode_offline_tau_{m}"], abs=1e-12)
        assert rep[f"decode_rounds_{m}"] > 0
        assert 0 < rep[f"decode_tokens_per_s_{m}"] < float("inf")
        assert rep[f"decode_speedup_{m}"] == pytest.approx(
            rep[f"decode_tokens_per_s_{m}"] / rep["decode_tokens_per_s_ar"]
        )
    assert 0 < rep["decode_tokens_per_s_ar"] < float("inf")
    assert rep["decode_tau_chain"] > 1.5  # the oracle accepts: the equality is not 1 == 1
    assert rep["decode_tau_tree@16"] >= rep["decode_tau_chain"]
    # T=0 sampled decoding is the greedy chain
    assert rep["decode_tau_t0"] == rep["decode_tau_chain"] == rep["decode_offline_tau_t0"]
    assert all(isinstance(v, (int, float)) for v in rep.values())  # flat numbers for loggers


def test_a_perturbed_decode_is_counted_and_logged(setup, monkeypatch):
    """The identity check can fail: a chain decode that flips one token of prompt 1 drops
    decode_identical_chain to 2 and is logged with its position; the trees stay 3/3."""
    real = decode_speed.generate_chain
    calls = []

    def flipped(target, drafter, prompt, n):
        res = real(target, drafter, prompt, n)
        calls.append(n)
        if len(calls) == 3:  # warm-up, prompt 0, prompt 1
            res.tokens[5] = (res.tokens[5] + 1) % 511
        return res

    monkeypatch.setattr(decode_speed, "generate_chain", flipped)
    lines = []
    rep = _report(setup, log=lines.append)
    assert rep["decode_identical_chain"] == 2 and rep["decode_identical_tree@16"] == 3
    assert lines == [lines[0]] and "prompt 1: chain differs from AR at token 5 of 32" in lines[0]


def test_first_diff():
    assert decode_speed.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert decode_speed.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert decode_speed.first_diff([1, 2], [1, 2, 3]) == 2


def test_table_and_summary_split():
    """The greedy figures print as one table (method rows); the summary table keeps the rest."""
    from rich.console import Console

    from dflash.eval.report import print_report

    s = {
        "tau": 2.0,
        "decode_prompts": 2,
        "decode_new_tokens": 64,
        "decode_tokens_per_s_ar": 100.0,
        "decode_tokens_per_s_chain": 250.0,
        "decode_tokens_per_s_tree@64": 300.0,
        "decode_ar_matches_cache": 2,
        "decode_speedup_chain": 2.5,
        "decode_tau_chain": 3.0,
        "decode_offline_tau_chain": 3.0,
        "decode_rounds_chain": 20,
        "decode_identical_chain": 1,
        "decode_speedup_tree@64": 3.0,
        "decode_tau_tree@64": 4.0,
        "decode_offline_tau_tree@64": 4.25,
        "decode_rounds_tree@64": 16,
        "decode_identical_tree@64": 2,
        "decode_tau_t0.7": 2.5,
    }
    con = Console(width=200, record=True)
    print_report([], s, [], console=con)
    text = con.export_text()
    assert "decode_tau_t0.7" in text and "decode_speedup_chain" not in text
    rows = {ln.split("│")[1].strip(): ln for ln in text.splitlines() if ln.count("│") > 3}
    assert "2.50x" in rows["chain"] and "1/2" in rows["chain"] and "4.250" in rows["tree@64"]
    assert "AR == cached greedy completion on 2/2" in text


def test_budgets_are_validated():
    with pytest.raises(ValueError, match="decode_tree_budgets"):
        EvalConfig(decode_tree_budgets=[64, 0]).validate()
