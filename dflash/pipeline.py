"""The online pipeline: target-worker ranks stream packed target batches to drafter-trainer ranks
over torch.distributed point-to-point messages (NCCL on GPU, gloo on CPU). No side store.

One job (torchrun / accelerate launch), two layouts (topology.mode):
- colocated: every rank runs target + drafter on its device, data parallel over all ranks
  (runner.run_training, the single-process code with a rank context).
- split: ranks 0..NW-1 are target workers, ranks NW..NW+ND-1 drafter trainers (DP among
  themselves), NW = topology.num_target_ranks, any ratio.

Determinism (Schedule): step s has G = ND * grad_accum global micro-batches j = a*ND + d, the
layout colocated DP uses (trainer d, accumulation slot a). Micro-batch j of step s holds the
stream positions start_position + ((s - start_step)*G + j) * mb ..+mb, and worker g % NW
(g = s*G + j) produces it. Trainers consume in that order whatever the timing, so a split run
trains on exactly what a colocated run with ND ranks trains on, and a resumed run continues at
the checkpoint's stream position.

Wire format per micro-batch (dist.Outbox): a header (meta ints, dtypes, shapes), one int64
tensor with ids/positions/segments/loss mask/next tokens/sample ids/row seeds, the aux states
[N, T, K*H] in the target dtype, and the final hidden states only for the soft loss. The
header also carries the worker's cumulative counters, which the trainers turn into pipe/*.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import os
import queue
import re
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from .batch import TargetBatch
from .checkpoint import find_checkpoint
from .config import RunConfig, TopologyConfig
from .data import SampleStream, load_or_build_dataset
from .dist import (
    Outbox,
    PeerError,
    RankContext,
    die,
    init_distributed,
    launcher_env,
    new_group,
    recv_message,
    shutdown,
)
from .drafter import num_params
from .loggers import make_logger
from .runner import (
    BadBatchError,
    build_drafter,
    build_target,
    check_same_samples,
    make_batch,
    resume_from,
    resume_path,
    run_training,
    samples_digest,
    screen_batch,
    train_loop,
    write_run_config,
)
from .target import check_layer_ids, default_layer_ids, resolve_dtype, resolve_mask_token_id
from .trainer import DrafterTrainer, Heads

EXIT_PIPELINE = 3  # a peer died / hung, or on_bad_batch=stop
_ROOT_CAUSE: list = []  # first PeerError seen by a receiver thread of this process


# ----------------------------------------------------------------------------- entry point
def run_distributed(cfg: RunConfig, run_dir: str) -> None:
    """Entry point of every rank (train.py calls it under torchrun or for topology.mode=split).
    Any failure ends this process with a message naming the rank; peers notice (gloo at once,
    NCCL via the deadlines) and exit too, so the job never hangs silently."""
    rank, world, _ = launcher_env()
    roles = Roles.from_topology(cfg.topology, world)
    ctx = init_distributed(
        cfg.topology.backend, cfg.topology.timeout_s, cfg.topology.startup_timeout_s
    )
    tag = f"[rank {rank}{'' if roles is None else ' ' + roles.role(rank)}]"
    try:
        if roles is None:
            run_training(cfg, run_dir, ctx=ctx)
        else:
            run_split(cfg, run_dir, ctx, roles)
        try:
            ctx.barrier()
        except RuntimeError as e:
            raise PeerError(
                f"not every rank reached the end of the run: {_first_line(e)}"
            ) from None
    except (PeerError, BadBatchError) as e:
        die(f"{tag} pipeline stopped: {e}", EXIT_PIPELINE)
    except (ValueError, FileNotFoundError) as e:
        die(f"{tag} error: {e}", 2)
    except KeyboardInterrupt:
        die(f"{tag} interrupted", 130)
    except BaseException as e:  # noqa: BLE001 - any other failure must still end the process
        # A collective among trainers breaks when a peer trainer stopped for a dead worker; give
        # this rank's receiver a moment to see the same root cause and report that instead.
        deadline = time.monotonic() + (2.0 if roles is not None else 0.0)
        while not _ROOT_CAUSE and time.monotonic() < deadline:
            time.sleep(0.05)
        if _ROOT_CAUSE:
            die(f"{tag} pipeline stopped: {_ROOT_CAUSE[0]}", EXIT_PIPELINE)
        if isinstance(e, RuntimeError) and _PEER_LOST.search(str(e)):
            die(
                f"{tag} pipeline stopped: a peer rank exited during a collective (the first rank to stop "
                f"names the cause): {_first_line(e)}",
                EXIT_PIPELINE,
            )
        traceback.print_exc()
        die(f"{tag} failed: {type(e).__name__}: {e}", 1)
    shutdown()


_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|failed to pass monitoredBarrier"
)


def _first_line(e: BaseException) -> str:
    return (
        str(e).splitlines()[0].split(". This is typically")[0][:300] if str(e) else type(e).__name__
    )


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
        if topo.timeout_s <= 0:
            raise ValueError(f"topology.timeout_s must be > 0, got {topo.timeout_s}")
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
    trainer and accumulation slot (see the module docstring)."""

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


