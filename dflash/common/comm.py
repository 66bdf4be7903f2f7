"""Process plumbing for multi-process runs: the rank context from the launcher's environment,
process groups, point-to-point tensor messages with deadlines. (Named `comm`, not `dist`, so it
reads apart from `torch.distributed as dist`.)

Nothing here knows about models or batches: a message is (meta: list[int], tensors). It goes
as a fixed-size int64 header (meta, then dtype and shape of each tensor) followed by one
message per tensor, on the default process group (NCCL on GPU, gloo on CPU).

Waiting is always bounded. gloo's `Work.is_completed()` does not progress until `wait()` is
called, so gloo waits use `wait(timeout)` (a dead peer fails at once with "Connection closed
by peer"); NCCL never notices a dead peer, so NCCL waits poll `is_completed()` against a
deadline. Either way a silent or dead peer becomes a PeerError that names it.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

HEADER_LEN = 96
_MAGIC = 0xDF1A54
_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
EXIT_PIPELINE = 3  # exit status of a rank whose peer died or hung, or on_bad_batch=stop


class PeerError(RuntimeError):
    """A peer rank died, stayed silent past the deadline, or sent something malformed."""


_AT_EXIT: list = []  # callables (line, code) told before this process leaves through die()


def at_die(fn) -> None:
    """Tell `fn(line, code)` when this process leaves through die() (the liveness note)."""
    _AT_EXIT.append(fn)


def die(msg: str, code: int) -> NoReturn:
    """Print and leave now. os._exit skips atexit / process-group teardown, which can block
    forever on a pending receive from a dead peer."""
    if msg:
        print(msg, file=sys.stderr, flush=True)
    sys.stdout.flush()
    for fn in _AT_EXIT:
        try:
            fn(msg.strip() or f"exit {code}", code)
        except Exception:  # noqa: BLE001 - leaving is what matters now
            pass
    os._exit(code)


# ----------------------------------------------------------------------------- rank context
@dataclass
class RankContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float
    startup_timeout_s: float
    ctrl: Any = None  # gloo group over all ranks: startup barriers and small object broadcasts
    # The first PeerError a receiver thread of this process saw: the launcher reports it as the
    # root cause when the main thread fails later in a collective with a peer that stopped.
    root_cause: PeerError | None = None
    liveness: Any = None  # dflash.common.liveness.Liveness: which peer is silent (None: unknown)

    def explain(self, e: BaseException) -> str:
        """A failed wait's message, led by the silent or exited peer when there is one (the
        peer a wait names may be alive, itself waiting on the silent one)."""
        why = self.liveness.explain() if self.liveness is not None else None
        return f"{why}; {e}" if why else str(e)

    @property
    def world_group(self):
        return dist.group.WORLD

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """The bound of a collective's wait: above timeout_s, so that the deadlines that name a
        peer (messages, the liveness watchdog) fire first."""
        return datetime.timedelta(seconds=self.timeout_s * 1.5 + 30)

    def barrier(self) -> None:
        """monitored_barrier names the ranks that did not arrive (gloo only: ctrl is gloo)."""
        dist.monitored_barrier(
            group=self.ctrl,
            timeout=datetime.timedelta(seconds=self.startup_timeout_s),
            wait_all_ranks=True,
        )

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.ctrl)
        return box[0]


def launcher_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun / accelerate launch set them."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def resolve_backend(backend: str) -> str:
    """topology.backend (already one of config.BACKENDS) -> the backend this machine can run."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "topology.backend=nccl needs CUDA devices; use topology.backend=gloo on CPU"
        )
    return backend


def init_distributed(backend: str, timeout_s: float, startup_timeout_s: float) -> RankContext:
    """One process group for the job (NCCL: device cuda:LOCAL_RANK; gloo: CPU) plus a gloo
    control group. The default group's timeout sits above timeout_s so that our own deadlines,
    which name the peer, fire before the library's watchdog."""
    rank, world, local_rank = launcher_env()
    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s * 1.5 + 30),  # collective_timeout
        )
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=startup_timeout_s))
    return RankContext(
        rank, world, local_rank, device, backend, float(timeout_s), float(startup_timeout_s), ctrl
    )


def new_group(ranks: Sequence[int], backend: str | None = None, timeout=None):
    """Collective over the whole job: every rank must call it, in the same order."""
    return dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- bounded waits
