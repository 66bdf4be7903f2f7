"""How the trainer ranks share the drafter (train.dist): every wrapping happens here, in named
steps; the model file knows nothing of it.

- ddp: replicated weights and optimizer, gradients all-reduced (torch DDP).
- fsdp: torch's fully_shard (FSDP2): weights, gradients and optimizer state sharded per layer.
- deepspeed: DeepSpeed ZeRO stage train.zero_stage (1: optimizer state, 2: + gradients,
  3: + weights sharded) with our torch AdamW as its optimizer.

Every mode averages gradients over the data-parallel ranks, so the trainer's loss scaling
(`sum * world / global weight sum`) gives the gradient of one big batch in all of them, and a
step with gradient accumulation reduces once, after the last micro-batch.

Checkpoints: ddp's optimizer state is whole on every rank and goes into train_state.pt; fsdp's
and DeepSpeed's is split over the ranks, so every rank writes and reads its own part in the step
directory's `optimizer/` (`save_shards` / `load_shards`: torch.distributed.checkpoint for fsdp,
which also reshards for another rank count; DeepSpeed's own checkpoint for ZeRO).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig
from ..drafter.model import DFlashDrafter
from ..target.load import resolve_dtype

DIST_MODES = ("ddp", "fsdp", "deepspeed")


SHARDS_DIR = "optimizer"  # a step directory's per-rank optimizer state (fsdp, deepspeed)


class Parallel:
    """One process, no wrapping. Subclasses override the named steps."""

    sharded = False  # weights are split over ranks: gather them to evaluate or save
    # the optimizer state is split over ranks: every rank saves and loads its own part
    shards_optimizer: str | None = None

    def __init__(self, drafter: DFlashDrafter, cfg: TrainConfig, device: torch.device, group):
        self.drafter, self.cfg, self.device, self.group = drafter, cfg, device, group
        self.model: nn.Module = drafter
        self.optimizer = self.make_optimizer(drafter.parameters())
        self.base_optimizer = self.optimizer  # the torch optimizer the lr schedule acts on

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        # fused: one kernel for the whole update on CUDA (the 27B drafter has 1.7B fp32 params)
        return torch.optim.AdamW(
            params,
            lr=self.cfg.lr,
            betas=tuple(self.cfg.betas),
            weight_decay=self.cfg.weight_decay,
            fused=self.device.type == "cuda" and not self.sharded,
        )

    def accumulate(self, last: bool):
        """Context of one micro-batch's backward: gradients reduce only on the last one."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> torch.Tensor:
        """Clip, update, zero the gradients; returns the gradient norm before clipping (a
        tensor on the device: the trainer reads it back with its other figures, one sync)."""
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _full(norm)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight, unsharded (a collective in sharded modes: all ranks call it)."""
        return {k: _full(v) for k, v in self.drafter.state_dict().items()}

    def optimizer_state(self) -> dict | None:
        """The whole optimizer state for train_state.pt; None where every rank holds a part."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict | None) -> None:
        self.optimizer.load_state_dict(state)

    def load_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Every weight, unsharded (the fp32 master copy of a checkpoint), into the model."""
        self.drafter.load_state_dict(full)

    def save_shards(self, path: str) -> None:
        """This rank's part of the optimizer state under `path` (every rank calls it)."""

    def load_shards(self, path: str) -> None:
        """This rank's part of the optimizer state from `path` (every rank calls it)."""


