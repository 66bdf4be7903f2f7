"""docs/configuration.md from the config schemas: `python -m dflash.tools.config_docs > docs/configuration.md`.

Descriptions come from the schemas' comments (dflash.config.docs); `tests/test_config_docs.py`
fails when this file is stale.
"""

from __future__ import annotations

import os
import sys

from ..config.docs import rows


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the schemas in `dflash/config/` by "
        "`python -m dflash.tools.config_docs > docs/configuration.md`; do not edit by hand.",
        "Defaults are the schema's; a group file (`conf/<group>/<option>.yaml`) or an experiment",
        "(`+exp=NAME`) may set others. Set any key on the command line: `python train.py key=value`.",
        "",
    ]
    current = None
    for key, typ, default, doc in rows():
        group = key.split(".")[0] if "." in key else "(top level)"
        if group != current:
            current = group
            title = group if group == "(top level)" else f"`{group}` (`conf/{group}/`)"
            out += [
                "",
                f"## {title}",
                "",
                "| key | type | default | description |",
                "|---|---|---|---|",
            ]
        out.append(f"| `{key}` | `{typ}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
    os.sys.stdout.flush()
