"""dflash: train and evaluate DFlash block-diffusion drafters."""

__version__ = "0.1.0"