class DDP(Parallel):
    def __init__(self, drafter, cfg, device, group):
        super().__init__(drafter, cfg, device, group)
        self.model = nn.parallel.DistributedDataParallel(
            drafter,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
        )

    def accumulate(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDP(Parallel):
    sharded = True

    def __init__(self, drafter, cfg, device, group):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        # A unit is gathered by its forward hook; the drafter computes every layer's context K/V
        # (self_attn.project_kv) before running the layers, so a whole layer cannot be a unit.
        # The MLPs (~5/6 of a layer's weights) are; attention, fc and norms belong to the root.
        for layer in drafter.layers:
            fully_shard(layer.mlp, mesh=mesh)
        # DFlash2's selector is called by the loss, after the drafter's forward: its own unit
        if hasattr(drafter, "candidate_selector"):
            fully_shard(drafter.candidate_selector, mesh=mesh)
        fully_shard(drafter, mesh=mesh)
        super().__init__(drafter, cfg, device, group)

    def accumulate(self, last: bool):
        self.drafter.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    shards_optimizer = "fsdp"

    def optimizer_state(self) -> dict | None:
        return None  # each rank's shard goes to the step directory (save_shards)

    def load_weights(self, full):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # every rank holds the full copy: each keeps its own shard of it
        set_model_state_dict(self.drafter, full, options=StateDictOptions(full_state_dict=True))

    def save_shards(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.drafter, self.optimizer)}
        dcp.save(state, checkpoint_id=path, process_group=self.group)

    def load_shards(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        # the layout to read into: this rank's shards of a (zero) state of the same structure
        state = {"optimizer": get_optimizer_state_dict(self.drafter, self.optimizer)}
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        set_optimizer_state_dict(self.drafter, self.optimizer, state["optimizer"])


class DeepSpeed(Parallel):
    def __init__(self, drafter, cfg, device, group):
        import deepspeed

        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError(
                "train.dist=deepspeed needs every rank to be a trainer (topology=colocated); "
                "a split run trains with train.dist=ddp or fsdp"
            )
        self.sharded = cfg.zero_stage == 3
        if dist.is_initialized():  # DeepSpeed's comm layer adopts our process group
            deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        super().__init__(drafter, cfg, device, group)
        ds_config = {
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": 1,  # we accumulate (exact sums), see accumulate()
            "gradient_clipping": cfg.clip_grad,
            "zero_optimization": {"stage": cfg.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        }
        dtype = resolve_dtype(cfg.dtype, device)
        if dtype != torch.float32:
            # The engine's forward turns an outer torch.autocast off unless its own torch_autocast
            # is on: the fp32 drafter would then meet the bf16 target features. No module is
            # named lower-precision-safe, so gradients are still reduced in fp32 (as DDP does).
            ds_config["torch_autocast"] = {
                "enabled": True,
                "dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
                "lower_precision_safe_modules": [],
            }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=drafter, optimizer=self.optimizer, config=ds_config, dist_init_required=False
        )
        self.base_optimizer = self.optimizer.optimizer  # lr schedule acts on its param groups
        self.model = self.engine

    def accumulate(self, last: bool):
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self) -> torch.Tensor:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def full_state(self):
        if not self.sharded:
            return super().full_state()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.drafter.parameters())):
            return {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}

    shards_optimizer = "deepspeed"
    TAG = "zero"  # DeepSpeed's checkpoint tag: its files go to <step dir>/optimizer/zero/

    def optimizer_state(self) -> dict | None:
        return None  # each rank's partition goes to the step directory (save_shards)

    def load_weights(self, full):
        """Nothing here: ZeRO keeps fp32 copies of the weights in its optimizer partitions, which
        would overwrite the module's at the next step; `load_shards` restores both together."""

    def save_shards(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag=self.TAG, client_state={}, save_latest=False)

    def load_shards(self, path: str) -> None:
        self.engine.load_checkpoint(
            path, tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )


def parallelize(
    drafter: DFlashDrafter, cfg: TrainConfig, device: torch.device, group=None
) -> Parallel:
    """`group`: the trainers' data-parallel group; None (one process, no process group): nothing
    to share, whatever train.dist says. DDP over one rank is skipped (it would only copy)."""
    if group is None:
        return Parallel(drafter, cfg, device, group)
    if cfg.dist == "ddp" and dist.get_world_size(group) == 1:
        return Parallel(drafter, cfg, device, group)
    return {"ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}[cfg.dist](drafter, cfg, device, group)


def check_saved_optimizer(par: Parallel, shards: str | None, whole, ranks: int) -> None:
    """Refuse a checkpoint whose optimizer state this wrapping cannot read: saved whole (ddp)
    vs per rank (fsdp, deepspeed), none at all, or ZeRO partitions of another rank count."""
    world = dist.get_world_size(par.group) if par.group is not None else 1
    if shards != par.shards_optimizer:
        saved = f"{shards}'s per-rank files" if shards else "one file (ddp)"
        raise ValueError(
            f"resume: the checkpoint holds the optimizer state as {saved}, this run "
            f"(train.dist={par.cfg.dist}, {world} trainer rank(s)) needs "
            f"{par.shards_optimizer or 'ddp'}'s; resume with the train.dist the run saved "
            "with, or start from the weights with drafter.init_from=<step dir>"
        )
    if shards is None and whole is None:
        raise ValueError(
            "resume: the checkpoint holds no optimizer state (a sharded run of an older dflash); "
            "start from its weights with drafter.init_from=<step dir>"
        )
    if shards == "deepspeed" and ranks != world:  # DeepSpeed reads back its own partitioning
        raise ValueError(
            f"resume: the checkpoint's ZeRO optimizer state is partitioned over {ranks} ranks, "
            f"this run has {world}; resume it on {ranks} ranks"
        )


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t
