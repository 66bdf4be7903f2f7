"""Schema of the `train` config group (conf/train/): the optimization, its budget and its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_at_least_one, check_choice, check_positive
from .model import DTYPES

LOSSES = ("hard_ce", "soft_kl", "variable_prefix", "dpace")


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps (an upper bound when time_budget_min is set)
    # minutes for the whole run (load, regen, training, evals; over resumes; dflash.train.budget)
    time_budget_min: float | None = None
    micro_batch_size: int = 8  # sequences per micro step (per trainer rank)
    grad_accum: int = 1  # micro-batches per step
    max_anchors: int = 512  # anchors per sequence, resampled every step
    lr: float = 6e-4  # peak learning rate
    min_lr_ratio: float = 0.0  # final lr / peak
    warmup_ratio: float = 0.04  # warmup share of steps (of the time after step 1 with a budget)
    weight_decay: float = 0.0  # AdamW decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    clip_grad: float = 1.0  # max grad norm
    # hard_ce | soft_kl | variable_prefix (D2SD: a visible prefix of real tokens per block, loss
    # on the rest) | dpace (D-PACE: per-position weights from the expected accepted length)
    # (dflash.train.objective)
    loss: str = "hard_ce"
    allow_soft_loss: bool = False  # soft KL must be chosen explicitly (see validate)
    gamma: float | None = None  # None: 7 for B=16, 5 for B=10, 4 for B=8
    # train.loss=variable_prefix: P(prefix length l) ~ prefix_base^l over prefix_min..B-1
    prefix_base: float = 0.9
    # shortest visible prefix (1 = the anchor alone, how the reference decodes; NeMo uses 2)
    prefix_min: int = 1
    dpace_alpha: float = 0.5  # train.loss=dpace: confidence smoothing q' = (1-alpha) q + alpha
    # drafter.variant=dflash2: weight of the selector's loss beside the block CE
    selector_loss_weight: float = 1.0
    # all | by_weight: keep position k's label with probability w_k / w_1, weighted 1 / p (the
    # same expected loss and gradient from ~45% of the lm_head rows at B=16, gamma 7)
    label_sampling: str = "all"
    noise_std: float = 0.0  # input-side Gaussian noise on aux features, relative to their RMS
    dtype: str = "auto"  # compute dtype under autocast; master weights stay fp32
    lm_head_chunk: int = 2048  # positions per chunk of the lm_head + CE
    # the lm_head + CE of hard_ce, variable_prefix and DFlash2's selection: fused (the gradient
    # formed in the forward, dflash.train.fused_ce) | plain (checkpointed) | auto (fused on CUDA)
    # | tiles (fused, DFlash2's CE stats tile by tile, giving tiled_topk its tile maxima:
    # 1.38x on CPU, 0.93x on an H100)
    fused_head: str = "auto"
    attn_kernel: str = "auto"  # drafter attention: flex (block-sparse) | sdpa (dense) | auto
    compile: bool = False  # the drafter as one static compiled graph (rows padded to max_length)
    fuse: bool = (
        False  # CUDA: one compiled kernel per RMSNorm / RoPE / SwiGLU (dflash.drafter.fuse)
    )
    seed: int = 0  # init, anchors, noise
    log_every: int = 10  # steps between logs
    eval_every: int = 100  # steps between evals
    save_every: int = 100  # steps between saves
    keep_last: int = 2  # checkpoints kept
    # an in-loop eval figure (eval/tau, eval/<set>/tau): the drafter of the eval that scored
    # highest on it is kept in checkpoints/best (dflash/train/resume.py); "" keeps none
    keep_best: str = ""
    profile_at: int = 0  # > 0: torch.profiler over steps profile_at.. into RUN/profile (loop.py)
    profile_steps: int = 5  # steps that profile covers
    save_on_interrupt: bool = True  # Ctrl-C: finish the step, save it, print the resume command
    dist: str = "ddp"  # trainer ranks: ddp | fsdp | deepspeed (dflash.train.parallelize)
    zero_stage: int = 1  # train.dist=deepspeed: ZeRO stage 1, 2 or 3

    def validate(self) -> None:
        check_choice("train.dtype", self.dtype, DTYPES)
        check_choice("train.loss", self.loss, LOSSES)
        check_choice("train.label_sampling", self.label_sampling, ("all", "by_weight"))
        check_choice("train.attn_kernel", self.attn_kernel, ("auto", "flex", "sdpa"))
        check_choice("train.fused_head", self.fused_head, ("auto", "fused", "tiles", "plain"))
        check_choice("train.dist", self.dist, ("ddp", "fsdp", "deepspeed"))
        check_choice("train.zero_stage", self.zero_stage, (1, 2, 3))
        if self.keep_best and not self.keep_best.startswith("eval/"):
            raise ValueError(
                f"train.keep_best={self.keep_best!r} is not an in-loop eval figure: name one as "
                "it is logged (eval/tau, eval/stdlib_heldout/tau), or '' to keep no best"
            )
        if self.keep_best.rsplit("/", 1)[-1].startswith("num_"):
            raise ValueError(
                f"train.keep_best={self.keep_best!r} is a count, not a score (the best is the "
                "highest): name a tau, streak, dds@B or acc_pos_K figure"
            )
        if self.loss == "soft_kl" and not self.allow_soft_loss:
            raise ValueError(
                "train.loss=soft_kl trains a soft objective while acceptance is judged by the "
                "argmax (matching the target's distribution does not maximise exact-match "
                "acceptance); to train it anyway, also set train.allow_soft_loss=true (logged)"
            )
        check_positive("train.gamma", self.gamma, " (position weights exp(-(k-1)/gamma))")
        check_positive("train.prefix_base", self.prefix_base, " (prior P(l) ~ prefix_base^l)")
        if self.prefix_min < 1:
            raise ValueError(
                f"train.prefix_min must be >= 1 (the anchor is always visible), got "
                f"{self.prefix_min}"
            )
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"train.dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        if self.selector_loss_weight < 0:
            raise ValueError(
                f"train.selector_loss_weight must be >= 0, got {self.selector_loss_weight}"
            )
        if self.label_sampling == "by_weight" and self.loss in ("variable_prefix", "dpace"):
            raise ValueError(
                f"train.label_sampling=by_weight keeps labels by the fixed decay weights; "
                f"train.loss={self.loss} weighs positions its own way (per block): use "
                "train.label_sampling=all"
            )
        check_positive("train.time_budget_min", self.time_budget_min, " minutes")
        check_positive("train.lr", self.lr, " (the peak learning rate, e.g. 6e-4)")
        check_positive("train.clip_grad", self.clip_grad, " (the max gradient norm, e.g. 1.0)")
        for key in ("min_lr_ratio", "warmup_ratio"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"train.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas must be two values in [0, 1), got {list(self.betas)}")
        check_at_least_one(
            "train",
            self,
            "steps micro_batch_size grad_accum max_anchors log_every eval_every save_every "
            "lm_head_chunk profile_steps",
        )
