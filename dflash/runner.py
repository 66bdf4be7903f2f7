"""The training run: build components from the typed config, resume, then
loop { step; maybe log; maybe eval; maybe save }."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

import torch
from tqdm.auto import tqdm

from .batch import TargetBatch, collate, target_forward
from .checkpoint import latest_run_checkpoint, load_checkpoint, load_drafter, save_checkpoint
from .config import RunConfig
from .data import SampleStream, load_or_build_dataset
from .drafter import DFlashDrafter, num_params
from .loggers import Logger, make_logger
from .target import Target, linear_attn_report, load_target
from .trainer import DrafterTrainer, Heads, resolve_spec


def build_target(cfg: RunConfig, device: torch.device | None = None) -> Target:
    """`device` (multi-process runs: this rank's device) overrides target.device for loading only;
    cfg itself is unchanged, so cache keys derived from it agree across ranks."""
    tcfg = cfg.target if device is None else dataclasses.replace(cfg.target, device=str(device))
    return load_target(
        tcfg, cfg.drafter.target_layer_ids, cfg.drafter.num_aux_layers, cfg.drafter.mask_token_id
    )


def build_drafter(cfg: RunConfig, target: Target) -> DFlashDrafter:
    mc = target.model.config
    spec = resolve_spec(
        cfg.drafter,
        target.num_layers,
        target.hidden_size,
        target.vocab_size,
        int(getattr(mc, "intermediate_size", 4 * target.hidden_size)),
        int(getattr(mc, "num_attention_heads", 8)),
        int(getattr(mc, "num_key_value_heads", 0) or 0),
        target.mask_token_id,
    )
    if spec.target_layer_ids != target.layer_ids:
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
    batch = collate(
        [samples[i] for i in idx], pad_id=target.mask_token_id, pack_to=cfg.data.pack_to
    ).to(target.device)
    return target_forward(target, batch, with_final_hidden=cfg.train.loss == "soft_kl")


class BadBatchError(ValueError):
    pass


def screen_batch(tb: TargetBatch, on_bad: str, origin: str = "") -> tuple[TargetBatch, list[int]]:
    """Non-finite aux (or final hidden) states: report the sample ids, then either stop
    (BadBatchError) or skip those samples. Skipping zeroes their aux states and loss mask
    instead of dropping rows, so every rank still runs the same forward/backward (DDP) and the
    other samples of the batch train unchanged (segments never attend to each other)."""
    bad_NT = ~torch.isfinite(tb.aux_NTF).all(-1)
    if tb.final_hidden_NTH is not None:
        bad_NT |= ~torch.isfinite(tb.final_hidden_NTH).all(-1)
    bad_NT &= tb.segment_ids_NT >= 0
    if not bool(bad_NT.any()):
        return tb, []
    segs = tb.segment_ids_NT[bad_NT].unique()
    ids = [int(i) for i in tb.sample_ids.to(segs.device)[segs].tolist()]
    where = f" ({origin})" if origin else ""
    if on_bad == "stop":
        raise BadBatchError(
            f"non-finite target aux states in samples {ids}{where}; "
            "topology.on_bad_batch=stop (set it to skip to train on without them)"
        )
    drop_NT = torch.isin(tb.segment_ids_NT, segs)
    aux = tb.aux_NTF.masked_fill(drop_NT[..., None], 0)
    fh = tb.final_hidden_NTH
    if fh is not None:
        fh = fh.masked_fill(drop_NT[..., None], 0)
    print(
        f"warning: skipped samples {ids}{where}: non-finite target aux states "
        "(topology.on_bad_batch=skip)",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(
        tb, aux_NTF=aux, final_hidden_NTH=fh, loss_mask_NT=tb.loss_mask_NT & ~drop_NT
    ), ids


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


class LocalBatchSource:
    """Colocated mode: this process runs the target on its share of the sample stream."""

    def __init__(
        self, target: Target, samples: list, cfg: RunConfig, dp_rank: int = 0, dp_world: int = 1
    ):
        self.target, self.samples, self.cfg = target, samples, cfg
        self.stream = SampleStream(len(samples), cfg.data.seed)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.bad_samples: list[int] = []

    def next_batches(self) -> list:
        mb, out = self.cfg.train.micro_batch_size, []
        for _ in range(self.cfg.train.grad_accum):
            idx = self.stream.take(mb * self.dp_world)[self.dp_rank * mb : (self.dp_rank + 1) * mb]
            tb, bad = screen_batch(
                make_batch(self.target, self.samples, idx, self.cfg), self.cfg.topology.on_bad_batch
            )
            self.bad_samples += bad
            out.append(tb)
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}


def resume_path(cfg: RunConfig, run_dir: str) -> str | None:
    r = cfg.resume
    if r is None or str(r).lower() in ("false", "none", "null", ""):
        return None
    if str(r).lower() == "true":
        return latest_run_checkpoint(cfg.out_root, cfg.exp_name, exclude=run_dir)
    return str(r)


def dataset_for_rank(cfg: RunConfig, target: Target, run_dir: str, log, ctx=None) -> list:
    """Rank 0 loads or regenerates the data; the other ranks read rank 0's cache afterwards and
    check they got the same samples."""
    cache = cfg.data.cache_dir or os.path.join(run_dir, "data")
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


def run_training(
    cfg: RunConfig, run_dir: str, logger: Logger | None = None, stop_at: int | None = None, ctx=None
) -> dict:
    """Colocated training. stop_at: end after that step as if interrupted (tests of resume).
    ctx (a dflash.dist.RankContext) makes it data-parallel over all ranks of a torch.distributed
    job: each rank runs target + drafter on its device and its slice of every micro-batch; rank 0
    writes metrics, evaluations and checkpoints."""
    writer = ctx is None or ctx.rank == 0
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    target = build_target(cfg, ctx.device if ctx is not None else None)
    drafter = build_drafter(cfg, target)
    logger = logger or make_logger(
        cfg.logger, run_dir, os.path.basename(run_dir), dataclasses.asdict(cfg), rank0=writer
    )
    if ctx is not None:
        logger.info(
            f"topology: colocated, {ctx.world} ranks (data parallel), backend {ctx.backend}"
        )
    logger.info(f"run dir: {run_dir}")
    logger.info(
        f"target: {cfg.target.name} | {target.num_layers} layers, H={target.hidden_size}, "
        f"V={target.vocab_size}, {target.dtype}, {target.device}, linear-attn backend: {target.backend}"
    )
    gdn = linear_attn_report()
    if gdn:
        logger.info(f"target: Gated-DeltaNet ops -> {gdn}")
    logger.info(
        f"drafter: {num_params(drafter) / 1e6:.2f}M params, {drafter.spec.num_hidden_layers} layers "
        f"{drafter.spec.layer_types}, block {drafter.spec.block_size}, aux layers "
        f"{drafter.spec.target_layer_ids}, mask token {drafter.spec.mask_token_id}, loss {cfg.train.loss}"
    )
    samples = dataset_for_rank(cfg, target, run_dir, logger.info, ctx)
    evaluator = None
    if cfg.eval.enabled and writer:
        from .evaluation import Evaluator

        evaluator = Evaluator.from_config(
            cfg,
            target,
            cache_dir=cfg.data.cache_dir or os.path.join(run_dir, "data"),
            log=logger.info,
        )
    multi = ctx is not None and ctx.world > 1
    trainer = DrafterTrainer(
        drafter,
        Heads(target.embed_tokens, target.lm_head),
        cfg.train,
        target.device,
        dp_group=ctx.world_group if multi else None,
    )
    source = LocalBatchSource(
        target, samples, cfg, ctx.rank if multi else 0, ctx.world if multi else 1
    )
    ckpt = resume_path(cfg, run_dir)
    if multi:
        ckpt = ctx.broadcast_object(ckpt, src=0)  # resume=true must pick the same one everywhere
    if ckpt:
        resume_from(ckpt, trainer, source.stream, logger)
    if writer:
        write_run_config(cfg, run_dir)
    return train_loop(cfg, trainer, source, evaluator, logger, run_dir, stop_at, writer=writer)


def resume_from(ckpt: str, trainer: DrafterTrainer, stream: SampleStream, logger) -> None:
    """Weights (fp32 master), optimizer, scheduler, step, RNG and the stream position."""
    state = load_checkpoint(ckpt, trainer.drafter)
    trainer.load_state_dict(state["trainer"])
    stream.load_state_dict(state["source"]["stream"])
    logger.info(
        f"resumed from {state['path']} at step {trainer.step} (sample position {stream.position})"
    )


def write_run_config(cfg: RunConfig, run_dir: str) -> None:
    path = os.path.join(run_dir, "run_config.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2, default=str)
    os.replace(tmp, path)


def train_loop(
    cfg: RunConfig,
    trainer: DrafterTrainer,
    source,
    evaluator,
    logger: Logger,
    run_dir: str,
    stop_at: int | None = None,
    writer: bool = True,
) -> dict:
    """`source.next_batches()` gives this rank's micro-batches of the next step; a source with
    `metrics()` (the split pipeline) adds its pipe/* figures at log steps (a collective over the
    trainers, so every trainer calls it at the same steps). Only the writer rank saves."""
    tc = cfg.train
    last: dict = {}
    first_eval = None
    if evaluator is not None and trainer.step == 0:
        first_eval = evaluator.run(trainer.drafter, trainer.heads)
        logger.log(first_eval, step=0)
    bar = tqdm(
        total=tc.steps,
        initial=trainer.step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=os.environ.get("DFLASH_NO_PROGRESS") == "1" or not writer,
    )
    while trainer.step < tc.steps:
        t0 = time.perf_counter()
        batches = source.next_batches()
        t1 = time.perf_counter()
        metrics = trainer.train_step(batches)
        t2 = time.perf_counter()
        step = trainer.step
        metrics.update(
            {
                "perf/target_s": t1 - t0,
                "perf/drafter_s": t2 - t1,
                "perf/tokens_per_s": metrics["train/tokens"] / max(t2 - t0, 1e-9),
                "data/epoch": source.stream.epoch if hasattr(source, "stream") else 0.0,
            }
        )
        if not hasattr(source, "metrics"):
            # colocated: target vs drafter time per step = target GPUs per drafter GPU in split mode
            metrics["pipe/suggested_workers_per_trainer"] = (t1 - t0) / max(t2 - t1, 1e-9)
            metrics["pipe/bad_samples"] = float(len(getattr(source, "bad_samples", [])))
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/acc']:.3f}")
        if step % tc.log_every == 0 or step == tc.steps:
            if hasattr(source, "metrics"):
                metrics.update(source.metrics())
            logger.log(metrics, step)
        last.update(metrics)
        if evaluator is not None and (step % tc.eval_every == 0 or step == tc.steps):
            ev = evaluator.run(trainer.drafter, trainer.heads)
            logger.log(ev, step)
            last.update(ev)
        if writer and (step % tc.save_every == 0 or step == tc.steps):
            path = save_checkpoint(
                run_dir,
                step,
                trainer.drafter,
                trainer.state_dict(),
                tc.keep_last,
                extra={"source": source.state_dict()},
            )
            last["checkpoint"] = path
        if stop_at is not None and step >= stop_at:
            break
    bar.close()
    if first_eval is not None:
        last["eval0/streak"] = first_eval.get("eval/streak")
        last["eval0/tau"] = first_eval.get("eval/tau")
    logger.summary({k: v for k, v in last.items() if isinstance(v, (int, float))})
    if "checkpoint" in last:
        logger.info(f"checkpoint: {last['checkpoint']}")
    if "eval/tau" in last:
        msg = f"eval: streak {last['eval/streak']:.3f}  tau {last['eval/tau']:.3f}"
        if first_eval is not None:
            msg += f"  (at step 0: streak {first_eval['eval/streak']:.3f}, tau {first_eval['eval/tau']:.3f})"
        logger.info(msg)
    logger.close()
    return last
