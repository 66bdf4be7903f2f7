"""Who does what in a split run (`Roles`) and which micro-batch goes where (`Schedule`): pure
arithmetic, the same on every rank, so no rank ever has to ask another."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ...config import RunConfig, TopologyConfig


@dataclass(frozen=True)
class Roles:
    num_workers: int
    num_trainers: int

    @classmethod
    def from_topology(cls, topo: TopologyConfig, world: int) -> Roles | None:
        """None for colocated; validated split layout otherwise."""
        if topo.mode == "colocated":
            return None
        if world < 2:
            raise ValueError(
                "topology.mode=split needs at least 2 processes (target workers + trainers); "
                "launch with `torchrun --nproc-per-node N train.py ...`, or use "
                "topology=colocated on a single device"
            )
        if not 1 <= topo.num_target_ranks <= world - 1:
            raise ValueError(
                f"topology.num_target_ranks={topo.num_target_ranks} with {world} processes: "
                f"choose 1..{world - 1} (the remaining ranks train the drafter)"
            )
        return cls(topo.num_target_ranks, world - topo.num_target_ranks)

    @property
    def trainer_ranks(self) -> list[int]:
        return [self.num_workers + d for d in range(self.num_trainers)]

    def trainer_rank(self, d: int) -> int:
        return self.num_workers + d

    def role(self, rank: int) -> str:
        return "worker" if rank < self.num_workers else "trainer"


@dataclass(frozen=True)
class Schedule:
    """Which micro-batch, from which stream positions, produced by which worker, for which
    trainer and accumulation slot (see the `dflash.train.split` docstring)."""

    num_workers: int
    num_trainers: int
    grad_accum: int
    micro_batch_size: int
    start_step: int
    start_position: int
    steps: int

    @classmethod
    def from_config(
        cls, cfg: RunConfig, roles: Roles, start_step: int, start_position: int
    ) -> Schedule:
        return cls(
            roles.num_workers,
            roles.num_trainers,
            cfg.train.grad_accum,
            cfg.train.micro_batch_size,
            start_step,
            start_position,
            cfg.train.steps,
        )

    @property
    def per_step(self) -> int:
        return self.num_trainers * self.grad_accum

    def global_index(self, step: int, j: int) -> int:
        return step * self.per_step + j

    def worker_of(self, step: int, j: int) -> int:
        return self.global_index(step, j) % self.num_workers

    def trainer_of(self, j: int) -> tuple[int, int]:
        """(trainer index d, accumulation slot a)."""
        return j % self.num_trainers, j // self.num_trainers

    def position(self, step: int, j: int) -> int:
        return (
            self.start_position
            + ((step - self.start_step) * self.per_step + j) * self.micro_batch_size
        )

    def worker_items(self, w: int) -> Iterator[tuple[int, int]]:
        for s in range(self.start_step, self.steps):
            for j in range(self.per_step):
                if self.worker_of(s, j) == w:
                    yield s, j

    def trainer_items(self, d: int) -> Iterator[tuple[int, int]]:
        for s in range(self.start_step, self.steps):
            for a in range(self.grad_accum):
                yield s, a * self.num_trainers + d
