"""Every experiment composes and builds; typos and bad values fail with the key's name."""

import glob
import os
import subprocess
import sys

import pytest
import torch
from conftest import CONF, ROOT
from hydra import compose, initialize_config_dir

from dflash.config import DrafterConfig
from dflash.run.cli import setup, typed

setup()
EXPS = sorted(
    os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(CONF, "exp", "*.yaml"))
)
# Experiments that need local weights/data compose as-is; they build on a tiny target.
TINY = [
    "target=tiny_qwen3_5",
    "target.device=auto",  # a GPU recipe names cuda
    "target.dtype=auto",
    "data.code_dirs=[]",
    "data=selfgen",
    "data.num_samples=4",
    "data.response_len=8",
    "eval.enabled=false",
    "logger=none",
]


def _compose(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("exp", EXPS)
def test_every_experiment_composes_and_builds(exp, tmp_path):
    from dflash.train.build import build_drafter, build_target

    cfg = _compose([f"+exp={exp}"])
    assert cfg.exp_name == exp
    rc = typed(_compose([f"+exp={exp}", *TINY, f"out_root={tmp_path}"]))
    target = build_target(rc)
    drafter = build_drafter(rc, target.shape)
    assert drafter.spec.target_layer_ids == target.layer_ids
    assert target.num_layers - 1 not in drafter.spec.target_layer_ids


def test_run_config_names_an_inherited_target():
    """run_config (the device chain converts $EXP's GGUF with it, before the clock): an
    experiment that inherits its target from another (qwen05_chat from qwen05_coder) names it."""
    from dflash.run.cli import run_config

    for exp in ("qwen05_coder", "qwen05_chat"):
        rc = run_config([f"+exp={exp}"])
        assert rc.target.name == "qwen2_5_coder_0_5b" and rc.target.gguf_file.endswith(".gguf")
    assert run_config(["+exp=smollm2_coder"]).target.name == "smollm2_135m"


def test_v5_recipe_on_tiny_target(tmp_path):
    from dflash.train.colocated import run_colocated

    rc = typed(
        _compose(
            [
                "+exp=v5",
                *TINY,
                f"out_root={tmp_path}",
                "train.steps=2",
                "train.grad_accum=1",
                "train.max_anchors=4",
            ]
        )
    )
    assert rc.train.loss == "hard_ce" and rc.drafter.block_size == 16 and rc.train.lr == 6e-4
    assert rc.drafter.layer_types.count("sliding_attention") == 4
    out = run_colocated(rc, str(tmp_path / "run"))
    assert os.path.exists(os.path.join(out["checkpoint"], "model.safetensors"))


def test_v5_aux_layers_for_64_layer_target():
    from dflash.target.shape import default_layer_ids

    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(8, 5) == [1, 2, 3, 4, 5]  # every layer of 1..L-3
    with pytest.raises(ValueError, match=r"drafter.num_aux_layers=6: a 8-layer target has 5 "):
        default_layer_ids(8, 6)  # would repeat a layer


def test_v5_without_weights_names_the_key():
    rc = _compose(["+exp=v5"])
    with pytest.raises(ValueError, match="target.path"):
        typed(rc)


def test_v5_cli_without_weights_stops_at_once(tmp_path):
    r = subprocess.run(
        [sys.executable, "train.py", "+exp=v5", f"out_root={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "target.path" in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_unknown_key_fails_at_composition():
    with pytest.raises(Exception, match="stepz"):
        _compose(["train.stepz=3"])


def test_schema_is_no_user_choice():
    """The typed schema validates every group file but is not an option of any group."""
    for group in ("target", "drafter", "data", "train", "eval", "logger", "topology"):
        with pytest.raises(Exception, match=f"Could not find '{group}/{group}_schema'"):
            _compose([f"{group}={group}_schema"])
    r = subprocess.run(
        [sys.executable, "train.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    groups = r.stdout.split("== Configuration groups ==")[1].split("== Keys ==")[0]
    assert r.returncode == 0 and "target:" in groups and "schema" not in groups


def test_group_file_with_unknown_key_fails_at_composition(tmp_path):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "target" / "typo.yaml").write_text("name: typo\nconfig: {}\nhiden_size: 64\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(Exception, match="hiden_size"):
            compose("config", overrides=["target=typo"])


@pytest.mark.parametrize(
    "group,kwargs,match",
    [
        ("TopologyConfig", {"timeout_s": 0}, "topology.timeout_s must be > 0"),
        ("TrainConfig", {"lr": -1.0}, r"train.lr must be > 0 \(the peak learning rate"),
        ("TrainConfig", {"clip_grad": 0.0}, "train.clip_grad must be > 0"),
        ("TrainConfig", {"warmup_ratio": 1.5}, r"train.warmup_ratio must be in \[0, 1\]"),
        ("TrainConfig", {"min_lr_ratio": -0.1}, r"train.min_lr_ratio must be in \[0, 1\]"),
        ("TrainConfig", {"weight_decay": -0.01}, "train.weight_decay must be >= 0"),
        ("TrainConfig", {"betas": [0.9, 1.0]}, r"train.betas must be two values in \[0, 1\)"),
        ("TopologyConfig", {"backend": "mpi"}, "topology.backend"),
        ("DataConfig", {"pack_to": 8, "max_length": 16}, "data.pack_to"),
        ("DataConfig", {"num_samples": 0}, "data.num_samples must be >= 1"),
        ("DataConfig", {"response_len": 0}, "data.response_len must be >= 1"),
        ("DrafterConfig", {"block_size": 1}, "drafter.block_size"),
        ("EvalConfig", {"budgets": [0, 4]}, "eval.budgets"),
        ("EvalConfig", {"num_prompts": 0}, r"eval.num_prompts must be >= 1 \(eval.enabled=false"),
        ("EvalConfig", {"completion_len": 0}, "eval.completion_len must be >= 1"),
        (
            "TrainConfig",
            {"fused_head": "on"},
            r"train.fused_head='on' .*'auto', 'fused', 'tiles', 'plain'",
        ),
    ],
)
def test_each_group_validates_itself(group, kwargs, match):
    import dflash.config as C

    getattr(C, group)().validate()  # the defaults are valid
    with pytest.raises(ValueError, match=match):
        getattr(C, group)(**kwargs).validate()


@pytest.mark.parametrize(
    "override,match",
    [
        ("train.loss=soft_kl", "allow_soft_loss"),
        ("target.linear_attn_backend=cuda", "linear_attn_backend"),
        ("target.compile_gdn=whole", "target.compile_gdn"),
        ("drafter.layer_types=[full_attention]", "layer_types"),
        ("train.dtype=float8", "train.dtype"),
        ("train.gamma=0", "train.gamma"),
        ("train.log_every=0", "train.log_every"),
        ("drafter.num_attention_heads=5", "num_key_value_heads"),
    ],
)
def test_bad_values_name_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        typed(_compose([override]))


def test_soft_loss_when_explicit():
    rc = typed(_compose(["train.loss=soft_kl", "train.allow_soft_loss=true"]))
    assert rc.train.loss == "soft_kl"


@pytest.mark.parametrize(
    "ids,match",
    [
        ([1, 3, 7], "final layer"),
        ([1, 9], "out of range"),
        ([-1, 2], "out of range"),
        ([2, 2], "duplicates"),
    ],
)
def test_aux_layer_guardrails(ids, match):
    from dflash.target.shape import check_layer_ids

    with pytest.raises(ValueError, match=match):
        check_layer_ids(ids, 8)


def test_final_layer_refused_when_building(tmp_path):
    from dflash.train.build import build_target

    rc = typed(_compose(TINY + ["drafter.target_layer_ids=[1,4,7]", f"out_root={tmp_path}"]))
    with pytest.raises(ValueError, match="final layer"):
        build_target(rc)


def test_mask_token_and_hidden_guardrails():
    from dflash.drafter.spec import resolve_spec
    from dflash.target.shape import TargetShape

    def shape(mask_token_id):
        return TargetShape(8, 128, 512, 256, 4, 2, torch.float32, mask_token_id, (1,))

    with pytest.raises(ValueError, match="mask token"):
        resolve_spec(DrafterConfig(target_layer_ids=[1]), shape(mask_token_id=512))
    with pytest.raises(ValueError, match="hidden size"):
        resolve_spec(DrafterConfig(target_layer_ids=[1], hidden_size=64), shape(511))
    from dflash.target.capture import resolve_mask_token_id

    class Tok:
        mask_token_id = None

    with pytest.raises(ValueError, match="no mask token"):
        resolve_mask_token_id(Tok(), 100, None)


def test_fp16_refused(tiny_qwen):
    from conftest import make_drafter

    from dflash.config import TrainConfig
    from dflash.target.shape import Heads
    from dflash.train.step import DrafterTrainer

    with pytest.raises(ValueError, match="float16 overflows"):
        DrafterTrainer(
            make_drafter(tiny_qwen),
            Heads(tiny_qwen.embed_tokens, tiny_qwen.lm_head),
            TrainConfig(dtype="float16"),
            torch.device("cpu"),
        )
