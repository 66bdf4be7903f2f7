"""One training step of the drafter over target batches (colocated or streamed, same code).

Legend: N rows, T positions, A anchors, B block size, K = B-1 labelled positions per block,
Q = A*B, H hidden, M labelled positions.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ..config import TrainConfig
from ..data.batch import TargetBatch, add_input_noise, to_device
from ..drafter import fuse
from ..drafter.attention import resolve_kernel, to_kernel_masks
from ..drafter.blocks import (
    Blocks,
    build_blocks,
    candidate_anchors,
    gather_labels,
    label_valid,
    mask_rules,
    sample_anchors,
    sample_kept_labels,
)
from ..drafter.model import DFlashDrafter
from ..drafter.spec import DrafterSpec
from ..drafter.variants import build_model
from ..target.load import resolve_dtype
from ..target.shape import Heads
from .budget import TimeBudget, budget_lr
from .losses import cosine_lr, position_weights
from .objective import Objective
from .parallelize import check_saved_optimizer, parallelize


@dataclass
class Prepared:
    """One micro-batch made ready for the drafter: blocks at sampled anchors and their labels.

    labels_NAK / label_valid_NAK: the target's next token at block positions 1..B-1 and whether
    it is a real label; weights_NAK: position weight x validity (the loss denominator).
    label_index_M / hidden_index_M: where the M labels the loss uses are in labels_NAK.flatten()
    and in the drafter's [N*Q] outputs (chosen on the host: indexing with them needs no sync);
    all real labels, or under `train.label_sampling=by_weight` a random subset of them whose
    loss weights (`loss_weights_NAK`, weight / keep probability) keep the loss unbiased.
    num_labels, num_tokens: host counts."""

    blocks: Blocks
    labels_NAK: torch.Tensor
    label_valid_NAK: torch.Tensor
    weights_NAK: torch.Tensor
    label_index_M: torch.Tensor
    hidden_index_M: torch.Tensor
    num_labels: int
    num_tokens: int
    loss_weights_NAK: torch.Tensor | None = None  # None: weights_NAK
    prefix_NA: torch.Tensor | None = None  # train.loss=variable_prefix: visible prefix lengths

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, A, B-1, ...] -> its M labelled entries, in row-major order (= x[label_valid])."""
        return x.reshape(-1, *x.shape[3:]).index_select(0, self.label_index_M)


class StepFigures:
    """A step's figures, on the device until `read()` (one host sync; the loop reads them at log
    steps only, so the host queues the next steps' kernels meanwhile)."""

    KEYS = (
        "loss",
        "acc",
        "tokens",
        "labels",
        "empty_micro_batches",
        "greedy_hits",
        "greedy_tokens",
        "grad_norm",
    )

    def __init__(self, stats: torch.Tensor, lr: float):
        self.stats, self.lr = stats, lr

    def read(self) -> dict:
        out = {f"train/{k}": v for k, v in zip(self.KEYS, self.stats.tolist())}
        # the share of the step's response tokens that are the target's own greedy tokens
        hits, tokens = out.pop("train/greedy_hits"), out.pop("train/greedy_tokens")
        out["train/greedy_agreement"] = hits / tokens if tokens else 1.0
        return {**out, "train/lr": self.lr}


compute_dtype = resolve_dtype  # same rule for the target's and the drafter's compute dtype


def row_seed(base: int, step: int, key: int) -> int:
    return ((base * 1_000_003 + step) * 1_000_033 + key) % (2**62)


