"""dflash: train and evaluate DFlash block-diffusion drafters."""

import time as _time

__version__ = "0.1.0"
# when the process first imported dflash: the start of a run's clock (train.time_budget_min)
PROCESS_T0 = _time.monotonic()
