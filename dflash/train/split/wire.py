"""One micro-batch as a message (meta ints + tensors for `dflash.common.comm`), the worker counters
carried in every header, and the stream's observation points.

Legend: N rows, T positions, S samples, K aux layers, H hidden size.
"""

from __future__ import annotations

import time

import torch

from ...data.batch import TargetBatch, TokenBatch

_FINAL_HIDDEN = 1
_HEAD = ("g", "step", "j", "flags", "N", "T", "S")


class WorkerStats:
    """Cumulative producer counters, sent in every header (so trainers see every worker)."""

    FIELDS = ("tokens", "batches", "forward_us", "backpressure_us", "elapsed_us", "inflight_sum")

    def __init__(self):
        self.t0 = time.perf_counter()
        self.tokens = self.batches = self.inflight_sum = 0
        self.forward_s = self.backpressure_s = 0.0

    def ints(self) -> list[int]:
        return [
            self.tokens,
            self.batches,
            int(self.forward_s * 1e6),
            int(self.backpressure_s * 1e6),
            int((time.perf_counter() - self.t0) * 1e6),
            self.inflight_sum,
        ]


def pack_batch(
    tb: TargetBatch, g: int, step: int, j: int, stats: list[int]
) -> tuple[list[int], list[torch.Tensor]]:
    N, T = tb.input_ids_NT.shape
    dev = tb.aux_NTF.device
    ints = torch.cat(
        [
            tb.input_ids_NT.reshape(-1),
            tb.position_ids_NT.reshape(-1),
            tb.segment_ids_NT.reshape(-1),
            tb.loss_mask_NT.reshape(-1).long(),
            tb.next_token_NT.reshape(-1),
            tb.sample_ids.to(dev).long(),
            torch.tensor([int(x) for x in tb.row_seeds], dtype=torch.long, device=dev),
        ]
    )
    tensors, flags = [ints, tb.aux_NTF], 0
    if tb.final_hidden_NTH is not None:
        tensors.append(tb.final_hidden_NTH)
        flags |= _FINAL_HIDDEN
    return [g, step, j, flags, N, T, int(tb.sample_ids.numel()), *stats], tensors


def unpack_batch(meta: list[int], tensors: list[torch.Tensor]) -> tuple[TargetBatch, dict]:
    head = dict(zip(_HEAD, meta[: len(_HEAD)]))
    head["stats"] = meta[len(_HEAD) : len(_HEAD) + len(WorkerStats.FIELDS)]
    N, T, S = head["N"], head["T"], head["S"]
    ints = tensors[0]
    # one device->host copy of the token fields: the row seeds, and the host copy the trainer
    # picks anchors and labelled positions from (so its step reads nothing back)
    host = ints.cpu()

    def fields(x):
        ids, pos, seg, lm, _ = x[: 5 * N * T].view(5, N, T)
        return ids, pos, seg, lm.bool(), x[5 * N * T : 5 * N * T + S]

    seeds = host[5 * N * T + S : 5 * N * T + S + N].tolist()
    tb = TargetBatch(
        *fields(ints),
        seeds,
        aux_NTF=tensors[1],
        next_token_NT=ints[4 * N * T : 5 * N * T].view(N, T),
        final_hidden_NTH=tensors[2] if head["flags"] & _FINAL_HIDDEN else None,
        host=TokenBatch(*fields(host), seeds),
    )
    return tb, head


class StreamTap:
    """Observation points of the worker -> trainer stream. This default passes every batch
    through untouched; `dflash.tools.testing` swaps in one that dumps batches or injects faults, so
    tests can watch and break the real product path."""

    def produced(self, tb: TargetBatch, step: int) -> TargetBatch:
        """A worker's batch after the target forward, before it is packed."""
        return tb

    def sent(self, g: int, tb: TargetBatch, **where) -> None:
        """Micro-batch g handed to the link (where: worker, trainer, step, j)."""

    def received(self, g: int, tb: TargetBatch, **where) -> None:
        """Micro-batch g unpacked by a trainer's receiver (where: worker, trainer, step, j)."""


tap = StreamTap()
