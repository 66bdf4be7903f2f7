"""Command-line overrides checked against the schema before Hydra composes them: an unknown group,
option or key is one line naming it and the closest valid names (Hydra's own message for
`trian.steps=5` suggests `+trian.steps=5`, and `+train.stpes=5` got as far as a TypeError)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing

from ..config import RunConfig

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf")


def groups(conf_dir: str = CONF_DIR) -> dict[str, list[str]]:
    """Config group -> its options (the yaml files of conf/<group>/)."""
    out = {}
    for g in sorted(os.listdir(conf_dir)):
        d = os.path.join(conf_dir, g)
        if os.path.isdir(d) and g not in ("hydra", "accelerate"):  # not Hydra groups
            out[g] = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))
    return out


def _fields(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _closest(word: str, choices, prefix: str = "") -> str:
    near = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.5)
    if not near:
        return ""
    return " (did you mean " + " or ".join(prefix + n for n in near) + "?)"


def check_override(override: str, conf_dir: str = CONF_DIR) -> None:
    """Raise ValueError for an override naming no group, option or key of the schema."""
    key, eq, value = override.lstrip("+~").partition("=")
    if not eq and not override.startswith("~"):
        return  # not an override (Hydra reports it)
    if key.startswith("hydra.") or key.startswith("hydra/") or key == "hydra":
        return
    all_groups = groups(conf_dir)
    if "/" in key or (key in all_groups and "." not in key):
        group = key.split("/")[0]
        if group not in all_groups:
            raise ValueError(
                f"unknown config group {group!r} in {override!r}{_closest(group, all_groups)}"
            )
        if eq and value not in all_groups[group] and not value.startswith("${"):
            raise ValueError(
                f"unknown option {value!r} of group {group!r} in {override!r}"
                f"{_closest(value, all_groups[group], override.split('=')[0] + '=')}; options: "
                + ", ".join(all_groups[group])
            )
        return
    parts = key.split(".")
    cls, path = RunConfig, []
    for part in parts:
        fields = _fields(cls)
        if part not in fields:
            where = ".".join(path)
            valid = fields if path else {**fields, **dict.fromkeys(all_groups)}
            prefix = where + "." if where else ""
            hint = _closest(part, valid, prefix)
            if not hint and where:
                hint = f"; {where} has: {', '.join(fields)}"
            raise ValueError(f"unknown config key {prefix + part!r} in {override!r}{hint}")
        path.append(part)
        cls = fields[part]
        if not dataclasses.is_dataclass(cls):
            if len(path) == len(parts) and eq:
                check_value(override, key, cls)
            return  # a leaf (or a free-form dict such as target.config / drafter.rope_scaling)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _kind(typ) -> str:
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ) or (str,)
        return f"a list of {_kind(item).removeprefix('an ').removeprefix('a ')}s ([a, b])"
    if typing.get_origin(typ) is dict or typ is dict:
        return "a mapping ({k: v})"
    return _KINDS.get(typ, getattr(typ, "__name__", str(typ)))


def check_value(override: str, key: str, typ) -> None:
    """A value of the wrong type is one line naming the key and the type it takes (Hydra would
    print six lines and exit 1): the value as Hydra parses it, checked by OmegaConf as the
    schema types it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        parsed = OverridesParser.create().parse_override(override)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's own message names it
        return
    if parsed.is_sweep_override():
        return
    try:
        value = parsed.value()
        # a list of mappings becomes the schema's dataclass items (eval.sets, data.mix) by a
        # merge, as Hydra's own composition does; anything else is assigned
        merge = isinstance(value, list) and any(isinstance(v, dict) for v in value)
        OmegaConf.update(OmegaConf.structured(RunConfig), key, value, merge=merge)
    except OmegaConfBaseException:
        union = typing.get_origin(typ) in (typing.Union, types.UnionType)
        args = typing.get_args(typ) if union else (typ,)
        kinds = [_kind(a) if a is not type(None) else "null" for a in args]
        raise ValueError(
            f"{override!r}: {key} takes {' or '.join(kinds)}, got {override.split('=', 1)[1]!r}"
        ) from None


def check_argv(argv: list[str], conf_dir: str = CONF_DIR) -> None:
    """train.py / eval.py: every `key=value` argument (flags such as --help pass through)."""
    for arg in argv:
        if arg.startswith("-"):
            continue
        check_override(arg, conf_dir)
