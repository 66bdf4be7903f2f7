import importlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DFLASH_NO_PROGRESS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import torch
from omegaconf import OmegaConf

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")


def target_cfg(name: str, **over):
    from dflash.config import TargetConfig

    raw = OmegaConf.to_container(
        OmegaConf.load(os.path.join(CONF, "target", f"{name}.yaml")), resolve=True
    )
    raw.update(over)
    return TargetConfig(**raw)


_TARGETS = {}
# Mechanism tests (speculative decoding, cache rollback, capture) use the tiny hybrid with its
# earlier weights: init_std 0.01 and an unscaled head. Its Gated-DeltaNet state weighs more in
# each token than in the shipped, learnable tiny_qwen3_5 (init_std 0.003, near-bigram text), so
# a wrong recurrent-state rollback changes the greedy text within 32 tokens.
MECHANISM_OVERRIDES = {"tiny_qwen3_5": {"init_std": 0.01, "lm_head_scale": 1.0}}


def get_target(name: str, num_aux: int = 3, layer_ids=None):
    from dflash.target.load import load_target

    key = (name, num_aux, tuple(layer_ids) if layer_ids else None)
    if key not in _TARGETS:
        cfg = target_cfg(name, **MECHANISM_OVERRIDES.get(name, {}))
        _TARGETS[key] = load_target(cfg, layer_ids=layer_ids, num_aux=num_aux)
    return _TARGETS[key]


def assert_same_adam_steps(got: dict, ref: dict, *what, lr: float = 1e-2) -> None:
    """Weights after a few AdamW steps from the same gradients summed in another order (data
    parallel, sharded): Adam steps ~lr * sign(g), so an entry whose gradient is ~0 may step a
    little differently by rounding, and how many do depends on the CPU's kernels (up to 0.27 % of
    a tensor, at most 6e-4 off, on an AVX2 machine; under 0.1 % on an AVX-512 one). A wrong
    gradient moves many entries by ~lr: at most 1 % of a tensor may be off by more than rounding,
    and none by more than a quarter of one step."""
    for k, v in ref.items():
        d = (got[k] - v).abs()
        bad = (d > 2e-5 + 1e-4 * v.abs()).float().mean().item()
        assert bad < 1e-2 and d.max().item() < lr / 4, (*what, k, bad, d.max().item())


def make_drafter(
    target,
    block_size=4,
    layer_types=("sliding_attention", "full_attention"),
    window=64,
    seed=0,
    std=0.05,
    **over,
):
    """A small drafter on `target`; `over`: other drafter.* keys (variant="dflash2", ...)."""
    from dflash.config import DrafterConfig
    from dflash.drafter.spec import resolve_spec
    from dflash.drafter.variants import build_model

    dcfg = DrafterConfig(
        num_layers=len(layer_types),
        layer_types=list(layer_types),
        sliding_window=window,
        target_layer_ids=list(target.layer_ids),
        block_size=block_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        **over,
    )
    spec = resolve_spec(dcfg, target.shape)
    d = build_model(spec)
    d.init_weights(std, torch.Generator().manual_seed(seed))
    return d


@pytest.fixture(scope="session")
def tiny_qwen():
    return get_target("tiny_qwen3_5")


@pytest.fixture(scope="session")
def tiny_llama():
    return get_target("tiny_llama")


@pytest.fixture(scope="session")
def default_job(tmp_path_factory):
    """`python train.py` as the README runs it (the default 200 steps on the tiny target, about a
    minute on 2 cores), once for every test that reads it: its run directory."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("default_job")
    r = subprocess.run(
        [sys.executable, "train.py", f"out_root={root}", "run_name=d", "logger=none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "d"


def pytest_runtest_setup(item):
    """`@pytest.mark.extra("deepspeed")`: the test needs an optional extra that the README's
    install line leaves out; without it the test is skipped, saying which (.ci/run installs the
    extras after running the README's commands, and runs these tests then)."""
    for mark in item.iter_markers("extra"):
        try:
            importlib.import_module(mark.args[0])
        except ImportError:
            pytest.skip(f"needs the {mark.args[0]} extra: pip install 'dflash[{mark.args[0]}]'")
