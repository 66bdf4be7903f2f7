"""Prompt sources as text: local jsonl/parquet files and the built-in corpora.

Every row is checked where it is read, so a bad file fails with one line naming the file, the
line (jsonl) or row (parquet) and what the row should hold, before any model runs on it.
"""

from __future__ import annotations

import glob
import gzip
import json
import os

from ..config import DataConfig

ROW_HELP = (
    "a 'prompt' string, or 'messages': a list of {'role': str, 'content': str} (set "
    "data.prompt_field to read another field)"
)


def text_prompts(cfg: DataConfig) -> list:
    """Prompt strings or chat message lists from local jsonl/parquet files, or built-in corpora."""
    if cfg.source == "stdlib":
        from .corpora import stdlib_prompts

        return stdlib_prompts(cfg.num_samples, seed=cfg.seed, code_dirs=tuple(cfg.code_dirs))
    if cfg.source == "humaneval":
        from .corpora import humaneval_prompts

        return humaneval_prompts(cfg.paths[0] if cfg.paths else None)
    if not cfg.paths:
        raise ValueError(f"data.source={cfg.source} needs data.paths=[file, ...]")
    missing = [p for p in cfg.paths if not glob.glob(os.path.expanduser(p))]
    if missing:
        raise FileNotFoundError(f"data.paths: {missing} not found")
    paths = tuple(m for p in cfg.paths for m in sorted(glob.glob(os.path.expanduser(p))))
    key = (cfg.source, paths, tuple(_stamp(p) for p in paths), cfg.prompt_field, cfg.num_samples)
    if key not in _READ:  # preflight reads them first: the run reuses that read
        while len(_READ) >= 4:  # training, eval and held-out pool reads; no more is kept
            _READ.pop(next(iter(_READ)))
        read = jsonl_rows if cfg.source == "jsonl" else parquet_rows
        _READ[key] = read(paths, cfg.prompt_field, cfg.num_samples)
    rows = list(_READ[key])
    if not rows:
        raise ValueError(f"data.paths {list(cfg.paths)} hold no rows (the dataset is empty)")
    return rows


_READ: dict = {}  # the files read last (a few): their rows
_SKIPPED: set = set()  # files whose empty prompts this process has reported


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _skip_empty(where: str, count: int) -> None:
    if count and where not in _SKIPPED:
        _SKIPPED.add(where)
        print(f"data: {count} empty prompts in {where} skipped", flush=True)


def _is_empty(prompt) -> bool:
    if isinstance(prompt, str):
        return not prompt.strip()
    return not any(m["content"].strip() for m in prompt)


def jsonl_rows(paths, prompt_field: str, num_samples: int) -> list:
    rows = []
    for path in paths:
        empty = 0
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    line = _text_line(raw, path, n)
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(
                            f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line "
                            f"must be one JSON object with {ROW_HELP}"
                        ) from None
                    prompt = prompt_of(row, prompt_field, f"{path}:{n}")
                    if _is_empty(prompt):
                        empty += 1
                        continue
                    rows.append(prompt)
                    if len(rows) >= num_samples:
                        break
        except (OSError, EOFError) as e:  # a .gz that is not gzip, or is cut off
            raise ValueError(
                f"{path}: cannot be read as jsonl{'.gz' * path.endswith('.gz')} ({e})"
            ) from None
        _skip_empty(path, empty)
        if len(rows) >= num_samples:
            break
    return rows


def _text_line(raw: bytes, path: str, n: int) -> str:
    """One line of a jsonl file as text; a binary or non-UTF-8 file is named with its line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        hint = " (a parquet file: data.source=parquet)" if raw.startswith(b"PAR1") else ""
        raise ValueError(
            f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
            f"data.paths must be jsonl: UTF-8 text, one JSON object a line{hint}"
        ) from None
    if "\x00" in line:
        raise ValueError(
            f"{path}:{n}: a NUL byte: a binary file, not jsonl (UTF-8 text, one JSON object a line)"
        )
    return line


def parquet_rows(paths, prompt_field: str, num_samples: int) -> list:
    import datasets
    import pyarrow.parquet as pq

    for path in paths:
        try:
            pq.read_schema(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types
            raise ValueError(
                f"{path}: not a parquet file ({str(e).splitlines()[0][:100]}); data.source=parquet "
                "reads parquet files (data.source=jsonl reads jsonl)"
            ) from None
    ds = datasets.load_dataset("parquet", data_files=list(paths), split="train")
    field = prompt_field if prompt_field in ds.column_names else "messages"
    if field not in ds.column_names:
        raise ValueError(
            f"data rows need a {prompt_field!r} or 'messages' field; "
            f"found {ds.column_names} in {','.join(paths)} (set data.prompt_field)"
        )
    where, rows, empty = ",".join(paths), [], 0
    for i, v in enumerate(ds[field]):
        prompt = prompt_of({field: v}, field, f"{where} row {i}")
        if _is_empty(prompt):
            empty += 1
            continue
        rows.append(prompt)
        if len(rows) >= num_samples:
            break
    _skip_empty(where, empty)
    return rows


def prompt_of(row, prompt_field: str, where: str):
    """The prompt of one row (a string, or a list of chat messages), or a one-line error."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object with {ROW_HELP}; got {_kind(row)}")
    field = prompt_field if prompt_field in row else "messages"
    if field not in row:
        raise ValueError(
            f"{where}: rows need a {prompt_field!r} or 'messages' field; "
            f"found {sorted(row)} (set data.prompt_field)"
        )
    value = row[field]
    if field != "messages":
        if not isinstance(value, str):
            raise ValueError(f"{where}: {field!r} must be a string, got {_kind(value)}")
        return value
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise ValueError(
            f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}, "
            f"got {json.dumps(value, default=str)[:80]}"
        )
    return value


def _kind(v) -> str:
    return f"{type(v).__name__} {json.dumps(v, default=str)[:40]}"
