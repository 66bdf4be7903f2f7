"""The training run: build components from the typed config, resume, then
loop { step; maybe log; maybe eval; maybe save }."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import torch
from tqdm.auto import tqdm

from .batch import collate, target_forward
from .checkpoint import latest_run_checkpoint, load_checkpoint, load_drafter, save_checkpoint
from .config import RunConfig
from .data import SampleStream, load_or_build_dataset
from .drafter import DFlashDrafter, num_params
from .loggers import Logger, make_logger
from .target import Target, linear_attn_report, load_target
from .trainer import DrafterTrainer, Heads, resolve_spec


def build_target(cfg: RunConfig) -> Target:
    return load_target(cfg.target, cfg.drafter.target_layer_ids, cfg.drafter.num_aux_layers,
                       cfg.drafter.mask_token_id)


def build_drafter(cfg: RunConfig, target: Target) -> DFlashDrafter:
    mc = target.model.config
    spec = resolve_spec(cfg.drafter, target.num_layers, target.hidden_size, target.vocab_size,
                        int(getattr(mc, "intermediate_size", 4 * target.hidden_size)),
                        int(getattr(mc, "num_attention_heads", 8)),
                        int(getattr(mc, "num_key_value_heads", 0) or 0), target.mask_token_id)
    if spec.target_layer_ids != target.layer_ids:
        raise AssertionError("target and drafter disagree on aux layers")
    if cfg.drafter.init_from:
        drafter, _ = load_drafter(cfg.drafter.init_from)
        if drafter.spec.as_dict() != spec.as_dict():
            raise ValueError(f"drafter.init_from={cfg.drafter.init_from}: its config differs from drafter.*")
        return drafter
    drafter = DFlashDrafter(spec)
    drafter.init_weights(cfg.drafter.init_std, torch.Generator().manual_seed(cfg.train.seed))
    return drafter


class LocalBatchSource:
    """Colocated mode: this process runs the target on its share of the sample stream."""

    def __init__(self, target: Target, samples: list, cfg: RunConfig, dp_rank: int = 0, dp_world: int = 1):
        self.target, self.samples, self.cfg = target, samples, cfg
        self.stream = SampleStream(len(samples), cfg.data.seed)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.pad_id = target.mask_token_id

    def next_batches(self) -> list:
        mb, out = self.cfg.train.micro_batch_size, []
        for _ in range(self.cfg.train.grad_accum):
            idx = self.stream.take(mb * self.dp_world)[self.dp_rank * mb:(self.dp_rank + 1) * mb]
            batch = collate([self.samples[i] for i in idx], pad_id=self.pad_id).to(self.target.device)
            out.append(target_forward(self.target, batch, with_final_hidden=self.cfg.train.loss == "soft_kl"))
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])


def resume_path(cfg: RunConfig, run_dir: str) -> Optional[str]:
    r = cfg.resume
    if r is None or str(r).lower() in ("false", "none", "null", ""):
        return None
    if str(r).lower() == "true":
        return latest_run_checkpoint(cfg.out_root, cfg.exp_name, exclude=run_dir)
    return str(r)


def run_training(cfg: RunConfig, run_dir: str, logger: Optional[Logger] = None,
                 stop_at: Optional[int] = None) -> dict:
    """stop_at: end after that step as if interrupted (tests of resume)."""
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    target = build_target(cfg)
    drafter = build_drafter(cfg, target)
    logger = logger or make_logger(cfg.logger, run_dir, os.path.basename(run_dir), dataclasses.asdict(cfg))
    logger.info(f"run dir: {run_dir}")
    logger.info(f"target: {cfg.target.name} | {target.num_layers} layers, H={target.hidden_size}, "
                f"V={target.vocab_size}, {target.dtype}, {target.device}, linear-attn backend: {target.backend}")
    gdn = linear_attn_report()
    if gdn:
        logger.info(f"target: Gated-DeltaNet ops -> {gdn}")
    logger.info(f"drafter: {num_params(drafter) / 1e6:.2f}M params, {drafter.spec.num_hidden_layers} layers "
                f"{drafter.spec.layer_types}, block {drafter.spec.block_size}, aux layers "
                f"{drafter.spec.target_layer_ids}, mask token {drafter.spec.mask_token_id}, loss {cfg.train.loss}")
    samples = load_or_build_dataset(cfg.data, cfg.target, target, cfg.data.cache_dir or os.path.join(run_dir, "data"),
                                    log=logger.info)
    evaluator = None
    if cfg.eval.enabled:
        from .evaluation import Evaluator
        evaluator = Evaluator.from_config(cfg, target, cache_dir=cfg.data.cache_dir or os.path.join(run_dir, "data"),
                                          log=logger.info)
    trainer = DrafterTrainer(drafter, Heads(target.embed_tokens, target.lm_head), cfg.train, target.device)
    source = LocalBatchSource(target, samples, cfg)
    ckpt = resume_path(cfg, run_dir)
    if ckpt:
        state = load_checkpoint(ckpt, drafter)
        trainer.load_state_dict(state["trainer"])
        source.load_state_dict(state["source"])
        logger.info(f"resumed from {state['path']} at step {trainer.step} "
                    f"(sample position {source.stream.position})")
    with open(os.path.join(run_dir, "run_config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2, default=str)
    return train_loop(cfg, trainer, source, evaluator, logger, run_dir, stop_at)


def train_loop(cfg: RunConfig, trainer: DrafterTrainer, source, evaluator, logger: Logger, run_dir: str,
               stop_at: Optional[int] = None) -> dict:
    tc = cfg.train
    last: dict = {}
    first_eval = None
    if evaluator is not None and trainer.step == 0:
        first_eval = evaluator.run(trainer.drafter, trainer.heads)
        logger.log(first_eval, step=0)
    bar = tqdm(total=tc.steps, initial=trainer.step, desc="train", unit="step", dynamic_ncols=True,
               disable=os.environ.get("DFLASH_NO_PROGRESS") == "1")
    while trainer.step < tc.steps:
        t0 = time.perf_counter()
        batches = source.next_batches()
        t1 = time.perf_counter()
        metrics = trainer.train_step(batches)
        t2 = time.perf_counter()
        step = trainer.step
        metrics.update({"perf/target_s": t1 - t0, "perf/drafter_s": t2 - t1,
                        "perf/tokens_per_s": metrics["train/tokens"] / max(t2 - t0, 1e-9),
                        "data/epoch": source.stream.epoch if hasattr(source, "stream") else 0.0})
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/acc']:.3f}")
        if step % tc.log_every == 0 or step == tc.steps:
            logger.log(metrics, step)
        last.update(metrics)
        if evaluator is not None and (step % tc.eval_every == 0 or step == tc.steps):
            ev = evaluator.run(trainer.drafter, trainer.heads)
            logger.log(ev, step)
            last.update(ev)
        if step % tc.save_every == 0 or step == tc.steps:
            path = save_checkpoint(run_dir, step, trainer.drafter, trainer.state_dict(), tc.keep_last,
                                   extra={"source": source.state_dict()})
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
