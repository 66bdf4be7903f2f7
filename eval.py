"""Evaluate a drafter checkpoint (ours or a published z-lab-format directory):
`python eval.py ckpt=PATH [target=...] [out=report.json]` -> streak / tau / DDTree per prompt.
Its log (eval.log) and eval-set cache go to evals/<checkpoint name>/ (made only once the
checkpoint is found)."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig

from dflash.run.cli import setup, typed

setup()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    from dflash.eval.cli import eval_dir, run_eval
    from dflash.run.directory import RunDir

    rd = None
    try:
        rc = typed(cfg)
        rd = RunDir(eval_dir(rc), "eval.log").open()
        run_eval(rc, rd.path, list(HydraConfig.get().overrides.task))
    except (ValueError, FileNotFoundError) as e:
        if rd is not None:
            rd.close(ok=False)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    rd.close(ok=True)


if __name__ == "__main__":
    main()
