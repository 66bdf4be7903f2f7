"""eval.near_tie_rounds: a completion cut where the target's one-shot forward parts from the
batched decode (a bf16 near-tie) goes on from the one-shot token and is kept whole."""

import time

import pytest
import torch

from dflash.data.dataset import generate_greedy
from dflash.eval.greedy import checked_items


def _parted(target, L=12, at=3):
    """A prompt, the target's greedy completion of it, and a completion that parts from it at
    token `at` (another token there, then the target's greedy text after that token), as a
    batched decode does at a near-tie."""
    prompt = torch.randint(
        0, target.vocab_size - 1, (6,), generator=torch.Generator().manual_seed(3)
    )
    prompt = prompt.tolist()
    (true,) = generate_greedy(target, [prompt], L, 1)
    wrong = (true[at] + 1) % (target.vocab_size - 1)
    head = true[:at] + [wrong]
    (rest,) = generate_greedy(target, [prompt + head], L - at - 1, 1)
    return prompt, true, head + rest


def test_a_parted_completion_is_cut_at_the_parting_or_continued_whole(tiny_llama):
    prompt, true, parted = _parted(tiny_llama)
    assert parted != true and len(parted) == len(true) == 12
    logs = []
    (cut,) = checked_items(tiny_llama, [(prompt, parted)], time.perf_counter(), logs.append)
    assert cut.completion_ids.tolist() == true[:3]  # the old behaviour, rounds = 0
    assert "1 of 1 completions cut" in logs[-1]

    logs.clear()
    (whole,) = checked_items(tiny_llama, [(prompt, parted)], time.perf_counter(), logs.append, 2)
    assert whole.completion_ids.tolist() == true  # the one-shot token, then the greedy rest
    assert (
        "over 1 round(s) (eval.near_tie_rounds=2): 1 of the 1 whole, 9 greedy tokens more"
        in logs[-1]
    )
    ref = checked_items(tiny_llama, [(prompt, true)], time.perf_counter(), lambda *_: None)[0]
    assert torch.equal(whole.aux_TF, ref.aux_TF) and torch.equal(whole.final_LH, ref.final_LH)


def test_near_tie_rounds_name_a_cache_of_their_own_and_zero_keeps_the_old_names(
    tmp_path, tiny_llama
):
    from dataclasses import replace

    from dflash.config import DataConfig, EvalConfig, RunConfig
    from dflash.eval.sets import build_eval_set

    rc = RunConfig(
        data=DataConfig(source="selfgen", num_samples=4, prompt_len=4),
        eval=EvalConfig(num_prompts=2, completion_len=6, batch_size=2, near_tie_rounds=0),
    )
    build_eval_set(rc, tiny_llama, str(tmp_path), log=lambda *_: None)
    build_eval_set(replace(rc, eval=replace(rc.eval, near_tie_rounds=3)), tiny_llama, str(tmp_path),
                   log=lambda *_: None)  # fmt: skip
    assert len([f for f in (tmp_path).iterdir() if not f.name.endswith(".tokens.safetensors")]) == 2
    from dflash.eval.sets import _eval_key

    assert "near_tie_rounds" not in _eval_key(rc.eval)  # the names of every set before the flag
    with pytest.raises(ValueError, match="near_tie_rounds must be >= 0"):
        EvalConfig(near_tie_rounds=-1).validate()


def test_whole_completions_are_the_default_and_older_runs_keep_their_cut_sets():
    """eval.near_tie_rounds defaults to 4 (whole completions); eval.py on a checkpoint whose run
    config predates the key restores 0, the cut set its in-loop eval scored, and a run config
    that records the key keeps its value."""
    import json
    from dataclasses import asdict

    from dflash.config import EvalConfig, RunConfig
    from dflash.eval.cli import _restore_group

    assert EvalConfig().near_tie_rounds == 4
    saved = json.loads(json.dumps(asdict(RunConfig().eval), default=str))
    before = {k: v for k, v in saved.items() if k != "near_tie_rounds"}
    rc, _ = _restore_group(RunConfig(), "eval", EvalConfig, before, set())
    assert rc.eval.near_tie_rounds == 0
    rc, _ = _restore_group(RunConfig(), "eval", EvalConfig, {**before, "near_tie_rounds": 2}, set())
    assert rc.eval.near_tie_rounds == 2
    rc, label = _restore_group(
        RunConfig(), "eval", EvalConfig, before, {"eval.near_tie_rounds"}
    )  # the command line names it: its value (the default here) wins
    assert rc.eval.near_tie_rounds == 4 and "but eval.near_tie_rounds" in label
