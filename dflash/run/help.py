"""`python train.py --help` (Hydra's app help, conf/hydra/help/dflash.yaml): the config groups
and their options, each with the first sentence of its file's header comment, then the keys of
each group with their descriptions from the schemas (dflash.config.docs) and the values the default
job and each other option give them (dflash.run.defaults)."""

from __future__ import annotations

import os
import re
import sys

from .defaults import option_values, show
from .overrides import CONF_DIR, groups


def _header(path: str) -> str:
    """First sentence of a yaml file's leading comment ('' when it has none)."""
    lines = []
    with open(path) as f:
        for line in f:
            s = line.strip()
            if not s.startswith("#"):
                break
            if s.startswith("# @package"):
                continue
            lines.append(s.lstrip("#").strip())
    text = " ".join(lines)
    return re.split(r"(?<![0-9])\. ", text)[0].rstrip(".")


_rendering = []  # composing the defaults inside --help resolves the help template again


def hydra_help() -> str:
    """The help template's resolver: Hydra passes the text through string.Template. OmegaConf
    resolves it whenever a composition merges the hydra node (every train.py / eval.py start and
    every compose after setup), and rendering composes every group option (~1.5 s): so only
    when the command line asks for the help."""
    if not any(a in ("--help", "-h") for a in sys.argv[1:]):
        return "python train.py --help"
    return render_help().replace("$", "$$")


def render_help() -> str:
    if _rendering:
        return ""
    _rendering.append(True)
    try:
        return _render()
    finally:
        _rendering.pop()


def _render() -> str:
    from ..config.docs import rows

    out = [
        "Train a DFlash drafter:  python train.py [+exp=NAME] [group=option ...] [key=value ...]",
        "(eval.py takes the same keys plus ckpt=PATH). Full reference: docs/configuration.md.",
        "",
        "== Configuration groups ==  (group=option; experiments: +exp=NAME)",
    ]
    for group, options in groups(CONF_DIR).items():
        out.append(f"{group}:")
        for opt in options:
            desc = _header(os.path.join(CONF_DIR, group, f"{opt}.yaml"))
            out.append(f"  {opt:<22} {desc}")
    out += ["", "== Keys ==  (key=value; default: what `python train.py` runs)"]
    base, others = option_values()
    for key, _typ, schema_default, doc in rows():
        opts = "".join(f"; {o}: {show(v)}" for o, v in others.get(key, []))
        default = show(base[key]) if key in base else schema_default  # a list item's field
        out.append(f"  {key:<28} {doc}  [default: {default}{opts}]")
    out += [
        "",
        "Examples:",
        "  python train.py                                   # the CPU smoke run (~2 min)",
        "  python train.py +exp=v5 target.path=/models/qwen  # the paper recipe on real weights",
        "  python train.py run_name=NAME resume=outputs/NAME # continue a run in its directory",
        "  python train.py --cfg job                         # print the composed config",
    ]
    return "\n".join(out)
