"""drafter.init_layers_from_target: drafter layer i starts as a copy of a target layer
(attention projections, MLP, norms read through the target's own modules), refused with the
reason when the layer does not fit."""

import copy

import pytest
import torch
from conftest import get_target

from dflash.drafter.warmstart import copy_target_layers
from dflash.target.capture import norm_gain


def _session(tmp_path, *over):
    from test_resume import typed

    from dflash.train.build import build_target
    from dflash.train.session import open_session

    cfg = typed(tmp_path, "target=tiny_llama", *over)
    target = build_target(cfg)
    session = open_session(cfg, str(tmp_path / "r"), target.shape, writer=True, describe=[])
    return session, target


def test_layers_copy_the_named_target_layers(tmp_path):
    session, target = _session(tmp_path, "drafter.init_layers_from_target=[-1,3]")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms away from ones, so a copy is visible
        for layer in target.decoder_layers():
            layer.input_layernorm.weight.copy_(torch.rand(128, generator=g) + 0.5)
    trainer, _ = session.start(target, torch.device("cpu"))
    layers = target.decoder_layers()
    for mine, lid in zip(trainer.drafter.layers, [7, 3]):
        theirs = layers[lid]
        for name in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
            assert torch.equal(mine.get_submodule(name).weight, theirs.get_submodule(name).weight)
        assert torch.allclose(mine.input_layernorm.weight, theirs.input_layernorm.weight)
        assert torch.equal(mine.self_attn.q_norm.weight, torch.ones(32))  # Llama: no q norm
    assert not torch.equal(
        trainer.drafter.layers[0].mlp.up_proj.weight, trainer.drafter.layers[1].mlp.up_proj.weight
    )
    # off (the default): the drafter's own init
    session, _ = _session(tmp_path / "off")
    fresh, _ = session.start(target, torch.device("cpu"))
    assert not torch.equal(fresh.drafter.layers[0].mlp.up_proj.weight, layers[0].mlp.up_proj.weight)


def test_zero_centred_q_norm_gain_is_read_through_the_module():
    t = copy.deepcopy(get_target("tiny_qwen3_5"))
    norm = t.decoder_layers()[3].self_attn.q_norm  # Qwen3.5: output = x * (1 + w)
    with torch.no_grad():
        norm.weight.fill_(0.25)
    assert torch.allclose(norm_gain(norm, 32), torch.full((32,), 1.25), atol=1e-3)


@pytest.mark.parametrize(
    "ids,match",
    [
        ([0], "one id per drafter layer"),
        ([0, 8], r"each in \[-8, 7\]"),
    ],
)
def test_bad_layer_lists_are_refused(tmp_path, ids, match):
    session, target = _session(tmp_path)
    with pytest.raises(ValueError, match=match):
        copy_target_layers(session.drafter, target, ids)


def test_layers_that_do_not_fit_are_refused(tmp_path):
    session, _ = _session(tmp_path)
    hybrid = get_target("tiny_qwen3_5")
    with pytest.raises(ValueError, match=r"target layer 0 has no self_attn.q_proj"):
        copy_target_layers(session.drafter, hybrid, [0, 3])  # layer 0: Gated-DeltaNet
    with pytest.raises(ValueError, match=r"self_attn.q_proj is \(128, 128\) in the drafter"):
        copy_target_layers(session.drafter, hybrid, [3, 7])  # gated attention: q and gate
