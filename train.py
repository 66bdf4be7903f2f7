"""Train a DFlash drafter: `python train.py [+exp=NAME] [key=value ...]` (see README)."""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig

from dflash.cli import setup, typed

setup()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        rc = typed(cfg)
        if rc.topology.mode == "split" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from dflash.pipeline import run_distributed

            run_distributed(rc, run_dir)
        else:
            from dflash.runner import run_training

            run_training(rc, run_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
