"""Training: one optimizer step over prepared micro-batches, the losses, wrapping for DDP / FSDP /
DeepSpeed, the loop, the time budget, checkpoints and resume, and the colocated and split runs."""

from .colocated import run_colocated  # one process (or data-parallel ranks) capturing in step
from .loop import train_loop  # resume, then { step; log; eval; save }
from .losses import weighted_ce_sum  # the decay-weighted hard cross entropy
from .resume import load_checkpoint, save_checkpoint  # run checkpoints (weights + train state)
from .step import DrafterTrainer  # one optimizer step
