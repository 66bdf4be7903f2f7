"""Prompt and conversation sources: local files (jsonl / json / parquet, Hugging Face `datasets`
directories, files and hub names) and the built-in corpora, as normalized conversations.

Rows are streamed: a jsonl file is read line by line and a `datasets` table (memory-mapped
Arrow) a batch at a time, so reading holds one row, never the file, as Python objects. Every row
is checked where it is read: a bad one fails with one line naming the file, the line (jsonl,
json) or row (Arrow tables) and what the row should hold, before any model runs on it.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from collections.abc import Iterator

from ..config import DataConfig
from .conversations import ID_FIELDS, Conversation, SkipCounts, expected, normalize

ARROW_EXT = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
JSON_EXT = (".jsonl", ".jsonl.gz", ".ndjson", ".json", ".json.gz")


def text_prompts(cfg: DataConfig, log=print) -> list:
    """First prompts of the source's conversations (data.turns): strings for plain prompt rows
    and the built-in corpora, chat message lists otherwise."""
    return [c.prompt(cfg.turns) for c in read_conversations(cfg, log)]


def read_conversations(cfg: DataConfig, log=print, keep: bool = False) -> list[Conversation]:
    """keep: the read is held for the run's own read of the same files (preflight reads the
    prompt files before the target loads; the run then takes that read, once, instead of
    parsing the files again). A held read is handed over with the lines it logged."""
    key = _read_key(cfg)
    held = _HELD.pop(key, None) if key else None
    if held is None:
        lines: list[str] = []
        held = (list(iter_conversations(cfg, lines.append)), lines)
    convs, lines = held
    if keep and key:
        _HELD[key] = held
    else:
        for line in lines:
            log(line)
    return list(convs)


_HELD: dict = {}  # preflight's reads, each taken by the run's first read of the same files


def drop_held_reads() -> None:
    _HELD.clear()


def _read_key(cfg: DataConfig) -> str | None:
    """The read's config and the files' size and mtime; None for other sources."""
    if cfg.source not in ("jsonl", "parquet"):
        return None
    try:
        stats = [(p, os.stat(p)) for p in resolve_paths(cfg.paths)]
        stamps = [(p, st.st_size, st.st_mtime_ns) for p, st in stats]
    except (FileNotFoundError, OSError):
        return None
    return json.dumps([dataclasses.asdict(cfg), stamps], sort_keys=True, default=str)


def iter_conversations(cfg: DataConfig, log=print) -> Iterator[Conversation]:
    """Up to data.num_samples conversations of data.source, in order; skipped rows are counted
    and logged by reason (data.mix: dflash.data.mix.training_conversations)."""
    if cfg.source == "mix":
        raise ValueError("data.source=mix: read through dflash.data.mix.training_conversations")
    if cfg.source in ("stdlib", "humaneval"):
        yield from (
            Conversation([{"role": "user", "content": p}], plain=True) for p in _corpus(cfg)
        )
        return
    if not cfg.paths:
        raise ValueError(f"data.source={cfg.source} needs data.paths=[file, ...]")
    skips, n = SkipCounts(), 0
    try:
        for row, where in iter_rows(cfg):
            conv = normalize(row, cfg.format, cfg.prompt_field, cfg.turns, where, skips)
            if conv is None:
                continue
            yield conv
            n += 1
            if n >= cfg.num_samples:
                break
    finally:  # also when the reader stops early: the rows skipped up to there
        if skips.total:
            log(f"data: skipped {skips.total} rows of {list(cfg.paths)} ({skips.summary()})")
    if not n:
        raise ValueError(
            f"data.paths {list(cfg.paths)} hold no rows (the dataset is empty"
            + (f"; every row was skipped: {skips.summary()}" if skips.total else "")
            + ")"
        )


def _corpus(cfg: DataConfig) -> list[str]:
    if cfg.source == "stdlib":
        from .corpora import stdlib_prompts

        return stdlib_prompts(cfg.num_samples, seed=cfg.seed, code_dirs=tuple(cfg.code_dirs))
    from .corpora import humaneval_prompts

    return humaneval_prompts(cfg.paths[0] if cfg.paths else None)


def resolve_paths(paths, hub_ok: bool = False) -> list[str]:
    """Each path with ~ and globs expanded (sorted); hub_ok: a name that matches nothing is kept
    (a hub dataset)."""
    out, missing = [], []
    for p in paths:
        p = os.path.expanduser(str(p))
        found = sorted(glob.glob(p)) if glob.has_magic(p) else ([p] if os.path.exists(p) else [])
        if not found and hub_ok and not glob.has_magic(p) and not os.path.isabs(p):
            found = [p]
        (out.extend(found) if found else missing.append(p))
    if missing:
        raise FileNotFoundError(f"data.paths: {missing} not found")
    return out


def iter_rows(cfg: DataConfig) -> Iterator[tuple[object, str]]:
    """(row, where it is) for every row of every path, in order."""
    for path in resolve_paths(cfg.paths, hub_ok=cfg.source == "hf"):
        if cfg.source == "parquet":
            _check_parquet(path)
        if cfg.source != "hf" and path.endswith(JSON_EXT):
            yield from (json_rows if _ext(path) == ".json" else jsonl_rows)(path, cfg)
        else:
            yield from arrow_rows(path, cfg)


def _ext(path: str) -> str:
    base = path[:-3] if path.endswith(".gz") else path
    return os.path.splitext(base)[1].lower()


def _open(path: str):
    return (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8")


def jsonl_rows(path: str, cfg: DataConfig) -> Iterator[tuple[object, str]]:
    lines = (gzip.open if path.endswith(".gz") else open)(path, "rb")
    try:
        with lines as f:
            for n, raw in enumerate(f, 1):
                line = _text_line(raw, path, n)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line "
                        f"must be one JSON object with {expected(cfg.format, cfg.prompt_field)}"
                    ) from None
                yield row, f"{path}:{n}"
    except (OSError, EOFError) as e:  # a .gz that is not gzip, or is cut off
        raise ValueError(
            f"{path}: cannot be read as jsonl{'.gz' * path.endswith('.gz')} ({e})"
        ) from None


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


def _check_parquet(path: str) -> None:
    import pyarrow.parquet as pq

    try:
        pq.read_schema(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types
        raise ValueError(
            f"{path}: not a parquet file ({str(e).splitlines()[0][:100]}); data.source=parquet "
            "reads parquet files (data.source=jsonl reads jsonl)"
        ) from None


def json_rows(path: str, cfg: DataConfig) -> Iterator[tuple[object, str]]:
    """A .json file: one JSON list of rows (each named by the line it starts on), or one object
    a line."""
    with _open(path) as f:
        text = f.read()
    dec, i = json.JSONDecoder(), _skip_ws(text, 0)
    if not text.startswith("[", i):
        del text  # one object a line: streamed instead
        yield from jsonl_rows(path, cfg)
        return
    i, line, counted = _skip_ws(text, i + 1), 1, 0
    while i < len(text) and text[i] != "]":
        line += text.count("\n", counted, i)
        counted = i
        try:
            row, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); the file must "
                f"be a list of objects with {expected(cfg.format, cfg.prompt_field)}"
            ) from None
        yield row, f"{path}:{line}"
        i = _skip_ws(text, i)
        if text.startswith(",", i):
            i = _skip_ws(text, i + 1)
        elif not text.startswith("]", i):
            line += text.count("\n", counted, i)
            raise ValueError(f"{path}:{line}: not valid JSON (expected ',' or ']' after a row)")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def arrow_rows(path: str, cfg: DataConfig) -> Iterator[tuple[object, str]]:
    """Rows of a `datasets` table (memory-mapped Arrow), one batch at a time."""
    ds = load_table(path, cfg.hf_split)
    wanted = {"conversations", "messages", cfg.prompt_field, *ID_FIELDS}
    ds = ds.select_columns([c for c in ds.column_names if c in wanted])
    if not ds.column_names:
        raise ValueError(
            f"{path}: no column holds {expected(cfg.format, cfg.prompt_field)} (set "
            "data.prompt_field / data.format)"
        )
    i = 0
    for batch in ds.iter(batch_size=1024):
        cols = list(batch)
        for j in range(len(batch[cols[0]]) if cols else 0):
            yield {c: batch[c][j] for c in cols}, f"{path} row {i}"
            i += 1


def load_table(path: str, split: str = "train"):
    """A `datasets.Dataset`: a `save_to_disk` directory, a file by its extension (json, jsonl,
    parquet, arrow, csv), else a hub name (needs a network)."""
    import datasets

    if os.path.isdir(path):
        ds = datasets.load_from_disk(path)
    elif os.path.isfile(path):
        ext = _ext(path)
        builder = "json" if ext in (".json", ".jsonl", ".ndjson") else ARROW_EXT.get(ext)
        if builder is None:
            raise ValueError(
                f"{path}: unknown file type {ext!r}; data.source=hf reads a save_to_disk "
                "directory or .json/.jsonl/.parquet/.arrow/.csv files"
            )
        return datasets.load_dataset(builder, data_files=[path], split="train")
    else:
        try:
            return datasets.load_dataset(path, split=split)
        except Exception as e:  # offline, or no such dataset: one line, not the hub's traceback
            raise ValueError(
                f"data.paths: {path!r} is no local file or directory, and loading it as a hub "
                f"dataset failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r} (has {list(ds)}); set data.hf_split")
        ds = ds[split]
    return ds
