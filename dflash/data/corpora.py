"""Built-in prompt corpora: the CPython standard library (training) and HumanEval (held out).

Both produce the same kind of prompt, a Python signature + docstring to complete, wrapped by
`completion_prompt`, so training prompts and eval prompts share one format (a drafter is judged on
text shaped like its training text; the chat template is applied later, by dflash.data.prompts.encode_prompts, from the target config).

HumanEval is held out: `check_training_source` refuses it as training data.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import os
import random
import sysconfig

INSTRUCTION = "Complete the following Python code."
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "_bundled",
    "turtledemo",
    "__phello__",
}


def completion_prompt(code: str, raw: bool = False) -> str:
    """The shared prompt format: an instruction and the code in a fenced block (`raw`: the code)."""
    code = code.rstrip("\n") + "\n"
    return code if raw else f"{INSTRUCTION}\n```python\n{code}```"


# ----------------------------------------------------------------------------- stdlib
def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted *.py files of the standard library (no tests, no site-packages)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        out += [
            os.path.join(d, f)
            for f in sorted(files)
            if f.endswith(".py") and not f.startswith("test_")
        ]
    return sorted(out)


def stdlib_items(path: str) -> list[str]:
    """Completion stubs of one module: each documented function, method or class as its
    signature (with decorators; methods under their `class` line) and its docstring."""
    try:
        with open(path, encoding="utf-8") as f:
            src = f.read()
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines = src.splitlines()
    items = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            items.append(_stub(node, lines))
        elif isinstance(node, ast.ClassDef):
            items.append(_stub(node, lines))
            header = _header(node, lines)
            for sub in node.body:
                if isinstance(
                    sub, (ast.FunctionDef, ast.AsyncFunctionDef)
                ) and not sub.name.startswith("__"):
                    stub = _stub(sub, lines)
                    if stub:
                        items.append(header + "\n" + stub)
    return [s for s in items if s and len(s) < 4000]


def _header(node, lines: list[str]) -> str:
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1
    return "\n".join(lines[start : node.body[0].lineno - 1]).rstrip()


def _stub(node, lines: list[str]) -> str | None:
    """Signature + docstring, or None when the node has no docstring."""
    if not node.body or ast.get_docstring(node) is None:
        return None
    doc = node.body[0]
    start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
    return "\n".join(lines[start : doc.end_lineno]) + "\n"


@functools.lru_cache(maxsize=4)
def stdlib_corpus(root: str | None = None) -> tuple[str, ...]:
    """Every completion stub of the standard library, in file order (~1.5 s to parse)."""
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(
            f"no standard-library sources under {root or sysconfig.get_paths()['stdlib']}"
        )
    items = tuple(dict.fromkeys(s for path in files for s in stdlib_items(path)))
    if not items:
        raise ValueError("the standard library yielded no documented function or class")
    return items


def code_dir_paths(name: str) -> list[str]:
    """A `data.code_dirs` entry: a directory, or `site-packages` (this interpreter's installed
    packages: purelib and platlib)."""
    if name == "site-packages":
        paths = sysconfig.get_paths()
        return sorted({paths["purelib"], paths["platlib"]})
    path = os.path.expanduser(name)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"data.code_dirs: {name!r} is not a directory; name directories of Python sources "
            "or `site-packages`"
        )
    return [path]


def code_files(dirs: tuple[str, ...]) -> list[str]:
    """The *.py files under `dirs` (the standard library's rules: no tests; anything whose path
    names HumanEval is skipped, it is held out)."""
    return sorted(
        {
            f
            for name in dirs
            for root in code_dir_paths(name)
            for f in stdlib_files(root)
            if not _names_humaneval(f)
        }
    )


@functools.lru_cache(maxsize=4)
def code_corpus(dirs: tuple[str, ...], need: int | None = None, seed: int = 0) -> tuple[str, ...]:
    """Completion stubs of the files under `dirs`. need: stop once that many distinct stubs are
    found, reading the files in an order shuffled by `seed` (a site-packages holds ~10^5 stubs
    and parsing them all takes minutes; a run needs a few thousand). Deterministic for a seed
    and the installed files."""
    files = code_files(dirs)
    if need is not None:
        random.Random(seed).shuffle(files)
    items: dict[str, None] = {}
    step = 256 if need is not None else max(len(files), 1)
    for stubs_of_chunk in _parse_chunks(files, step):
        for stubs in stubs_of_chunk:
            items.update(dict.fromkeys(stubs))
        if need is not None and len(items) >= need:
            break
    return tuple(items)


def _parse_chunks(files: list[str], step: int, ahead: int = 2):
    """stdlib_items of every file, `step` files at a time in file order, over the machine's cores
    when there are many (site-packages: ~90k stubs from ~15k files, about a minute on one core).
    One process pool for all chunks, `ahead` chunks in flight: a caller that stops early leaves
    at most that much parsing behind."""
    chunks = [files[i : i + step] for i in range(0, len(files), step)]
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 16)
    if len(files) < 200 or workers < 2:
        for chunk in chunks:
            yield [stdlib_items(f) for f in chunk]
        return
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(workers)
    try:
        pending = deque(pool.map(stdlib_items, c, chunksize=16) for c in chunks[:ahead])
        for k in range(len(chunks)):
            if k + ahead < len(chunks):
                pending.append(pool.map(stdlib_items, chunks[k + ahead], chunksize=16))
            yield list(pending.popleft())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _names_humaneval(path: str) -> bool:
    return "humaneval" in path.lower().replace("-", "").replace("_", "")


def stdlib_prompts(
    num: int,
    seed: int = 0,
    root: str | None = None,
    raw: bool = False,
    code_dirs: tuple[str, ...] = (),
) -> list[str]:
    """`num` distinct completion prompts sampled from the standard library (plus the Python
    sources under `code_dirs`), deterministic for a seed and the installed sources. Asking for
    more than the corpus holds returns all of it."""
    if num < 1:
        raise ValueError(f"data.num_samples must be >= 1 for data.source=stdlib, got {num}")
    items = stdlib_corpus(root)
    if code_dirs:  # twice what is sampled, so the sample still mixes both sources
        extra = code_corpus(tuple(code_dirs), need=2 * num, seed=seed)
        items = tuple(dict.fromkeys(items + extra))
    picks = random.Random(seed).sample(range(len(items)), min(num, len(items)))
    return [completion_prompt(items[i], raw) for i in picks]


# ----------------------------------------------------------------------------- HumanEval
def assets_dir() -> str:
    return os.environ.get("DFLASH_ASSETS") or os.path.join(
        os.path.expanduser("~"), ".cache", "dflash"
    )


def humaneval_path(path: str | None = None) -> str:
    path = (
        os.path.expanduser(path)
        if path
        else os.path.join(assets_dir(), "humaneval", "HumanEval.jsonl.gz")
    )
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"HumanEval not found at {path}; fetch it with "
            "`bash ../shared/scripts/fetch_models.sh humaneval` (or set DFLASH_ASSETS)"
        )
    return path


def humaneval_problems(path: str | None = None) -> list[dict]:
    path = humaneval_path(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    bad = [
        r.get("task_id")
        for r in rows
        if not str(r.get("task_id", "")).startswith("HumanEval/") or "prompt" not in r
    ]
    if bad or not rows:
        raise ValueError(
            f"{path} is not HumanEval (rows need task_id 'HumanEval/N' and a prompt); "
            "fetch it with `bash ../shared/scripts/fetch_models.sh humaneval`"
        )
    return rows


def humaneval_prompts(path: str | None = None, raw: bool = False) -> list[str]:
    """The 164 HumanEval prompts in task order, in the shared completion format."""
    return [completion_prompt(r["prompt"], raw) for r in humaneval_problems(path)]


# ----------------------------------------------------------------------------- held out
HELD_OUT_SOURCES = ("humaneval",)


def check_training_source(source: str, paths=()) -> None:
    """Refuse held-out eval data as training data (by source, or by a file that is HumanEval)."""
    if source in HELD_OUT_SOURCES:
        raise ValueError(
            f"data.source={source} is held out for evaluation and never used as training "
            "data; train on data.source=stdlib/jsonl/parquet/selfgen and evaluate with "
            f"eval.source={source}"
        )
    for p in paths or ():
        if _names_humaneval(os.path.basename(str(p))):
            raise ValueError(
                f"data.paths contains {p}, which looks like HumanEval: it is held out for "
                "evaluation (eval.source=humaneval) and never used as training data"
            )


def check_training_sources(dcfg) -> None:
    """check_training_source for data.source, or for each source of data.mix."""
    for source, paths in [(m.source, m.paths) for m in dcfg.mix] or [(dcfg.source, dcfg.paths)]:
        check_training_source(source, paths)
