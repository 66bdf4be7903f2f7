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
