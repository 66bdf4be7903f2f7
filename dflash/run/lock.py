"""One live run per run directory: `<run_dir>/run.lock` holds the owner's pid, host and start
time under an exclusive lock (flock) for as long as the owner lives. The kernel drops the lock
when the owner dies, however it dies (kill -9 included), so a lock file left behind by a dead
run is taken over, with a line, and a live owner is named when a second start or resume is
refused. Where the file system has no flock, a lock of this host whose pid is gone is taken
over; one of another host is refused, naming it (remove the file once that run is gone)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

LOCK_FILE = "run.lock"


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.fd: int | None = None
        self.previous: dict | None = None  # the dead owner taken over from

    def acquire(self) -> str | None:
        """Take the lock; the line that refuses the start (naming the live owner) if another run
        holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                owner = _read(fd)
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return _refusal(self.path, owner)
                if not _gone(owner):  # no flock here: the pid decides
                    return _refusal(self.path, owner)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:  # the file we locked may have been removed by its owner's clean exit meanwhile
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.previous = _read(fd) or None
        os.ftruncate(fd, 0)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.path)  # while still locked: a waiting start sees a new file
        except OSError:
            pass
        os.close(self.fd)  # drops the lock
        self.fd = None


def live_owner(run_dir: str) -> str | None:
    """The refusal line if a live run holds this directory's lock (nothing is created)."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES) or not _gone(_read(fd)):
            return _refusal(path, _read(fd))
    finally:
        os.close(fd)
    return None


def describe(owner: dict | None) -> str:
    if not owner:
        return "a run that left no details"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {when}"


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode()
        owner = json.loads(text) if text.strip() else {}
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _gone(owner: dict) -> bool:
    """Without flock: whether the owner is known to be dead (its pid, on this host)."""
    if not owner or owner.get("host") != socket.gethostname():
        return not owner
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, ValueError):
        return False
    return False


def _refusal(path: str, owner: dict) -> str:
    return (
        f"run dir {os.path.dirname(path)} is in use by a live run ({describe(owner)}): two runs "
        "in one directory would mix their checkpoints and metrics; wait for it to end or stop "
        f"it, or pick another run_name (if that run is gone, remove {path})"
    )
