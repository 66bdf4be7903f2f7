"""The run directory and its log file.

Hydra is told to write nothing (conf/config.yaml: no `.hydra/`, no log file, run dir `.`), so a
command that fails before the run starts leaves nothing behind: the launcher makes the run
directory only after every check that needs no model passed, and removes it again when the start
fails afterwards (the directory did not exist before this command). Once made, everything this
process prints (stdout and stderr, our logger's lines, warnings, tracebacks) also goes to
`<run_dir>/<log_name>` (train.log, eval.log), progress bars reduced to their final state.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys

from .lock import RunLock, describe


class _Tee:
    """A text stream that writes to the console stream and to the log file. Carriage-return
    redraws (progress bars) reach the file only as the line's final text."""

    def __init__(self, stream, log):
        self.stream, self.log, self.pending = stream, log, ""

    def write(self, s: str) -> int:
        n = self.stream.write(s)
        self.pending += s
        *lines, self.pending = self.pending.split("\n")
        self._to_log("".join(line.rsplit("\r", 1)[-1].rstrip() + "\n" for line in lines))
        return n if n is not None else len(s)

    def _to_log(self, text: str) -> None:
        """A full disk must not turn every print into an error: the console goes on."""
        if not text or self.log.closed:
            return
        try:
            self.log.write(text)
            self.log.flush()
        except OSError:
            pass

    def flush(self) -> None:
        self.stream.flush()
        self._to_log("")

    def close_line(self) -> None:
        tail = self.pending.rsplit("\r", 1)[-1].rstrip()
        self._to_log(tail + "\n" if tail else "")
        self.pending = ""

    def __getattr__(self, name):  # isatty, fileno, encoding... of the console stream
        return getattr(self.stream, name)


class RunDir:
    """`own()` makes the directory and takes its lock (one live run per directory); `open()`
    starts the log; `close(ok)` stops the log, releases the lock and, after a failure, removes a
    directory this command made for a run that never started (a run has started once it wrote
    run_config.json: resumed or fresh, right before its first step)."""

    def __init__(self, path: str, log_name: str, writer: bool = True, logs: bool | None = None):
        """writer: this process makes (and may remove) the directory; logs: it writes its console
        to the log file (default: the writer)."""
        self.path, self.log_name, self.writer = path, log_name, writer
        self.logs = writer if logs is None else logs
        self.made = False
        self._made_top: str | None = None  # the outermost folder open() made (out_root, ...)
        self._log = None
        self._saved: tuple | None = None
        self._lock: RunLock | None = None

    def own(self) -> str | None:
        """Make the directory and take its lock (rank 0, before anything is written there); the
        line that refuses the start when a live run owns it (see dflash.run.lock)."""
        self._make()
        self._lock = RunLock(self.path)
        refused = self._lock.acquire()
        if refused:  # the directory is the live run's: nothing here is removed
            self._lock, self.made, self._made_top = None, False, None
        return refused

    def _make(self) -> None:
        if self._made_top is None and not self.made:
            self.made = not os.path.exists(self.path)
            self._made_top = _first_missing(self.path)
        os.makedirs(self.path, exist_ok=True)

    def taken_over(self) -> str | None:
        """The line saying whose lock this run took over (a run that died holding it)."""
        prev = self._lock.previous if self._lock is not None else None
        if not prev:
            return None
        return f"run dir: taking it over from a run that is gone ({describe(prev)})"

    def open(self) -> RunDir:
        if self.writer:  # rank 0 makes (and may remove) the directory
            self._make()
        if self.logs and self._saved is None:
            self._log = open(os.path.join(self.path, self.log_name), "a", buffering=1)
            self._saved = (sys.stdout, sys.stderr)
            sys.stdout = _Tee(sys.stdout, self._log)
            sys.stderr = _Tee(sys.stderr, self._log)
            self._retarget_handlers(self._saved, (sys.stdout, sys.stderr))
        return self

    def note(self, line: str) -> None:
        """A rank that does not log (another trainer, a worker) still leaves its last line in the
        log, so that the log says why every rank stopped."""
        if self.logs or not line or not os.path.isdir(self.path):
            return
        try:
            with open(os.path.join(self.path, self.log_name), "a") as f:
                f.write(line.rstrip() + "\n")
        except OSError:
            pass

    def log_only(self, text: str) -> None:
        """To the log file, not the console (a traceback Python prints to the console itself)."""
        if self._saved is not None and isinstance(sys.stderr, _Tee):
            sys.stderr._to_log(text)

    def close(self, ok: bool = True) -> None:
        if self._saved is not None:
            for tee in (sys.stdout, sys.stderr):
                if isinstance(tee, _Tee):
                    tee.close_line()
            self._retarget_handlers((sys.stdout, sys.stderr), self._saved)
            sys.stdout, sys.stderr = self._saved
            self._saved = None
            try:
                self._log.close()
            except OSError:  # the last flush on a full disk
                pass
        started = os.path.exists(os.path.join(self.path, "run_config.json"))
        if not ok and self.made and not started:
            shutil.rmtree(self.path, ignore_errors=True)
            _remove_empty_parents(self.path, self._made_top)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @staticmethod
    def _retarget_handlers(old: tuple, new: tuple) -> None:
        # libraries (transformers) made their logging handlers on sys.stderr at import time
        loggers = [logging.getLogger()] + [
            v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)
        ]
        for lg in loggers:
            for h in lg.handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                    for o, n in zip(old, new):
                        if getattr(h, "stream", None) is o:
                            try:
                                h.setStream(n)
                            except AttributeError:  # a handler that reads sys.stderr itself
                                pass


def _first_missing(path: str) -> str | None:
    """The outermost folder of `path` that does not exist yet (None: path exists)."""
    path, top = os.path.abspath(path), None
    while not os.path.exists(path):
        top, path = path, os.path.dirname(path)
    return top


def _remove_empty_parents(path: str, top: str | None) -> None:
    """After the run dir itself went: the folders above it that open() made, while empty."""
    if top is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    while len(d) >= len(top) and d.startswith(top):
        try:
            os.rmdir(d)
        except OSError:  # not empty: another run, or a cache, lives there
            return
        d = os.path.dirname(d)
