"""The embedded default job (`python train.py`) visibly learns, and the tiny target's knobs that
make it learnable keep the target's greedy text a pure function of its body."""

import json

import pytest
import torch
from conftest import target_cfg

from dflash.data.dataset import generate_greedy
from dflash.data.prompts import random_prompts
from dflash.target.load import load_target


def test_lm_head_scale_changes_logit_spread_not_greedy_text():
    a = load_target(target_cfg("tiny_qwen3_5", lm_head_scale=1.0), num_aux=3)
    b = load_target(target_cfg("tiny_qwen3_5"), num_aux=3)  # the yaml's scale
    scale = target_cfg("tiny_qwen3_5").lm_head_scale
    assert scale > 1
    assert torch.allclose(a.lm_head.weight * scale, b.lm_head.weight)
    prompts = random_prompts(4, 8, a.vocab_size, [a.mask_token_id], seed=3)
    assert generate_greedy(a, prompts, 16, 4) == generate_greedy(b, prompts, 16, 4)
    with pytest.raises(ValueError, match="target.lm_head_scale needs .*tie_word_embeddings=false"):
        cfg = target_cfg("tiny_llama", lm_head_scale=2.0)
        load_target(
            target_cfg(
                "tiny_llama", config={**cfg.config, "tie_word_embeddings": True}, lm_head_scale=2.0
            )
        )


@pytest.mark.slow
def test_default_job_reaches_tau_2(default_job):
    """`python train.py` as the README runs it (about a minute on 2 cores)."""
    evals = [x for x in map(json.loads, open(default_job / "metrics.jsonl")) if "eval/tau" in x]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 200  # conf/train/smoke.yaml
    assert evals[0]["eval/tau"] < 1.2 and evals[-1]["eval/tau"] >= 2.0, evals[-1]
