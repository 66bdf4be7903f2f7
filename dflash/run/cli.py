"""Hydra glue for the entry points: resolvers, composition errors, typed config."""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

from ..config import register_configs


def run_id() -> str:
    """Same value on every rank: torchrun's rendezvous id, DFLASH_RUN_ID, or (single process)
    a timestamp. A multi-process job without a shared id must name its run."""
    for var in ("DFLASH_RUN_ID", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var)
        if v and v != "none":
            return v
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "several processes but no shared run id: pass run_name=NAME (or torchrun "
            "--rdzv-id ID, or set DFLASH_RUN_ID) so every rank writes to the same run dir"
        )
    return time.strftime("%Y%m%d-%H%M%S")


def names_run(cfg) -> bool:
    """Whether run_name names a run (given by the user) rather than being the default
    `<exp_name>-<run id>`, which is new for every run and so never names an earlier one."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False).get("run_name")
    return "dflash_run_id" not in str(raw)


def setup() -> None:
    """Before Hydra runs: the schema and resolvers, then the command line's keys checked against
    the schema (an unknown one is `error: ...` naming it and the closest keys, exit 2)."""
    import sys

    from .overrides import check_argv

    register_configs()
    if not OmegaConf.has_resolver("dflash_run_id"):
        OmegaConf.register_new_resolver("dflash_run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("dflash_help"):
        from .help import hydra_help

        OmegaConf.register_new_resolver("dflash_help", hydra_help)
    if os.path.basename(sys.argv[0]) == "train.py":
        from ..config import RunConfig
        from .plan import with_run_overrides

        sys.argv[1:], restored = with_run_overrides(sys.argv[1:], RunConfig().out_root)
        if restored:
            print("resume: with the run's own overrides: " + " ".join(restored), flush=True)
    if os.path.basename(sys.argv[0]) in ("train.py", "eval.py"):
        try:
            check_argv(sys.argv[1:])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)


def typed(cfg):
    """DictConfig -> validated RunConfig; a missing mandatory value becomes a ValueError naming
    the key and how to set it (the entry points print it as one `error: ...` line, exit 2)."""
    from omegaconf.errors import MissingMandatoryValue

    from ..config import to_run_config

    try:
        return to_run_config(cfg)
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", None) or str(e)
        hint = {
            "target.path": "set target.path=/path/to/the/target/weights (a local Hugging Face "
            "directory; nothing is downloaded at run time), or pick a tiny target: "
            "target=tiny_qwen3_5",
            "data.paths": "set data.paths=[/path/prompts.jsonl] (rows with a 'prompt' or 'messages' "
            "field), or data=selfgen for the target's own text on random prompts",
        }.get(key, f"set {key}=... on the command line")
        raise ValueError(f"missing config value {key}: {hint}") from None


def run_config(overrides: list[str] | None = None):
    """The validated RunConfig these overrides compose, as train.py would get it (outside a
    Hydra app: e.g. which target an experiment names, to convert its GGUF before a timed run)."""
    from .defaults import _compose

    setup()
    return typed(_compose(list(overrides or [])))