def run_split(cfg: RunConfig, run_dir: str, ctx: RankContext, roles: Roles) -> None:
    dp_group = new_group(roles.trainer_ranks)  # collective: every rank creates it
    if ctx.rank < roles.num_workers:
        run_worker(cfg, run_dir, ctx, roles)
    else:
        run_trainer(cfg, run_dir, ctx, roles, dp_group)


# ----------------------------------------------------------------------------- wire format
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
    ids, pos, seg, lm, nxt = ints[: 5 * N * T].view(5, N, T)
    tb = TargetBatch(
        ids,
        pos,
        seg,
        lm.bool(),
        ints[5 * N * T : 5 * N * T + S],
        ints[5 * N * T + S : 5 * N * T + S + N].tolist(),
        aux_NTF=tensors[1],
        next_token_NT=nxt,
        final_hidden_NTH=tensors[2] if head["flags"] & _FINAL_HIDDEN else None,
    )
    return tb, head


def _dump(kind: str, g: int, tb: TargetBatch, **extra) -> None:
    """DFLASH_PIPE_DUMP=DIR: every batch as sent / as received (tests compare them)."""
    root = os.environ.get("DFLASH_PIPE_DUMP")
    if not root:
        return
    os.makedirs(root, exist_ok=True)
    fields = {f.name: getattr(tb, f.name) for f in dataclasses.fields(tb)}
    fields = {
        k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()
    }
    torch.save({**fields, **extra, "g": g}, os.path.join(root, f"{kind}_{g:07d}.pt"))


@dataclass
class Fault:
    """Test hook: DFLASH_FAULT="kind@rank:step[,...]" makes worker `rank` die (SIGKILL), hang,
    or put NaN into one sample's aux states when it produces a micro-batch of `step`."""

    kind: str
    step: int

    @staticmethod
    def for_rank(rank: int) -> Fault | None:
        for item in filter(None, os.environ.get("DFLASH_FAULT", "").split(",")):
            kind, where = item.split("@")
            r, step = where.split(":")
            if int(r) == rank:
                return Fault(kind, int(step))
        return None

    def apply(self, tb: TargetBatch, step: int) -> TargetBatch:
        if step != self.step:
            return tb
        if self.kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "nan":
            aux = tb.aux_NTF.clone()
            aux[0, 1, 0] = float("nan")
            self.step = -1  # once
            return dataclasses.replace(tb, aux_NTF=aux)
        raise ValueError(f"DFLASH_FAULT kind {self.kind!r}: use die, hang or nan")


# ----------------------------------------------------------------------------- worker role
def _say(ctx: RankContext, role: str):
    def say(msg: str) -> None:
        print(f"[{role} rank {ctx.rank}] {msg}", flush=True)

    return say


