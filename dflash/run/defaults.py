"""The values a run actually gets when the command line sets nothing: conf/config.yaml composed
with its default group options (not the schemas' own defaults, which the group files override),
and what each other option of a group changes. `--help` and docs/configuration.md show them."""

from __future__ import annotations

import os

from .overrides import CONF_DIR, groups

RUN_ID = "<run id: a timestamp>"  # run_name's default: <exp_name>-<run id> (dflash.run.cli.run_id)


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ..config import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():  # inside train.py (--help)
        return compose("config", overrides=overrides)
    with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def composed(overrides: list[str] | None = None) -> dict[str, object]:
    """dotted key -> value of the job these overrides compose (none: the default job); a
    group's keys one level deep, like the schema's (target.config stays one dict)."""
    from omegaconf import OmegaConf

    cfg = _compose(list(overrides or []))
    raw = _flat(OmegaConf.to_container(cfg, resolve=False))
    cfg.run_name = str(raw["run_name"]).replace("${dflash_run_id:}", RUN_ID)
    out = _flat(OmegaConf.to_container(cfg, resolve=True))
    for key, value in raw.items():  # `${oc.env:DFLASH_ASSETS,...}/qwen05`: as written, not this
        if key != "run_name" and isinstance(value, str) and "${" in value:  # machine's value
            out[key] = value
    return out


def _flat(d: dict) -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def default_options() -> dict[str, str]:
    """group -> its option in the default job (conf/config.yaml's defaults list)."""
    from omegaconf import OmegaConf

    entries = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF_DIR, "config.yaml")).defaults)
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if k in groups()}


def option_values() -> tuple[dict[str, object], dict[str, list[tuple[str, object]]]]:
    """(the default job's values, key -> [(group=option, value)] for every other option of a
    group that gives the key another value)."""
    base = composed()
    others: dict[str, list[tuple[str, object]]] = {}
    for group, default in default_options().items():
        for option in groups()[group]:
            if option == default:
                continue
            for key, value in composed([f"{group}={option}"]).items():
                if key.startswith(group + ".") and value != base.get(key):
                    others.setdefault(key, []).append((f"{group}={option}", value))
    return base, others


def show(value) -> str:
    """A value as a command line would write it (dicts abbreviated)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{...}" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)
