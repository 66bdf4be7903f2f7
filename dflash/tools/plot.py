"""Plots a person can look at without wandb: `python -m dflash.tools.plot RUN_DIR [--out FILE.png]`.

The drawing itself is dflash.common.plot (every run calls it at its end)."""

from __future__ import annotations

import argparse

from ..common.plot import plot_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(plot_run(a.run_dir, a.out))


if __name__ == "__main__":
    main()