def wait_for(work, deadline: float, backend: str, peer: str, doing: str, timeout_s: float) -> None:
    """Wait for one isend/irecv until `deadline` (time.monotonic()); PeerError names `peer`."""
    try:
        if backend == "gloo":
            left = max(deadline - time.monotonic(), 1e-3)
            work.wait(datetime.timedelta(seconds=left))
            return
        delay = 5e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        work.wait()
    except TimeoutError:
        raise PeerError(
            f"{peer} did not {doing} within {timeout_s:g} s (topology.timeout_s): it died or hangs"
        ) from None
    except RuntimeError as e:
        text = str(e)
        if "Timed out" in text or "timed out" in text:
            raise PeerError(
                f"{peer} did not {doing} within {timeout_s:g} s (topology.timeout_s): "
                "it died or hangs"
            ) from None
        detail = (
            text.splitlines()[0].split(". This is typically")[0][:200] if text else type(e).__name__
        )
        raise PeerError(f"{peer} is gone while waiting to {doing} ({detail})") from None


# ----------------------------------------------------------------------------- messages
def encode_header(meta: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[int]:
    vals = [_MAGIC, len(meta), len(tensors), *[int(m) for m in meta]]
    for t in tensors:
        vals += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(vals) > HEADER_LEN:
        raise AssertionError(f"message header needs {len(vals)} > {HEADER_LEN} slots")
    return vals + [0] * (HEADER_LEN - len(vals))


def decode_header(vals: Sequence[int]) -> tuple[list[int], list[tuple[torch.dtype, tuple]]]:
    if vals[0] != _MAGIC:
        raise PeerError(
            f"malformed message header (magic {vals[0]:#x}); are all ranks running the "
            "same dflash version?"
        )
    n_meta, n_t = vals[1], vals[2]
    meta = list(vals[3 : 3 + n_meta])
    i, specs = 3 + n_meta, []
    for _ in range(n_t):
        dtype, ndim = _DTYPES[vals[i]], vals[i + 1]
        specs.append((dtype, tuple(vals[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return meta, specs


class Outbox:
    """Sender side of one link: isend, at most `window` messages in flight (backpressure: the
    next send first waits for the oldest). In-flight tensors stay referenced here until their
    send completes, so the caller's next forward overlaps the transfer."""

    def __init__(
        self, dst: int, peer: str, window: int, timeout_s: float, backend: str, device: torch.device
    ):
        self.dst, self.peer, self.window = dst, peer, window
        self.timeout_s, self.backend, self.device = timeout_s, backend, device
        self.inflight: deque = deque()

    def send(self, meta: Sequence[int], tensors: Sequence[torch.Tensor], label: str) -> float:
        """Returns the seconds spent waiting for room in the window."""
        t0 = time.perf_counter()
        while len(self.inflight) >= self.window:
            self._retire_oldest()
        waited = time.perf_counter() - t0
        tensors = [t.contiguous() for t in tensors]
        header = torch.tensor(encode_header(meta, tensors), dtype=torch.int64, device=self.device)
        works = [dist.isend(header, self.dst)] + [dist.isend(t, self.dst) for t in tensors]
        self.inflight.append((label, works, [header, *tensors]))
        return waited

    def _retire_oldest(self) -> None:
        label, works, _ = self.inflight[0]
        deadline = time.monotonic() + self.timeout_s
        for w in works:
            wait_for(w, deadline, self.backend, self.peer, f"accept {label}", self.timeout_s)
        self.inflight.popleft()

    def flush(self) -> None:
        while self.inflight:
            self._retire_oldest()


def recv_message(
    src: int, peer: str, device: torch.device, backend: str, timeout_s: float, label: str
) -> tuple[list[int], list[torch.Tensor]]:
    """Receive one message from `src` (messages of one link arrive in send order)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    wait_for(
        dist.irecv(header, src),
        time.monotonic() + timeout_s,
        backend,
        peer,
        f"send {label}",
        timeout_s,
    )
    meta, specs = decode_header(header.tolist())
    tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    works = [dist.irecv(t, src) for t in tensors]
    deadline = time.monotonic() + timeout_s
    for w in works:
        wait_for(w, deadline, backend, peer, f"send {label}", timeout_s)
    return meta, tensors
