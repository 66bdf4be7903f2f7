"""Files on disk: the permissions a written file gets, and a write that failed for want of room
(a full disk, a quota, a file-size limit) or on a read-only place, said in one line naming the
path instead of the writer's own error (torch's is `[enforce fail at inline_container.cc:672] .
unexpected pos 704 vs 598`, with no path)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil

_TORCH_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


class ShortWrite(OSError):
    """A writer that lost the errno (torch's zip writer) stopped short of writing `filename`."""


@contextlib.contextmanager
def writing(path: str):
    """Around the write of one file: its failure carries the path (`filename`), so the
    launcher's one line can name it."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = path
        raise
    except RuntimeError as e:
        if any(s in str(e) for s in _TORCH_SHORT_WRITE):
            err = ShortWrite(str(e).splitlines()[0])
            err.filename = path
            raise err from e
        raise


def usual_mode(path: str) -> None:
    """Give a file the permissions open() would have given it (0666 less the umask):
    safetensors writes 0600, which hides checkpoints and caches from the rest of a group."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _errno_of(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = re.search(r"os error (\d+)", str(e))  # safetensors: "I/O error: ... (os error 28)"
    return int(m.group(1)) if m else None


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def storage_error(e: BaseException, path: str, label: str | None = None) -> str | None:
    """One line for a write of `path` (a file or the folder it went to; `label` says it in
    words) that failed for want of room or on a read-only place; None for any other error."""
    code = _errno_of(e)
    short_write = isinstance(e, ShortWrite) or (
        isinstance(e, RuntimeError) and any(s in str(e) for s in _TORCH_SHORT_WRITE)
    )
    if code is None and not short_write:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    free = shutil.disk_usage(_existing(path)).free
    path = label or path
    if code == errno.EFBIG or (code is None and limit != resource.RLIM_INFINITY):
        return (
            f"file size limit reached writing {path} (ulimit -f: {limit} bytes); raise it: "
            "ulimit -f unlimited"
        )
    if code in (errno.ENOSPC, errno.EDQUOT) or code is None:
        what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on the device"
        return (
            f"{what} writing {path} ({free / 1e9:.2f} GB free there now); free some space, or "
            "set out_root / data.cache_dir to another disk"
        )
    if code == errno.EROFS:
        return f"cannot write {path}: read-only file system; set out_root to a writable folder"
    if code in (errno.EACCES, errno.EPERM):
        return f"cannot write {path}: permission denied; set out_root to a writable folder"
    return None
