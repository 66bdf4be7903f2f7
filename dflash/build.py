"""Builders both runs (colocated and split) call: target, drafter, batches, the dataset of a
rank, resume and the run config file. Nothing here knows which run called it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import torch

from .batch import TargetBatch, collate, target_forward
from .checkpoint import find_checkpoint, load_checkpoint, load_drafter
from .comm import RankContext
from .config import RunConfig
from .data import load_or_build_dataset
from .drafter import DFlashDrafter
from .rundir import is_off, keep_metrics_until, newest_run_of
from .shape import TargetShape
from .spec import resolve_spec
from .stream import SampleStream
from .target import Target, load_target


def build_target(cfg: RunConfig, device: torch.device | None = None) -> Target:
    """`device` (multi-process runs: this rank's device) overrides target.device for loading only;
    cfg itself is unchanged, so cache keys derived from it agree across ranks."""
    tcfg = cfg.target if device is None else dataclasses.replace(cfg.target, device=str(device))
    return load_target(
        tcfg, cfg.drafter.target_layer_ids, cfg.drafter.num_aux_layers, cfg.drafter.mask_token_id
    )


def build_drafter(cfg: RunConfig, shape: TargetShape) -> DFlashDrafter:
    spec = resolve_spec(cfg.drafter, shape)
    if tuple(spec.target_layer_ids) != shape.layer_ids:
        raise AssertionError("target and drafter disagree on aux layers")
    if cfg.drafter.init_from:
        drafter, _ = load_drafter(cfg.drafter.init_from)
        if drafter.spec.as_dict() != spec.as_dict():
            raise ValueError(
                f"drafter.init_from={cfg.drafter.init_from}: its config differs from drafter.*"
            )
        return drafter
    drafter = DFlashDrafter(spec)
    drafter.init_weights(cfg.drafter.init_std, torch.Generator().manual_seed(cfg.train.seed))
    return drafter


def make_batch(target: Target, samples: list, idx: list[int], cfg: RunConfig) -> TargetBatch:
    """The clean target forward over samples[idx]: the same in colocated and split mode."""
    # left on the host: target_forward reads the sample spans there, then moves it once
    batch = collate(
        [samples[i] for i in idx],
        pad_id=target.mask_token_id,
        pack_to=cfg.data.pack_to,
        pad_to=static_length(cfg),
    )
    return target_forward(target, batch, with_final_hidden=cfg.train.loss == "soft_kl")


def static_length(cfg: RunConfig) -> int | None:
    """Row length every batch is padded to under `train.compile` (one compiled drafter graph
    instead of one per batch length): data.pack_to when packing, else data.max_length."""
    if not cfg.train.compile:
        return None
    return cfg.data.pack_to or cfg.data.max_length


class BadBatchError(ValueError):
    pass


def screen_batch(
    tb: TargetBatch, on_bad: str, origin: str = "", defer: bool = False
) -> tuple[TargetBatch, list[int] | PendingBadSamples]:
    """Non-finite aux (or final hidden) states: report the sample ids, then either stop
    (BadBatchError) or skip those samples. Skipping zeroes their aux states and loss mask
    instead of dropping rows, so every rank still runs the same forward/backward (DDP) and the
    other samples of the batch train unchanged (segments never attend to each other).

    defer: no device sync now. The flagged samples (none, almost always) are zeroed on the
    device either way, and the returned PendingBadSamples reports them when `.read()` (at a
    log step): their ids, or BadBatchError under on_bad=stop."""
    bad_S = _bad_samples(tb)
    if defer:
        return _drop(tb, bad_S), PendingBadSamples(bad_S, tb.sample_ids, on_bad, origin)
    if not bool(bad_S.any()):
        return tb, []
    ids = PendingBadSamples(bad_S, tb.sample_ids, on_bad, origin).read()
    return _drop(tb, bad_S), ids


class PendingBadSamples:
    def __init__(self, bad_S: torch.Tensor, sample_ids: torch.Tensor, on_bad: str, origin: str):
        self.bad_S, self.sample_ids, self.on_bad, self.origin = bad_S, sample_ids, on_bad, origin

    def read(self) -> list[int]:
        bad = self.bad_S.cpu()
        if not bool(bad.any()):
            return []
        ids = [int(i) for i in self.sample_ids.cpu()[bad].tolist()]
        where = f" ({self.origin})" if self.origin else ""
        if self.on_bad == "stop":
            raise BadBatchError(
                f"non-finite target aux states in samples {ids}{where}; "
                "topology.on_bad_batch=stop (set it to skip to train on without them)"
            )
        print(
            f"warning: skipped samples {ids}{where}: non-finite target aux states "
            "(topology.on_bad_batch=skip)",
            file=sys.stderr,
            flush=True,
        )
        return ids


def _bad_samples(tb: TargetBatch) -> torch.Tensor:
    """bool [S]: samples with a non-finite aux (or final hidden) state, found on the device."""
    bad_NT = ~torch.isfinite(tb.aux_NTF).all(-1)
    if tb.final_hidden_NTH is not None:
        bad_NT |= ~torch.isfinite(tb.final_hidden_NTH).all(-1)
    seg = tb.segment_ids_NT.to(bad_NT.device)
    S = tb.sample_ids.numel()
    hit = torch.zeros(S + 1, dtype=torch.long, device=bad_NT.device)  # slot 0: padding
    hit.scatter_reduce_(0, (seg + 1).clamp(min=0).flatten(), bad_NT.flatten().long(), "amax")
    return hit[1:].bool()


def _drop(tb: TargetBatch, bad_S: torch.Tensor) -> TargetBatch:
    seg = tb.segment_ids_NT.to(bad_S.device)
    drop_NT = bad_S[seg.clamp(min=0)] & (seg >= 0)
    fh = tb.final_hidden_NTH
    return dataclasses.replace(
        tb,
        aux_NTF=tb.aux_NTF.masked_fill(drop_NT[..., None], 0),
        final_hidden_NTH=None if fh is None else fh.masked_fill(drop_NT[..., None], 0),
        loss_mask_NT=tb.loss_mask_NT & ~drop_NT,
    )


# ----------------------------------------------------------------------------- dataset per rank
def samples_digest(samples: list) -> str:
    """Cheap identity of a dataset (ids, lengths, token sums) to check ranks agree on it."""
    h = hashlib.sha256()
    for s in samples:
        h.update(
            f"{s.sample_id},{s.input_ids.numel()},{int(s.input_ids.sum())},{int(s.loss_mask.sum())};".encode()
        )
    return h.hexdigest()[:16]


def check_same_samples(samples: list, digest: str, rank: int) -> None:
    if samples_digest(samples) != digest:
        raise ValueError(
            f"rank {rank} read a different dataset than rank 0 (digest "
            f"{samples_digest(samples)} vs {digest}): every rank must see the same "
            "data.cache_dir (a shared filesystem, or copy the cache to every node)"
        )


def data_cache(cfg: RunConfig, run_dir: str) -> str:
    return cfg.data.cache_dir or os.path.join(run_dir, "data")


def dataset_for_rank(
    cfg: RunConfig, target: Target, run_dir: str, log, ctx: RankContext | None = None
) -> list:
    """Rank 0 loads or regenerates the data; the other ranks read rank 0's cache afterwards and
    check they got the same samples."""
    cache = data_cache(cfg, run_dir)
    if ctx is None or ctx.world == 1:
        return load_or_build_dataset(cfg.data, cfg.target, target, cache, log=log)
    if ctx.rank == 0:
        samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=log)
        ctx.broadcast_object(samples_digest(samples), src=0)
        return samples
    digest = ctx.broadcast_object(None, src=0)
    samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=lambda *_: None)
    check_same_samples(samples, digest, ctx.rank)
    return samples


# ----------------------------------------------------------------------------- resume, run config
def resume_path(cfg: RunConfig, run_dir: str) -> str | None:
    """The launcher has already resolved resume=true to a checkpoint (`rundir.plan_run`); a
    caller that did not gets this run dir's own checkpoint, else this experiment's newest."""
    r = cfg.resume
    if is_off(r):
        return None
    if str(r).lower() == "true":
        try:
            return find_checkpoint(run_dir)
        except FileNotFoundError:
            return newest_run_of(cfg.out_root, cfg.exp_name)
    return str(r)


def resume_from(ckpt: str, trainer, stream: SampleStream, logger) -> None:
    """Weights (fp32 master), optimizer, scheduler, step, RNG and the stream position."""
    state = load_checkpoint(ckpt, trainer.drafter)
    trainer.load_state_dict(state["trainer"])
    stream.load_state_dict(state["source"]["stream"])
    logger.info(
        f"resumed from {state['path']} at step {trainer.step} (sample position {stream.position})"
    )


def resume(
    cfg: RunConfig,
    run_dir: str,
    trainer,
    stream: SampleStream,
    logger,
    ctx: RankContext | None = None,
    src: int = 0,
) -> dict:
    """Rank `src` (the first trainer) resolves and loads the checkpoint, then announces
    {ckpt, step, position} to every rank of the job: the other trainers load the same one, split
    workers start producing at exactly that stream position. Returns the announcement."""
    start = None
    if ctx is None or ctx.rank == src:
        ckpt = resume_path(cfg, run_dir)
        ckpt = find_checkpoint(ckpt) if ckpt else None  # a run dir -> its latest step
        if ckpt:
            resume_from(ckpt, trainer, stream, logger)
            # the run continues in its own metrics.jsonl: rows past the checkpoint are redone
            keep_metrics_until(run_dir, trainer.step)
        start = {"ckpt": ckpt, "step": trainer.step, "position": stream.position}
    if ctx is None or ctx.world == 1:
        return start
    start = ctx.broadcast_object(start, src=src)
    if ctx.rank != src and start["ckpt"]:
        resume_from(start["ckpt"], trainer, stream, logger)
        if (trainer.step, stream.position) != (start["step"], start["position"]):
            raise ValueError(
                f"trainer rank {ctx.rank} resumed at step {trainer.step}, position "
                f"{stream.position}; trainer rank {src} at {start}"
            )
    return start


def write_run_config(cfg: RunConfig, run_dir: str) -> None:
    path = os.path.join(run_dir, "run_config.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2, default=str)
    os.replace(tmp, path)
