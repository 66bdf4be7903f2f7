"""Which rank of a job is silent: every rank keeps a heartbeat counter in the job's rendezvous
store (a thread adds one every few seconds, whatever the main thread waits for), and says there
why it exits. A rank whose counter stopped moving for `topology.timeout_s` without an exit note
is stopped (SIGSTOP, a debugger), dead (kill -9, the OOM killer) or cut off: the watchdog of every
other rank ends its process naming it (exit 3). A wait that fails or times out elsewhere (a
message, a collective) asks the same question first, so the rank named is the silent one, not
the live peer that waited on it.

The counters compare values, not clocks, so hosts need no synchronized time. The store is the
one the ranks met through (MASTER_ADDR:MASTER_PORT: torchrun's agent, or rank 0 when the ranks
were started directly); a store that stops answering is reported as rank 0 (or the agent) gone.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist


class Liveness:
    def __init__(self, rank: int, world: int, timeout_s: float, name: Callable[[int], str]):
        self.rank, self.world, self.timeout_s, self.name = rank, world, float(timeout_s), name
        self.beat_s = min(5.0, max(0.2, self.timeout_s / 10))
        self.check_s = max(self.beat_s, self.timeout_s / 4)  # the watchdog reads the peers
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"dflash/liveness/{restart}/"
        self.agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self.store = self._client()
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one store request at a time

    def _client(self):
        return dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "29500")),
            is_master=False,
            timeout=datetime.timedelta(seconds=max(2.0, 2 * self.beat_s)),
            wait_for_workers=False,
        )

    # ------------------------------------------------------------------ this rank
    def start(self, on_silent: Callable[[str], None]) -> Liveness:
        """Beat, and call on_silent(line) (which ends the process) once a peer is silent."""
        self._beat()
        threading.Thread(
            target=self._run, args=(on_silent,), name="dflash-alive", daemon=True
        ).start()
        return self

    def _beat(self) -> None:
        with self._lock:
            self.store.add(f"{self.prefix}beat/{self.rank}", 1)

    def _run(self, on_silent) -> None:
        last_check = time.monotonic()
        store_down_since, stale = None, []
        while not self._stop.wait(self.beat_s):
            try:
                self._beat()
                if time.monotonic() - last_check >= self.check_s:
                    last_check = time.monotonic()
                    silent = self.silent(self.timeout_s)
                    if silent:
                        on_silent(self.describe(silent))
                        return
                store_down_since = None
            except Exception:  # noqa: BLE001 - the store itself does not answer
                now = time.monotonic()
                if store_down_since is None:  # who had gone quiet before the store did
                    store_down_since = now
                    stale = self._stale()
                if now - store_down_since >= self.timeout_s:
                    on_silent(self._store_gone(stale))
                    return

    def stop(self, why: str = "") -> None:
        """The rank ends (why: its last line, or '' when it finished): peers stop counting it."""
        self._stop.set()
        done = threading.Event()

        def note():
            try:
                with self._lock:
                    self.store.set(f"{self.prefix}exit/{self.rank}", why or "finished")
            except Exception:  # noqa: BLE001 - a store that is gone: nothing to tell
                pass
            done.set()

        threading.Thread(target=note, daemon=True).start()
        done.wait(2 * self.beat_s)  # never let a dead store hold an exit

    # ------------------------------------------------------------------ the peers
    def _read(self) -> tuple[dict[int, int], dict[int, str]]:
        peers = [r for r in range(self.world) if r != self.rank]
        beats = [f"{self.prefix}beat/{r}" for r in peers]
        exits = [f"{self.prefix}exit/{r}" for r in peers]
        with self._lock:
            have_beat = [self.store.check([k]) for k in beats]
            have_exit = [self.store.check([k]) for k in exits]
            counts = {r: int(self.store.get(k)) for r, k, h in zip(peers, beats, have_beat) if h}
            gone = {r: self.store.get(k).decode() for r, k, h in zip(peers, exits, have_exit) if h}
        return counts, gone

    def silent(self, for_s: float) -> list[int]:
        """The peers whose counter has not moved for `for_s` seconds (as this rank has watched
        it) and that left no exit note."""
        counts, gone = self._read()
        now = time.monotonic()
        out = []
        for r in range(self.world):
            if r == self.rank or r in gone:
                continue
            c = counts.get(r, -1)
            prev = self.seen.get(r)
            if prev is None or prev[0] != c:
                self.seen[r] = (c, now)
            elif now - prev[1] >= for_s:
                out.append(r)
        return out

    def _stale(self) -> list[int]:
        """The peers the watchdog saw still across a whole reading interval, and more."""
        now = time.monotonic()
        return [r for r, (_, t) in self.seen.items() if now - t >= self.check_s + 2 * self.beat_s]

    def describe(self, silent: list[int]) -> str:
        names = ", ".join(self.name(r) for r in silent)
        verb = "is" if len(silent) == 1 else "are"
        return (
            f"{names} {verb} silent: no sign of life for {self.timeout_s:g} s (topology.timeout_s): "
            "stopped, dead, or its host unreachable"
        )

    def _store_gone(self, stale: list[int] = ()) -> str:
        where = "torchrun's agent store" if self.agent else f"{self.name(0)}, which holds the store"
        line = (
            f"{where} at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} does "
            "not answer: stopped, dead, or unreachable"
        )
        if stale:  # the store's holder most likely went for them
            names = ", ".join(self.name(r) for r in stale)
            line = f"{names} went silent first, then {line}"
        return line

    def explain(self, wait_s: float | None = None) -> str | None:
        """Asked after a failed or timed-out wait: which peer is silent or gone. Two readings of
        the counters a few beats apart (or wait_s); None when every peer is alive and working."""
        try:
            before, _ = self._read()
            time.sleep(wait_s if wait_s is not None else 3 * self.beat_s)
            after, gone = self._read()
        except Exception:  # noqa: BLE001
            return self._store_gone(self._stale())
        gone = {r: why for r, why in gone.items() if why != "finished"}
        silent = [r for r in sorted(after) if r not in gone and after[r] == before.get(r)]
        if silent:  # the cause: the ranks that exited since did so for it
            names = ", ".join(self.name(r) for r in silent)
            verb = "is" if len(silent) == 1 else "are"
            return f"{names} {verb} silent (stopped, dead, or its host unreachable)"
        return (
            "; ".join(f"{self.name(r)} exited ({why[:200]})" for r, why in sorted(gone.items()))
            or None
        )
