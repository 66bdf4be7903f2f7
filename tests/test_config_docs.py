"""docs/configuration.md is generated from the schemas; every field has a description."""

import os

from conftest import ROOT

from dflash.config.docs import rows
from dflash.tools.config_docs import render


def test_every_field_has_a_description():
    missing = [key for key, _t, _d, doc in rows() if not doc.strip()]
    assert not missing, (
        f"config fields without a description (comment in dflash/config.py): {missing}"
    )


def test_configuration_md_is_current():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        on_disk = f.read()
    assert on_disk == render(), (
        "docs/configuration.md is stale: python -m dflash.tools.config_docs > docs/configuration.md"
    )


def test_help_lists_groups_options_and_keys_with_descriptions():
    from dflash.run.help import render_help

    text = render_help()
    assert "schema" not in text
    assert "  tiny_qwen3_5           Tiny random Qwen3.5/3.6-style hybrid target" in text
    assert "train.save_on_interrupt" in text and "target.check_memory" in text


def test_help_and_docs_show_what_the_default_job_runs():
    """Not the schemas' defaults (steps 300, block 16, 1 layer, run_name `smoke`): the default
    job's composed values, and what another option of a group sets."""
    from dflash.run.help import render_help

    text = render_help()
    for key, shown in [
        ("train.steps", "[default: 200; train=v5: 60000]"),
        ("drafter.block_size", "[default: 8; drafter=qwen3_6_27b: 16]"),
        ("drafter.num_layers", "[default: 2; drafter=qwen3_6_27b: 5]"),
        ("run_name", "[default: smoke-<run id: a timestamp>]"),
        (
            "data.response_len",
            "[default: 64; data=jsonl: 2048; data=sharegpt: 256; data=stdlib: 128]",
        ),
    ]:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"  {key} ")]
        assert line.endswith(shown), line
    doc = render()
    assert "| `train.steps` | `int` | `200` |" in doc and "`train=v5`: `60000` |" in doc
    assert "| `drafter.block_size` | `int` | `8` |" in doc


def test_a_composition_renders_the_help_only_when_the_command_line_asks(monkeypatch):
    """OmegaConf resolves the help template at every composition that merges the hydra node
    (every train.py / eval.py start): rendering it composes every group option (~1.5 s a start),
    so it renders only under --help."""
    import sys

    from conftest import CONF
    from hydra import compose, initialize_config_dir

    import dflash.run.help as h
    from dflash.run.cli import setup

    setup()
    calls = []
    monkeypatch.setattr(h, "_render", lambda: calls.append(1) or "the help")
    for argv, rendered in ((["train.py", "data=stdlib"], False), (["train.py", "--help"], True)):
        monkeypatch.setattr(sys, "argv", argv)
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("config", return_hydra_config=True)
        assert bool(calls) == rendered, argv
        assert (cfg.hydra.help.template == "the help") == rendered
