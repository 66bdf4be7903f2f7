"""Test and benchmark instruments. Production modules never import this one.

- `OracleDrafter`: a drafter pushed towards known tokens (decoding and evaluation tests,
  decoding benchmarks).
- `CropRollback`: transformers' naive cache rollback, kept to show it is wrong on hybrid
  targets (`dflash.decoding.chain.ExactRollback` is the real one).
- `rank_env`: the torchrun environment of a process mp.spawn started as one rank.
- `launch_local` / `wait_all`: start N ranks with the environment torchrun gives them, and
  collect their exit codes (tests need to watch each process; torchrun would tear the job down).
- `InstrumentTap` + `python -m dflash.tools.testing train.py ARGS`: train.py with the split stream
  instrumented from the environment: DFLASH_PIPE_DUMP=DIR saves every micro-batch as sent and
  as received; DFLASH_FAULT="kind@rank:step[,...]" makes a worker die, hang, stop or send NaN, or
  a trainer die, hang or stop.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..data.batch import TargetBatch
from ..target.cache import is_hybrid_cache
from ..train.split import wire


# ----------------------------------------------------------------------------- decoding
class OracleDrafter(torch.nn.Module):
    """A test/benchmark instrument, not a drafter: a real `DFlashDrafter` (its context, masks
    and K/V path run unchanged) whose output hidden state is pushed towards known tokens.

    `truth[p]` is the token at absolute position p (prompt + the target's greedy completion).
    For the block anchored at position p, drafted position k (1..B-1) is labelled by a
    deterministic hash of (p, k, seed):
      hit     the truth token becomes the clear argmax (+`strength` logits),
      second  a decoy token (truth+1) becomes the argmax and the truth the runner-up
              (chain misses, a DDTree with a branch there can still accept),
      miss    untouched: the base drafter's own (context-dependent) argmax.
    pattern "mixed": a leading streak s(p) of hits, s = clamp(u - 2, 0, D) with u uniform over
    0..D+4 (zero, partial and full-block acceptances), then a mix; "full": every position a hit; "none":
    the base drafter unchanged. Positions past the end of `truth` are untouched.
    Exposes the `DFlashDrafter` interface used by decoding and evaluation (spec, context,
    context_kv, forward, the drafting rule), so offline evaluation and real decoding see the same drafter.
    """

    HIT, SECOND, MISS = 0, 1, 2

    def __init__(
        self,
        base,
        lm_head_weight: torch.Tensor,
        truth: Sequence[int] = (),
        pattern: str = "mixed",
        seed: int = 0,
        strength: float = 10.0,
    ):
        super().__init__()
        if pattern not in ("mixed", "full", "none"):
            raise ValueError(f"pattern={pattern!r}")
        self.base, self.spec = base, base.spec
        self.pattern, self.seed, self.strength = pattern, int(seed), float(strength)
        W = lm_head_weight.detach()
        self.register_buffer(
            "dirs", W / W.pow(2).sum(-1, keepdim=True), persistent=False
        )  # dirs[t].W[t] = 1
        self.truth = list(truth)

    def _h(self, p: int, k: int) -> int:
        x = (p * 0x9E3779B1 + k * 0x85EBCA77 + self.seed * 0xC2B2AE3D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        return x ^ (x >> 12)

    def label(self, p: int, k: int) -> int:
        if self.pattern == "full":
            return self.HIT
        if self.pattern == "none":
            return self.MISS
        D = self.spec.block_size - 1
        s = min(max(self._h(p, 0) % (D + 5) - 2, 0), D)  # P(0) = P(D) = 3/(D+5)
        if k <= s:
            return self.HIT
        if k == s + 1:
            return self.SECOND if self._h(p, 1) % 2 == 0 else self.MISS
        return self._h(p, k) % 3

    def context(self, aux):
        return self.base.context(aux)

    def logits(self, h, lm_head_w, lm_head_b=None):
        return self.base.logits(h, lm_head_w, lm_head_b)

    def propose(self, *args, **kw):
        return self.base.propose(*args, **kw)

    def proposal(self, *args, **kw):
        return self.base.proposal(*args, **kw)

    def tree_scores(self, *args, **kw):
        return self.base.tree_scores(*args, **kw)

    @property
    def tree_temperature(self) -> float:
        return self.base.tree_temperature

    def tree_logprobs(self, *args, **kw):
        return self.base.tree_logprobs(*args, **kw)

    def context_kv(self, ctx, pos):
        return self.base.context_kv(ctx, pos)

    def forward(
        self, block_emb_NQH, block_pos_NQ, masks, aux_NTF=None, ctx_pos_NT=None, ctx_kv=None
    ):
        h = self.base(
            block_emb_NQH,
            block_pos_NQ,
            masks,
            aux_NTF=aux_NTF,
            ctx_pos_NT=ctx_pos_NT,
            ctx_kv=ctx_kv,
        )
        if self.pattern == "none" or not self.truth:
            return h
        B, V = self.spec.block_size, self.dirs.shape[0]
        add = torch.zeros_like(h)
        pos = block_pos_NQ.tolist()
        for n, row in enumerate(pos):
            for q in range(len(row)):
                k = q % B
                if k == 0:
                    continue
                p = row[q - k]
                t = p + k
                if t >= len(self.truth):
                    continue
                tok = int(self.truth[t])
                lab = self.label(p, k)
                if lab == self.HIT:
                    add[n, q] = self.strength * self.dirs[tok].to(h.dtype)
                elif lab == self.SECOND:
                    add[n, q] = self.strength * (
                        0.6 * self.dirs[tok] + 0.8 * self.dirs[(tok + 1) % V]
                    ).to(h.dtype)
        return h + add


class CropRollback:
    """transformers' own rollback: `activate_past_recording()` + `cache.crop(-n)`. It rolls
    back the attention K/V and the conv window, never the Gated-DeltaNet recurrent state, so on
    a hybrid target decoding departs from greedy (the test that shows it uses this class)."""

    def begin(self, cache) -> None:
        self.hybrid = is_hybrid_cache(cache)
        if self.hybrid:
            cache.activate_past_recording()

    def before_verify(self, cache):
        return None

    def rollback(self, cache, snap, B: int, keep: int, rerun) -> int:
        if keep < B:
            cache.crop(-(B - keep))
        elif self.hybrid:
            cache.crop(0)  # trims the recorded conv window back to the kernel size
        return 0


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """A process that mp.spawn started as rank `rank` of `world`: the environment torchrun would
    give it (rendezvous on 127.0.0.1:port, DeepSpeed on the CPU; `extra` on top) and one thread
    (two cores thrash otherwise)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
        **extra,
    )
    torch.set_num_threads(1)


