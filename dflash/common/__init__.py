"""Shared basics every folder may use: process plumbing, the stop request, a run directory's
on-disk layout, metric loggers, plots and the step profiler."""

from .comm import PeerError, RankContext  # rank context, process groups, bounded messages
from .interrupt import StopRequest  # Ctrl-C / SIGTERM as "stop after this step"
from .layout import find_checkpoint, read_run_config  # checkpoints, run config, metrics on disk
from .loggers import Logger, make_logger  # console and wandb metric logging
from .plot import plot_run  # RUN_DIR/metrics.png from metrics.jsonl
from .profiling import StepProfiler  # torch.profiler over chosen steps
