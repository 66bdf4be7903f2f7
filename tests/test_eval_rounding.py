"""The in-loop eval sees the exported (bf16-rounded) weights and leaves the training weights
bit-identical afterwards."""

import torch
from conftest import make_drafter

from dflash.eval.offline import rounded_to


def test_rounded_to_evaluates_export_weights_and_restores_master(tiny_qwen):
    d = make_drafter(tiny_qwen)
    with torch.no_grad():
        d.fc.weight.add_(1e-4)  # not representable in bf16
    master = {k: v.clone() for k, v in d.state_dict().items()}
    with rounded_to(d, torch.bfloat16):
        for k, v in d.state_dict().items():
            assert v.dtype == torch.float32
            assert torch.equal(v, master[k].to(torch.bfloat16).float()), k
        assert not torch.equal(d.fc.weight, master["fc.weight"])
    for k, v in d.state_dict().items():
        assert torch.equal(v, master[k]), k


def test_eval_py_shows_a_progress_bar_over_the_prompts_and_the_loop_does_not(
    tiny_qwen, monkeypatch, capsys
):
    """eval.py names its set on a bar over the prompts (a CPU eval runs for minutes between
    lines); the in-loop eval (no desc) and DFLASH_NO_PROGRESS=1 stay quiet."""
    from dflash.decoding import generate_ar
    from dflash.eval.offline import evaluate
    from dflash.eval.sets import consistent_greedy
    from dflash.target.shape import Heads

    d = make_drafter(tiny_qwen)
    heads = Heads(tiny_qwen.embed_tokens, tiny_qwen.lm_head)
    prompts = [[5, 17, 42, 9, 33, 61], [7, 8, 100, 3, 12, 77]]
    items = [consistent_greedy(tiny_qwen, p, generate_ar(tiny_qwen, p, 16).tokens) for p in prompts]
    monkeypatch.delenv("DFLASH_NO_PROGRESS", raising=False)
    evaluate(d, heads, items, [4], desc="humaneval")
    assert "humaneval" in capsys.readouterr().err
    evaluate(d, heads, items, [4])
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    evaluate(d, heads, items, [4], desc="humaneval")
    assert "humaneval" not in capsys.readouterr().err