def run_worker(cfg: RunConfig, run_dir: str, ctx: RankContext, roles: Roles) -> None:
    """Load the target, read this worker's share of the stream, send batches to the trainers."""
    say = _say(ctx, "worker")
    target = build_target(cfg, ctx.device)
    say(
        f"target {cfg.target.name}: {target.num_layers} layers, {target.dtype}, {target.device}, "
        f"linear-attn backend {target.backend}"
    )
    cache = cfg.data.cache_dir or os.path.join(run_dir, "data")
    info = None
    if ctx.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=say)
        if cfg.eval.enabled:  # trainers have no target: they read this cache
            from .evaluation import build_eval_set

            build_eval_set(cfg, target, cache, log=say)
        info = {
            "num_samples": len(samples),
            "digest": samples_digest(samples),
            "heads": heads_fingerprint(target.embed_tokens.weight, target.lm_head.weight),
        }
    info = ctx.broadcast_object(info, src=0)
    if ctx.rank != 0:
        samples = load_or_build_dataset(cfg.data, cfg.target, target, cache, log=lambda *_: None)
        check_same_samples(samples, info["digest"], ctx.rank)
    start = ctx.broadcast_object(None, src=roles.trainer_rank(0))
    sched = Schedule.from_config(cfg, roles, start["step"], start["position"])
    stats = produce(cfg, ctx, roles, sched, target, samples)
    wall = time.perf_counter() - stats.t0
    say(
        f"done: {stats.batches} micro-batches, {stats.tokens} tokens in {wall:.1f} s "
        f"({stats.tokens / max(wall, 1e-9):.0f} tokens/s produced; forward {stats.forward_s:.1f} s, "
        f"backpressure wait {stats.backpressure_s:.1f} s)"
    )


def produce(
    cfg: RunConfig, ctx: RankContext, roles: Roles, sched: Schedule, target, samples: list
) -> WorkerStats:
    topo = cfg.topology
    outboxes = [
        Outbox(
            roles.trainer_rank(d),
            f"trainer rank {roles.trainer_rank(d)}",
            topo.window,
            topo.timeout_s,
            ctx.backend,
            ctx.device,
        )
        for d in range(roles.num_trainers)
    ]
    stream = SampleStream(len(samples), cfg.data.seed)
    fault = Fault.for_rank(ctx.rank)
    stats = WorkerStats()
    for step, j in sched.worker_items(ctx.rank):
        g = sched.global_index(step, j)
        t0 = time.perf_counter()
        stream.position = sched.position(step, j)
        tb = make_batch(target, samples, stream.take(sched.micro_batch_size), cfg)
        if ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # honest forward time
        stats.forward_s += time.perf_counter() - t0
        if fault is not None:
            tb = fault.apply(tb, step)
        stats.tokens += tb.num_tokens
        stats.batches += 1
        d, _ = sched.trainer_of(j)
        meta, tensors = pack_batch(tb, g, step, j, stats.ints())
        stats.backpressure_s += outboxes[d].send(meta, tensors, f"micro-batch {g} (step {step})")
        stats.inflight_sum += len(outboxes[d].inflight)
        _dump("sent", g, tb, worker=ctx.rank, trainer=roles.trainer_rank(d), step=step, j=j)
    t0 = time.perf_counter()
    for ob in outboxes:
        ob.flush()
    stats.backpressure_s += time.perf_counter() - t0
    return stats


# ----------------------------------------------------------------------------- trainer heads
class HeadsOnlyTarget:
    """What a trainer rank needs of the target: its config, the aux layer ids, the mask token and
    the frozen input embedding + lm_head. It has no decoder layers and cannot run a forward."""

    backend = "none (trainer: embedding + lm_head only)"

    def __init__(
        self,
        config,
        embed: nn.Embedding,
        lm_head: nn.Linear,
        layer_ids,
        mask_token_id: int,
        tokenizer=None,
        how: str = "",
    ):
        self.model = SimpleNamespace(config=config)  # build_drafter reads model.config
        self.num_layers = int(config.num_hidden_layers)
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.hidden_size = int(config.hidden_size)
        self.embed_tokens, self.lm_head = embed, lm_head
        self.vocab_size = int(lm_head.weight.shape[0])
        self.mask_token_id, self.tokenizer, self.how = mask_token_id, tokenizer, how

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


