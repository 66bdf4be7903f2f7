"""docs/configuration.md from the config schemas: `python -m dflash.tools.config_docs > docs/configuration.md`.

Descriptions come from the schemas' comments (dflash.config.docs), defaults from the composed
default job and the group options (dflash.run.defaults); `tests/test_config_docs.py` fails when
this file is stale.
"""

from __future__ import annotations

import os
import sys

from ..config.docs import rows
from ..run.defaults import option_values, show


def render() -> str:
    base, others = option_values()
    out = [
        "# Configuration reference",
        "",
        "Generated from the schemas in `dflash/config/` and the option files in `conf/` by "
        "`python -m dflash.tools.config_docs > docs/configuration.md`; do not edit by hand.",
        "Defaults are what the default job (`python train.py`) runs: `conf/config.yaml` with its",
        "default option of each group. The last column is what another option of the group sets",
        "(`group=option`); an experiment (`+exp=NAME`) may set more. Set any key on the command",
        "line: `python train.py key=value`.",
        "",
    ]
    current = None
    for key, typ, _schema_default, doc in rows():
        group = key.split(".")[0] if "." in key else "(top level)"
        if group != current:
            current = group
            title = group if group == "(top level)" else f"`{group}` (`conf/{group}/`)"
            out += [
                "",
                f"## {title}",
                "",
                "| key | type | default | description | other options |",
                "|---|---|---|---|---|",
            ]
        opts = "; ".join(f"`{o}`: `{show(v)}`" for o, v in others.get(key, []))
        cells = [
            f"`{key}`",
            f"`{typ}`",
            f"`{show(base[key]) if key in base else _schema_default}`",
            doc,
            opts,
        ]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
    os.sys.stdout.flush()
