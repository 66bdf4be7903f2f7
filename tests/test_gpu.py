"""GPU tier (`pytest -m gpu`, run on a CUDA machine): the fla kernels, bf16 autocast and real
speculative decoding on the device. Skipped without CUDA."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_drafter, target_cfg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def qwen_cuda_fp32():
    from dflash.target import load_target

    return load_target(target_cfg("tiny_qwen3_5", device="cuda", dtype="float32"), num_aux=3)


def test_backend_is_fla_on_cuda(qwen_cuda_fp32):
    assert qwen_cuda_fp32.backend == "fla"


def test_specdec_identical_to_greedy_on_fla(qwen_cuda_fp32):
    from dflash.decoding import generate_ar, generate_chain, generate_tree
    from dflash.testing import OracleDrafter

    t = qwen_cuda_fp32
    base = make_drafter(t, block_size=8).to("cuda")
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        prompt = torch.randint(0, 511, (16,), generator=g).tolist()
        ar = generate_ar(t, prompt, 48)
        d = OracleDrafter(base, t.lm_head.weight, prompt + ar.tokens, pattern="mixed", seed=i).to(
            "cuda"
        )
        ch = generate_chain(t, d, prompt, 48)
        tr = generate_tree(t, d, prompt, 48, budget=16)
        assert ch.tokens == ar.tokens and tr.tokens == ar.tokens
        assert ch.tau > 1.5 and tr.tau > 1.5  # a 16-node tree can be shallower than the chain


def test_training_on_cuda_bf16(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "logger=none",
            f"out_root={tmp_path}",
            "run_name=g",
            "train.steps=20",
            "train.eval_every=20",
            "train.save_every=20",
            "data.num_samples=32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cuda" in r.stdout and "linear-attn backend: fla" in r.stdout
    assert os.path.exists(tmp_path / "g" / "checkpoints" / "step_00000020" / "model.safetensors")


def test_parity_fla_vs_torch_tiny():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.tools.parity",
            "--target",
            "tiny_qwen3_5",
            "--a",
            "torch:float32:cuda",
            "--b",
            "fla:float32:cuda",
            "--tokens",
            "512",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
