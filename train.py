"""Train a DFlash drafter: `python train.py [+exp=NAME] [key=value ...]` (see README and
docs/architecture.md)."""

import hydra
from hydra.core.hydra_config import HydraConfig

from dflash.run.cli import setup

setup()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    from dflash.run.launcher import launch

    launch(cfg, list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
