"""drafter.init_norm_from_target: the drafter's final norm starts at the target's gain, read
through the target's own norm module (plain `w` or Qwen3.5's zero-centred `1 + w`)."""

import copy

import pytest
import torch
from conftest import get_target


@pytest.mark.parametrize("name,zero_centred", [("tiny_llama", False), ("tiny_qwen3_5", True)])
def test_final_norm_gain_reads_either_parametrisation(name, zero_centred):
    t = copy.deepcopy(get_target(name))
    w = t.model.get_decoder().norm.weight
    with torch.no_grad():
        w.copy_(torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) + 0.5)
    want = (1 + w if zero_centred else w).detach().float()
    assert torch.allclose(t.final_norm_gain(), want, atol=1e-4)


def test_session_starts_the_drafter_norm_at_the_target_gain(tmp_path):
    from test_resume import typed

    from dflash.train.build import build_target
    from dflash.train.session import open_session

    cfg = typed(tmp_path, "drafter.init_norm_from_target=true", "target=tiny_llama")
    target = build_target(cfg)
    with torch.no_grad():
        target.model.get_decoder().norm.weight.mul_(3.0)
    session = open_session(cfg, str(tmp_path / "r"), target.shape, writer=True, describe=[])
    trainer, _ = session.start(target, torch.device("cpu"))
    assert torch.allclose(trainer.drafter.norm.weight, target.final_norm_gain())
    assert not torch.allclose(
        trainer.drafter.norm.weight, torch.ones_like(trainer.drafter.norm.weight)
    )
    # off (the default): ones
    cfg = typed(tmp_path, "target=tiny_llama")
    session = open_session(cfg, str(tmp_path / "s"), target.shape, writer=True, describe=[])
    trainer, _ = session.start(target, torch.device("cpu"))
    assert torch.equal(trainer.drafter.norm.weight, torch.ones_like(trainer.drafter.norm.weight))
