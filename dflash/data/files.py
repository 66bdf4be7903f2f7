"""Prompt sources as text: local jsonl/parquet files and the built-in corpora.

Every row is checked where it is read, so a bad file fails with one line naming the file, the
line (jsonl) or row (parquet) and what the row should hold, before any model runs on it.
"""

from __future__ import annotations

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
    missing = [p for p in cfg.paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"data.paths: {missing} not found")
    rows = jsonl_rows(cfg) if cfg.source == "jsonl" else parquet_rows(cfg)
    if not rows:
        raise ValueError(f"data.paths {list(cfg.paths)} hold no rows (the dataset is empty)")
    return rows


def jsonl_rows(cfg: DataConfig) -> list:
    rows = []
    for path in cfg.paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line "
                        f"must be one JSON object with {ROW_HELP}"
                    ) from None
                rows.append(prompt_of(row, cfg.prompt_field, f"{path}:{n}"))
                if len(rows) >= cfg.num_samples:
                    return rows
    return rows


def parquet_rows(cfg: DataConfig) -> list:
    import datasets

    ds = datasets.load_dataset("parquet", data_files=list(cfg.paths), split="train")
    field = cfg.prompt_field if cfg.prompt_field in ds.column_names else "messages"
    if field not in ds.column_names:
        raise ValueError(
            f"data rows need a {cfg.prompt_field!r} or 'messages' field; "
            f"found {ds.column_names} (set data.prompt_field)"
        )
    where = ",".join(cfg.paths)
    return [
        prompt_of({field: v}, field, f"{where} row {i}")
        for i, v in enumerate(ds[field][: cfg.num_samples])
    ]


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