class DrafterTrainer:
    def __init__(
        self,
        drafter: DFlashDrafter,
        heads: Heads,
        cfg: TrainConfig,
        device: torch.device,
        dp_group=None,
        ctrl_group=None,
    ):
        self.cfg, self.device, self.heads = cfg, device, heads
        self.spec: DrafterSpec = drafter.spec
        self.drafter = drafter.to(device=device, dtype=torch.float32)  # fp32 master weights
        self.dp_group = dp_group
        self.ctrl_group = ctrl_group  # a gloo twin of dp_group: the loop's host-side stop flags
        self.dp_world = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dtype = compute_dtype(cfg.dtype, device)
        if self.dtype == torch.float16:
            raise ValueError(
                "train.dtype=float16 overflows in the drafter's fc layer (its input concatenates "
                "several target layers' hidden states); use bfloat16 or float32"
            )
        self.par = parallelize(self.drafter, cfg, device, dp_group)
        self.model: nn.Module = self.par.model
        self.opt = self.par.optimizer
        fuse.ENABLED = cfg.fuse  # process-wide: the in-loop eval runs the same kernels
        # train.compile: batches come padded to one row length (build.static_length) and the
        # anchors to max_anchors, so the drafter is one static graph, compiled once
        self._compile_pending = cfg.compile
        if cfg.compile:
            # the rotary's per-device frequency cache filled here, not inside the traced graph
            self.drafter.rotary.cos_sin(torch.zeros(1, dtype=torch.long, device=device), self.dtype)
            self.model = torch.compile(self.model, dynamic=False)
        # train.time_budget_min: the schedule follows the clock (dflash.train.budget), not the step
        self.budget = TimeBudget(cfg.time_budget_min) if cfg.time_budget_min else None
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.par.base_optimizer, lambda s: self._lr_factor(s)
        )
        # train.loss and drafter.variant: prefixes, weights, the loss (dflash.train.objective)
        self.objective = Objective(cfg, self.drafter, device, self.dtype)
        # train.label_sampling=by_weight: P(keep position k's label) = w_k / w_1 (host tensor)
        self.keep_p_k = None
        if cfg.label_sampling == "by_weight":
            w = position_weights(self.spec.block_size, cfg.gamma)
            self.keep_p_k = w / w.max()
        self.attn_kernel = resolve_kernel(cfg.attn_kernel, device)
        self.step = 0
        self._interval = None  # summed step figures since interval_counts() last read them

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if self.budget is not None:
            return budget_lr(self.budget.schedule, cfg.warmup_ratio, cfg.min_lr_ratio)
        warmup = int(round(cfg.warmup_ratio * cfg.steps))
        return cosine_lr(step, cfg.steps, warmup, cfg.min_lr_ratio)

    def follow_budget(self, progress: float) -> None:
        """The next step's learning rate from the budget's progress, the same on every rank (the
        loop agrees it after each step: dflash.train.budget)."""
        self.budget.schedule = progress
        self.sched.step()

    # ------------------------------------------------------------------ pieces
    def prepare(self, tb: TargetBatch, step: int) -> Prepared:
        """Anchors, blocks and labels; labels come from the clean forward (before any noise)."""
        if tb.noised:
            raise ValueError(
                "labels must be derived from the clean target forward, before input "
                "noise (noised inputs would teach the drafter labels the target never "
                "produces); this batch was already noised"
            )
        # Anchors and labelled positions come from the host copy of the token fields: nothing
        # in a step reads the device back (the step's figures are read at log steps only).
        host, B, num_tokens = tb.host_tokens(), self.spec.block_size, tb.num_tokens
        tb = tb.to(self.device)
        dev = tb.input_ids_NT.device
        cand = candidate_anchors(host.segment_ids_NT, host.loss_mask_NT)
        seeds = [row_seed(self.cfg.seed, step, int(k)) for k in tb.row_seeds]
        anchors_h, valid_h = sample_anchors(cand, self.cfg.max_anchors, seeds, self.cfg.compile)
        lvalid_h = label_valid(host.loss_mask_NT, host.segment_ids_NT, anchors_h, valid_h, B)
        prefix_h = self.objective.prefix_lengths(
            [row_seed(self.cfg.seed + 3, step, int(k)) for k in tb.row_seeds], anchors_h.shape
        )
        if prefix_h is not None:  # train.loss=variable_prefix: labels only past the prefix
            lvalid_h = lvalid_h & self.objective.past_prefix(prefix_h)
        real_h = lvalid_h  # every real label: the weights' denominator
        if self.keep_p_k is not None:  # train.label_sampling=by_weight
            seeds_keep = [row_seed(self.cfg.seed + 2, step, int(k)) for k in tb.row_seeds]
            lvalid_h = lvalid_h & sample_kept_labels(self.keep_p_k, seeds_keep, lvalid_h.shape)
        label_idx = lvalid_h.flatten().nonzero().flatten()
        n, k = label_idx.div(B - 1, rounding_mode="floor"), label_idx % (B - 1)
        anchors, valid, label_idx, hidden_idx = (
            to_device(x, dev) for x in (anchors_h, valid_h, label_idx, n * B + k + 1)
        )
        blocks = build_blocks(
            tb.input_ids_NT,
            tb.position_ids_NT,
            tb.segment_ids_NT,
            anchors,
            valid,
            B,
            self.spec.mask_token_id,
            mask_rules(self.spec),
        )
        blocks.masks = to_kernel_masks(blocks.masks, self.attn_kernel)
        prefix = None if prefix_h is None else to_device(prefix_h, dev)
        if prefix is not None:
            self.objective.show_prefix(blocks, tb, prefix)
        # a deferred screen (build.screen_batch) may have dropped a sample after the host copy
        # was taken, zeroing its whole loss mask on the device: its anchors' labels then weigh
        # nothing (an anchor is always a response token of a kept sample)
        alive = tb.loss_mask_NT.gather(1, anchors).bool()
        lvalid = to_device(real_h, dev) & alive[..., None]
        weights = self.objective.weights(lvalid, prefix)
        return Prepared(
            blocks,
            gather_labels(tb.next_token_NT, anchors, B),
            lvalid,
            weights,
            label_idx,
            hidden_idx,
            num_labels=label_idx.numel(),
            num_tokens=num_tokens,
            # pinned, non-blocking: a plain .to() of this host tensor was a stream sync a step
            loss_weights_NAK=None
            if self.keep_p_k is None
            else weights / to_device(self.keep_p_k, dev),
            prefix_NA=prefix,
        )

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def forward_sums(self, tb: TargetBatch, prepared: Prepared, model: nn.Module | None = None):
        """(loss sum, weighted correct sum) of one micro-batch (dflash.train.objective)."""
        blocks, p = prepared.blocks, prepared
        model = model or self.model
        N, A = blocks.anchors_NA.shape
        B = self.spec.block_size
        with torch.no_grad():
            emb = self.heads.embed_ids(blocks.block_ids_NQ)
        with self.autocast():
            h = model(
                emb.to(self.dtype),
                blocks.block_pos_NQ,
                blocks.masks,
                aux_NTF=tb.aux_NTF.to(self.dtype),
                ctx_pos_NT=tb.position_ids_NT,
            )
            h_M = h.reshape(N * A * B, -1).index_select(0, p.hidden_index_M)
            # the head stays in its own dtype: the losses cast the hidden chunk instead
            return self.objective.sums(h_M, tb, p, self.heads)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_world > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    # ------------------------------------------------------------------ step
    def train_step(self, micro: list[TargetBatch]) -> dict:
        """One optimizer step; returns its figures (reading them back is one host sync)."""
        return self.step_async(micro).read()

    def step_async(self, micro: list[TargetBatch]) -> StepFigures:
        """One optimizer step without a host sync: the figures stay on the device until read.
        sum-then-divide by the global weight sum: grad accumulation and DP give the gradient of
        one big batch."""
        if not self._compile_pending:
            return self._step_async(micro)
        self._compile_pending = False
        try:  # train.compile: the first step compiles; if that fails, the run goes on eager
            return self._step_async(micro)
        except Exception as e:  # noqa: BLE001 -- an error of the eager step raises again below
            warnings.warn(
                f"train.compile: the compiled drafter step failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); training goes on without "
                "compile (set train.compile=false to skip the attempt)",
                stacklevel=2,
            )
            self.model = self.par.model
            self.par.base_optimizer.zero_grad(set_to_none=True)
            return self._step_async(micro)

    def _step_async(self, micro: list[TargetBatch]) -> StepFigures:
        step = self.step
        self.model.train()
        with record_function("dflash.prepare"):
            prepared = [self.prepare(tb, step) for tb in micro]
        w_sum = self._all_reduce(torch.stack([p.weights_NAK.sum() for p in prepared]).sum().float())
        denom = w_sum.clamp(min=1e-8)
        loss_total = torch.zeros((), device=self.device)
        correct_total = torch.zeros((), device=self.device)
        agree_total = torch.zeros(2, device=self.device)
        for i, (tb, prep) in enumerate(zip(micro, prepared)):
            tb = tb.to(self.device)
            agree_total += tb.greedy_agreement()
            if self.cfg.noise_std > 0:
                g = torch.Generator(device=self.device).manual_seed(
                    row_seed(self.cfg.seed + 1, step, int(tb.row_seeds[0]))
                )
                tb = add_input_noise(tb, self.cfg.noise_std, g)
            with self.par.accumulate(last=i == len(micro) - 1):
                with record_function("dflash.forward"):
                    loss_sum, correct = self.forward_sums(tb, prep)
                with record_function("dflash.backward"):
                    self.par.backward(loss_sum * self.dp_world / denom)
            loss_total += loss_sum.detach()
            correct_total += correct.detach()
        lr = self.par.base_optimizer.param_groups[0]["lr"]
        with record_function("dflash.optimizer"):
            grad_norm = self.par.step()
        if self.budget is None:  # a budget's schedule moves with the loop's clock (follow_budget)
            self.sched.step()
        self.step += 1
        counts = torch.tensor(
            [
                float(sum(p.num_tokens for p in prepared)),
                float(sum(p.num_labels for p in prepared)),
                # a micro-batch without labels (one-token responses) still runs forward and
                # backward (a zero loss on the graph), so DP peers stay in lockstep
                float(sum(p.num_labels == 0 for p in prepared)),
            ]
        )
        stats = self._all_reduce(
            torch.cat(
                [
                    torch.stack([loss_total, correct_total]),
                    to_device(counts, self.device),
                    agree_total,
                ]
            )
        )
        stats = torch.cat(
            [stats[:2] / denom, stats[2:], grad_norm.float().reshape(1).to(self.device)]
        )
        self._interval = stats if self._interval is None else self._interval + stats
        return StepFigures(stats, lr)

    def interval_counts(self) -> dict:
        """Tokens and labels of all steps since the last call, summed over the ranks (one sync)."""
        if self._interval is None:
            return {"tokens": 0.0, "labels": 0.0}
        tokens, labels = self._interval[2:4].tolist()
        self._interval = None
        return {"tokens": tokens, "labels": labels}

    # ------------------------------------------------------------------ state
    def drafter_for_io(self) -> DFlashDrafter:
        """The drafter to evaluate or save: the trained module itself, or, when its weights are
        sharded over the ranks (fsdp, ZeRO-3), an unsharded copy (every rank must call this)."""
        if not self.par.sharded:
            return self.drafter
        full = self.par.full_state()
        copy = build_model(self.spec).to(self.device)
        copy.load_state_dict(full)
        return copy

    def layout(self) -> dict:
        """How a step cuts the sample stream: a resume with another layout says so."""
        return {
            "train.micro_batch_size": self.cfg.micro_batch_size,
            "train.grad_accum": self.cfg.grad_accum,
            "trainer ranks": self.dp_world,
        }

    def state_dict(self) -> dict:
        return {
            "optimizer": self.par.optimizer_state(),
            # fsdp / deepspeed: each rank's part of the optimizer state is in the step dir
            "optimizer_shards": self.par.shards_optimizer,
            "scheduler": self.sched.state_dict(),
            "step": self.step,
            "layout": self.layout(),
            **({"budget": self.budget.state_dict()} if self.budget is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """The trainer's part of a checkpoint; the weights (and the optimizer's per-rank parts in
        sharded modes) are loaded through `self.par` by dflash.train.resume."""
        ranks = (state.get("layout") or {}).get("trainer ranks", self.dp_world)
        check_saved_optimizer(self.par, state.get("optimizer_shards"), state["optimizer"], ranks)
        if self.par.shards_optimizer is None:
            self.par.load_optimizer_state(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if self.budget is not None and "budget" in state:
            self.budget.load_state_dict(state["budget"])
