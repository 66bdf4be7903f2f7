"""Builders both runs (colocated and split) call: target, drafter, batches, the dataset of a
rank, resume and the run config file. Nothing here knows which run called it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys

import torch

from ..common.comm import RankContext
from ..common.layout import TARGET_DTYPE, read_run_config, run_dir_of
from ..config import TARGET_RESUMABLE, RunConfig
from ..data.batch import TargetBatch, collate, target_forward
from ..data.dataset import cache_name, dataset_path, load_or_build_dataset
from ..data.mix import data_figures
from ..drafter.checkpoint import load_drafter
from ..drafter.model import DFlashDrafter
from ..drafter.spec import resolve_spec
from ..drafter.variants import build_model
from ..target.capture import Target
from ..target.load import concrete_settings, load_target
from ..target.shape import TargetShape


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
    drafter = build_model(spec)  # drafter.variant's class
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
        # train.compile: packing fills a varying number of rows; padded to one count, one graph
        pad_rows=cfg.train.micro_batch_size if cfg.train.compile else None,
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


DATA_FILE = "data_file"  # run_config.json: the data cache file the run trains on


def own_data_file(cfg: RunConfig, run_dir: str) -> tuple[str, ...]:
    """A resumed run's data cache file name: run_config.json's `data_file`, or for a run recorded
    before that key, the name under the target kernels it started with. A resume may change the
    kernels (TARGET_RESUMABLE), which name the cache; the run then reads this file instead of
    regenerating its data (hours on a large target, and a text that differs at bf16 near-ties,
    which the stream's digest would refuse)."""
    from .resume import resume_path

    ck = resume_path(cfg, run_dir)
    if ck is None:
        return ()
    saved = read_run_config(run_dir_of(ck) or run_dir) or {}
    if saved.get(DATA_FILE):
        return (saved[DATA_FILE],)
    then = saved.get("target") or {}
    began = dataclasses.replace(cfg.target, **{k: then[k] for k in TARGET_RESUMABLE if k in then})
    return (cache_name(cfg.data, began),)


def data_record(cfg: RunConfig, run_dir: str, samples: list, own: tuple[str, ...]) -> dict:
    """What run_config.json records of the run's data beside its config: the data mix's shares
    (data.mix), the cache file read (own: `own_data_file`) and the target's dtype as resolved."""
    used = dataset_path(cfg.data, cfg.target, data_cache(cfg, run_dir), also=own)
    dtype = concrete_settings(cfg.target)["dtype"]  # what target.dtype=auto ran as (resume checks)
    return {**data_figures(samples, cfg), DATA_FILE: os.path.basename(used), TARGET_DTYPE: dtype}


def dataset_for_rank(
    cfg: RunConfig,
    target: Target,
    run_dir: str,
    log,
    ctx: RankContext | None = None,
    own: tuple[str, ...] = (),
) -> list:
    """Rank 0 loads or regenerates the data; the other ranks read rank 0's cache afterwards and
    check they got the same samples. own: a resumed run's own cache file (`own_data_file`)."""
    cache = data_cache(cfg, run_dir)
    if ctx is None or ctx.world == 1:
        return load_or_build_dataset(cfg.data, cfg.target, target, cache, log=log, also=own)
    if ctx.rank == 0:
        samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=log, also=own)
        ctx.broadcast_object(samples_digest(samples), src=0)
        return samples
    digest = ctx.broadcast_object(None, src=0)
    quiet = lambda *_: None  # noqa: E731
    samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=quiet, also=own)
    check_same_samples(samples, digest, ctx.rank)
    return samples