_NOT_TEXT_HEADS = ("mtp", "visual", "vision", "audio")


def read_head_weights(path: str, tied: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[str, str]]:
    """The input embedding and lm_head from a HF safetensors checkpoint, reading only those two
    tensors. Names are matched by suffix (`...embed_tokens.weight`, `lm_head.weight`), skipping
    multi-token-prediction and vision towers; tied (or absent) lm_head = the embedding."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors files; trainer ranks read the target's "
            "embedding and lm_head from them"
        )
    where = {}
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            for k in f.keys():
                where[k] = fn

    def pick(suffix: str) -> str | None:
        cands = [
            k
            for k in where
            if k.endswith(suffix) and not any(p.startswith(_NOT_TEXT_HEADS) for p in k.split("."))
        ]
        return min(cands, key=lambda k: (len(k), k)) if cands else None

    def get(key: str) -> torch.Tensor:
        with safe_open(where[key], framework="pt") as f:
            return f.get_tensor(key)

    ek = pick("embed_tokens.weight")
    if ek is None:
        raise ValueError(f"{path}: no '*embed_tokens.weight' tensor in {len(where)} weights")
    lk = None if tied else pick("lm_head.weight")
    emb = get(ek)
    return emb, (get(lk) if lk else emb), (ek, lk or ek)


def load_heads_only(cfg: RunConfig, device: torch.device) -> HeadsOnlyTarget:
    """Trainer-side target: from target.path only config, tokenizer, embedding and lm_head are
    read. A random target (target.config) has no files, so it is built (same seed, same device
    type as the workers) and only its embedding and lm_head are kept; heads_fingerprint checks
    that they match the workers' either way."""
    mtid = (
        cfg.drafter.mask_token_id
        if cfg.drafter.mask_token_id is not None
        else cfg.target.mask_token_id
    )
    if cfg.target.config is not None:
        t = build_target(cfg, device)
        heads = HeadsOnlyTarget(
            t.model.config,
            t.embed_tokens,
            t.lm_head,
            t.layer_ids,
            t.mask_token_id,
            t.tokenizer,
            "built the random target from target.config, kept embedding + lm_head",
        )
        del t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return heads
    from transformers import AutoConfig, AutoTokenizer

    from .target import resolve_local_path

    path = resolve_local_path(cfg.target)
    full = AutoConfig.from_pretrained(path)
    text = full.get_text_config()
    tied = bool(getattr(text, "tie_word_embeddings", getattr(full, "tie_word_embeddings", False)))
    emb_w, lm_w, names = read_head_weights(path, tied)
    dtype = resolve_dtype(cfg.target.dtype, device)
    embed = nn.Embedding.from_pretrained(emb_w.to(device, dtype), freeze=True)
    lm_head = nn.Linear(lm_w.shape[1], lm_w.shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(lm_w.to(device, dtype), requires_grad=False)
    tok = AutoTokenizer.from_pretrained(path)
    n = int(text.num_hidden_layers)
    ids = cfg.drafter.target_layer_ids
    ids = list(ids) if ids is not None else default_layer_ids(n, cfg.drafter.num_aux_layers)
    return HeadsOnlyTarget(
        text,
        embed,
        lm_head,
        ids,
        resolve_mask_token_id(tok, lm_w.shape[0], mtid),
        tok,
        f"read {names[0]} + {names[1]} from {path}",
    )


def heads_fingerprint(embed_w: torch.Tensor, lm_w: torch.Tensor) -> list:
    out = []
    for w in (embed_w.detach(), lm_w.detach()):
        total = sum(
            float(w[i : i + 4096].sum(dtype=torch.float64)) for i in range(0, w.shape[0], 4096)
        )
        rows = torch.tensor([0, w.shape[0] // 2, w.shape[0] - 1], device=w.device)
        out.append(
            (tuple(w.shape), str(w.dtype), total, w[rows, :8].double().cpu().flatten().tolist())
        )
    return out


def check_heads(mine: list, theirs: list) -> None:
    for name, a, b in zip(("embedding", "lm_head"), mine, theirs):
        same = (
            a[0] == b[0]
            and a[1] == b[1]
            and a[3] == b[3]
            and abs(a[2] - b[2]) <= 1e-6 * max(1.0, abs(b[2]))
        )
        if not same:
            raise ValueError(
                f"the trainer's target {name} differs from the workers' ({a[:3]} vs {b[:3]}): "
                "trainers and workers must load the same target (same target.* config, "
                "same device type for random targets)"
            )


# ----------------------------------------------------------------------------- trainer role
def run_trainer(cfg: RunConfig, run_dir: str, ctx: RankContext, roles: Roles, dp_group) -> None:
    d = ctx.rank - roles.num_workers
    writer = d == 0
    torch.manual_seed(cfg.train.seed)
    target = load_heads_only(cfg, ctx.device)  # while worker 0 loads the target and the data
    info = ctx.broadcast_object(None, src=0)  # worker 0 has the data (and the eval cache) ready
    check_heads(heads_fingerprint(target.embed_tokens.weight, target.lm_head.weight), info["heads"])
    drafter = build_drafter(cfg, target)
    os.makedirs(run_dir, exist_ok=True)
    logger = make_logger(
        cfg.logger, run_dir, os.path.basename(run_dir), dataclasses.asdict(cfg), rank0=writer
    )
    logger.info(f"run dir: {run_dir}")
    logger.info(
        f"topology: split, {roles.num_workers} target worker(s) (ranks 0..{roles.num_workers - 1}) -> "
        f"{roles.num_trainers} trainer(s) (ranks {roles.num_workers}..{ctx.world - 1}), window "
        f"{cfg.topology.window}, backend {ctx.backend}, timeout {cfg.topology.timeout_s:g} s"
    )
    logger.info(f"trainer heads: {target.how}")
    logger.info(
        f"drafter: {num_params(drafter) / 1e6:.2f}M params, {drafter.spec.num_hidden_layers} layers "
        f"{drafter.spec.layer_types}, block {drafter.spec.block_size}, aux layers "
        f"{drafter.spec.target_layer_ids}, mask token {drafter.spec.mask_token_id}, loss {cfg.train.loss}"
    )
    evaluator = None
    if writer and cfg.eval.enabled:
        from .evaluation import Evaluator

        evaluator = Evaluator.from_config(
            cfg, target, cfg.data.cache_dir or os.path.join(run_dir, "data"), log=logger.info
        )
    trainer = DrafterTrainer(
        drafter,
        Heads(target.embed_tokens, target.lm_head),
        cfg.train,
        ctx.device,
        dp_group=dp_group,
    )
    stream = SampleStream(info["num_samples"], cfg.data.seed)
    start = resume_trainer(cfg, run_dir, ctx, roles, trainer, stream, logger)
    if writer:
        write_run_config(cfg, run_dir)
    sched = Schedule.from_config(cfg, roles, start["step"], start["position"])
    source = StreamedBatchSource(cfg, ctx, roles, sched, d, stream, dp_group)
    source.start()
    train_loop(cfg, trainer, source, evaluator, logger, run_dir, writer=writer)
    source.join()


def resume_trainer(
    cfg: RunConfig,
    run_dir: str,
    ctx: RankContext,
    roles: Roles,
    trainer: DrafterTrainer,
    stream: SampleStream,
    logger,
) -> dict:
    """Trainer 0 resolves and loads the checkpoint, then announces (path, step, stream position)
    to every rank: the other trainers load the same one, the workers start producing at exactly
    that position."""
    t0 = roles.trainer_rank(0)
    start = None
    if ctx.rank == t0:
        ckpt = resume_path(cfg, run_dir)
        ckpt = find_checkpoint(ckpt) if ckpt else None
        if ckpt:
            resume_from(ckpt, trainer, stream, logger)
        start = {"ckpt": ckpt, "step": trainer.step, "position": stream.position}
    start = ctx.broadcast_object(start, src=t0)
    if ctx.rank != t0 and start["ckpt"]:
        resume_from(start["ckpt"], trainer, stream, logger)
        if (trainer.step, stream.position) != (start["step"], start["position"]):
            raise ValueError(
                f"trainer rank {ctx.rank} resumed at step {trainer.step}, position "
                f"{stream.position}; trainer 0 at {start}"
            )
    return start


class StreamedBatchSource:
    """Trainer side of the pipeline: a receiver thread takes this trainer's micro-batches in
    schedule order (whatever order they are produced in) into a queue of `topology.window`
    batches; next_batches() hands grad_accum of them to train_step. Also the pipe/* metrics."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: RankContext,
        roles: Roles,
        sched: Schedule,
        d: int,
        stream: SampleStream,
        dp_group,
    ):
        self.cfg, self.ctx, self.roles, self.sched, self.d = cfg, ctx, roles, sched, d
        self.stream, self.dp_group = stream, dp_group
        self.q: queue.Queue = queue.Queue(maxsize=max(1, cfg.topology.window))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._receive_all, name="dflash-recv", daemon=True)
        self.bad_total = 0
        self.workers_prev = torch.zeros(
            roles.num_workers, len(WorkerStats.FIELDS), dtype=torch.float64
        )
        self.workers_now = self.workers_prev.clone()
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.t_last = time.perf_counter()
        self.wait_s = self.tokens = self.samples = self.depth_sum = self.depth_n = self.steps = 0.0

    # ---------------------------------------------------------------- receiver thread
    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join(timeout=self.cfg.topology.timeout_s)

    def _receive_all(self) -> None:
        ctx, topo = self.ctx, self.cfg.topology
        w = None
        try:
            side = None
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)  # the current device is per thread
                side = torch.cuda.Stream(ctx.device)
            with torch.cuda.stream(side) if side is not None else nullcontext():
                for step, j in self.sched.trainer_items(self.d):
                    g, w = self.sched.global_index(step, j), self.sched.worker_of(step, j)
                    meta, tensors = recv_message(
                        w,
                        f"worker rank {w}",
                        ctx.device,
                        ctx.backend,
                        topo.timeout_s,
                        f"micro-batch {g} (step {step})",
                    )
                    if side is not None:
                        side.synchronize()
                    tb, head = unpack_batch(meta, tensors)
                    if head["g"] != g:
                        raise PeerError(
                            f"worker rank {w} sent micro-batch {head['g']} where {g} was due: "
                            "do all ranks run the same config?"
                        )
                    _dump("recv", g, tb, worker=w, trainer=ctx.rank, step=step, j=j)
                    self.q.put((g, w, tb, head, tensors))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread, or below
            peer = (
                f" from worker rank {w}" if w is not None else ""
            )  # irecv itself can raise when the peer is gone
            self.error = (
                e if isinstance(e, PeerError) else PeerError(f"receiving{peer} failed: {e!r}")
            )
            _ROOT_CAUSE.append(self.error)
            # The main thread raises it at its next next_batches(); if it is blocked elsewhere
            # (a collective with another trainer), end the process from here.
            time.sleep(min(5.0, topo.timeout_s))
            die(f"[rank {ctx.rank} trainer] pipeline stopped: {self.error}", EXIT_PIPELINE)

    def _get(self):
        while True:
            if self.error is not None:
                raise self.error
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                continue

    # ---------------------------------------------------------------- main thread
    def next_batches(self) -> list[TargetBatch]:
        t0 = time.perf_counter()
        out = []
        for _ in range(self.cfg.train.grad_accum):
            self.depth_sum += self.q.qsize()
            self.depth_n += 1
            g, w, tb, head, raw = self._get()
            if self.ctx.device.type == "cuda":
                for t in raw:  # allocated on the receiver's stream, used on this one
                    t.record_stream(torch.cuda.current_stream())
            self.workers_now[w] = torch.maximum(
                self.workers_now[w], torch.tensor(head["stats"], dtype=torch.float64)
            )
            tb, bad = screen_batch(
                tb, self.cfg.topology.on_bad_batch, origin=f"micro-batch {g} from worker rank {w}"
            )
            self.bad_total += len(bad)
            self.tokens += tb.num_tokens
            self.samples += int(tb.sample_ids.numel())
            out.append(tb)
        self.wait_s += time.perf_counter() - t0
        self.steps += 1
        self.stream.position += self.sched.per_step * self.sched.micro_batch_size
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def metrics(self) -> dict:
        """pipe/* over the interval since the last call; a collective over the trainers."""
        dev = self.ctx.device
        local = torch.tensor(
            [
                time.perf_counter() - self.t_last,
                self.wait_s,
                self.tokens,
                self.samples,
                self.depth_sum,
                self.depth_n,
                self.steps,
                self.bad_total,
            ],
            dtype=torch.float64,
            device=dev,
        )
        workers = self.workers_now.to(dev)
        if self.roles.num_trainers > 1:
            dist.all_reduce(local, group=self.dp_group)
            dist.all_reduce(workers, op=dist.ReduceOp.MAX, group=self.dp_group)
        local, workers = local.cpu().tolist(), workers.cpu()
        out = pipe_metrics(local, workers - self.workers_prev, self.roles.num_trainers)
        self.workers_now = workers.clone()
        self.workers_prev = workers
        self._reset_interval()
        return out


def pipe_metrics(trainers: list, workers_delta: torch.Tensor, num_trainers: int) -> dict:
    """trainers: summed [wall, wait, tokens, samples, depth_sum, depth_n, steps(x D), bad];
    workers_delta: per-worker increments of WorkerStats.FIELDS over the interval."""
    wall, wait, tokens, samples, depth_sum, depth_n, steps, bad = trainers
    D = num_trainers
    mean_wall, steps = max(wall / D, 1e-9), max(steps / D, 1.0)
    busy = max(mean_wall - wait / D, 1e-9)
    out = {
        "pipe/trainer_tokens_per_s": tokens / mean_wall,
        "pipe/samples_per_s": samples / mean_wall,
        "pipe/trainer_wait_s": wait / D / steps,
        "pipe/trainer_wait_frac": wait / max(wall, 1e-9),
        "pipe/queue_depth": depth_sum / max(depth_n, 1.0),
        "pipe/trainer_capacity_tokens_per_s": tokens / D / busy,
        "pipe/bad_samples": bad,
    }
    tok, batches, fwd, bp, elapsed, inflight = (
        workers_delta[:, i] for i in range(len(WorkerStats.FIELDS))
    )
    seen = elapsed > 0
    if bool(seen.any()):
        el, fwd_s, bp_s = elapsed[seen] / 1e6, fwd[seen] / 1e6, bp[seen] / 1e6
        out.update(
            {
                "pipe/worker_tokens_per_s": float((tok[seen] / el).sum()),
                "pipe/worker_busy_frac": float((fwd_s / el).mean()),
                "pipe/worker_backpressure_frac": float((bp_s / el).mean()),
                "pipe/worker_backpressure_s": float(bp_s.mean()) / steps,
                "pipe/worker_inflight": float(
                    inflight[seen].sum() / batches[seen].sum().clamp(min=1)
                ),
                "pipe/worker_capacity_tokens_per_s": float(
                    (tok[seen] / fwd_s.clamp(min=1e-9)).mean()
                ),
            }
        )
        out["pipe/suggested_workers_per_trainer"] = out["pipe/trainer_capacity_tokens_per_s"] / max(
            out["pipe/worker_capacity_tokens_per_s"], 1e-9
        )
    return out