_STORES: list = []  # the stores of the jobs launch_local started (alive while this process is)


def launch_local(
    argv: Sequence[str],
    nproc: int,
    env: dict | None = None,
    cwd: str | None = None,
    log_dir: str | None = None,
    run_id: str | None = None,
) -> list[subprocess.Popen]:
    """Start `nproc` copies of `argv` with the environment torchrun would give them (one node,
    TCP rendezvous on 127.0.0.1, the store held by this process as torchrun's agent holds it, so
    it outlives any rank). Tests and benchmarks use it to control the processes directly
    (torchrun would tear the job down on the first failure before we can observe it).
    Output of rank r goes to log_dir/rank{r}.{out,err} when log_dir is given."""
    import torch.distributed as dist

    port = free_port()
    _STORES.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
    procs = []
    for r in range(nproc):
        e = dict(os.environ, **(env or {}))
        e.update(
            RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        if run_id:
            e["DFLASH_RUN_ID"] = run_id
        out = err = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            out = open(os.path.join(log_dir, f"rank{r}.out"), "w")
            err = open(os.path.join(log_dir, f"rank{r}.err"), "w")
        procs.append(subprocess.Popen(list(argv), env=e, cwd=cwd, stdout=out, stderr=err))
    return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit codes (None = still running at the deadline; those are killed)."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.01)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p, c in zip(procs, codes):
        if c is None:
            p.kill()
            p.wait()
    return codes


# ----------------------------------------------------------------------------- stream instruments
@dataclass
class Fault:
    """DFLASH_FAULT="kind@rank:step[,...]" makes worker `rank` die (SIGKILL), hang, stop
    (SIGSTOP) or put NaN into one sample's aux states when it produces a micro-batch of `step`;
    trainer `rank` die, hang or stop when it receives one. DFLASH_FAULT_AFTER=PATH: the fault
    first waits (up to 120 s) for PATH to exist, e.g. the trainers' first checkpoint: a worker
    runs several batches ahead of the trainers (the link's window and their prefetch), so on a
    loaded machine it could reach `step` before they had saved anything."""

    kind: str
    step: int
    after: str | None = None

    @staticmethod
    def for_rank(rank: int) -> Fault | None:
        for item in filter(None, os.environ.get("DFLASH_FAULT", "").split(",")):
            kind, where = item.split("@")
            r, step = where.split(":")
            if int(r) == rank:
                return Fault(kind, int(step), os.environ.get("DFLASH_FAULT_AFTER") or None)
        return None

    def apply(self, tb: TargetBatch, step: int) -> TargetBatch:
        if step != self.step:
            return tb
        deadline = time.monotonic() + 120
        while self.after and not os.path.exists(self.after) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return tb
        if self.kind == "nan":
            aux = tb.aux_NTF.clone()
            aux[0, 1, 0] = float("nan")
            self.step = -1  # once
            return dataclasses.replace(tb, aux_NTF=aux)
        raise ValueError(f"DFLASH_FAULT kind {self.kind!r}: use die, hang, stop or nan")


class InstrumentTap(wire.StreamTap):
    """The split stream's tap with the instruments the environment asks for."""

    def __init__(self, rank: int, env=os.environ):
        self.fault = Fault.for_rank(rank)
        self.dump_dir = env.get("DFLASH_PIPE_DUMP") or None

    def produced(self, tb: TargetBatch, step: int) -> TargetBatch:
        return self.fault.apply(tb, step) if self.fault is not None else tb

    def sent(self, g: int, tb: TargetBatch, **where) -> None:
        self._dump("sent", g, tb, **where)

    def received(self, g: int, tb: TargetBatch, **where) -> None:
        self._dump("recv", g, tb, **where)
        if self.fault is not None and self.fault.kind != "nan":
            self.fault.apply(tb, where["step"])

    def _dump(self, kind: str, g: int, tb: TargetBatch, **where) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        fields = {f.name: getattr(tb, f.name) for f in dataclasses.fields(tb)}
        fields = {
            k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()
        }
        torch.save({**fields, **where, "g": g}, os.path.join(self.dump_dir, f"{kind}_{g:07d}.pt"))


def main(argv: list[str]) -> None:
    """`python -m dflash.tools.testing SCRIPT ARGS`: run SCRIPT (train.py) as __main__ with the stream
    instruments installed for this rank."""
    wire.tap = InstrumentTap(int(os.environ.get("RANK", "0")))
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
