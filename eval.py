"""Evaluate a drafter checkpoint (ours or a published z-lab-format directory):
`python eval.py ckpt=PATH [target=...] [out=report.json]` -> streak / tau / DDTree per prompt."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig

from dflash.cli import setup, typed

setup()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    from dflash.eval_cli import run_eval

    try:
        rc = typed(cfg)
        overrides = list(HydraConfig.get().overrides.task)
        run_eval(rc, HydraConfig.get().runtime.output_dir, overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
