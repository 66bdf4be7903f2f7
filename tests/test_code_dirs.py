"""data.code_dirs: more Python sources beside the standard library for data.source=stdlib."""

import pytest

from dflash.data.corpora import code_corpus, stdlib_corpus, stdlib_prompts

MOD = '''
def area(r):
    """Area of a circle of radius r."""
    return 3.14159 * r * r


def undocumented(x):
    return x
'''


def test_code_dirs_add_documented_stubs_and_skip_tests_and_humaneval(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path / "assets"))  # the parsed-corpus cache
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "geo.py").write_text(MOD)
    for skipped in ("tests", "human_eval"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "m.py").write_text(MOD.replace("area", f"area_{skipped}"))
    items = code_corpus((str(tmp_path),))
    assert len(items) == 1 and items[0].startswith("def area(r):")
    n = len(stdlib_corpus())
    every = stdlib_prompts(n + 10, seed=0, code_dirs=(str(tmp_path),))
    assert len(every) == n + 1 and sum("def area(r):" in p for p in every) == 1
    # the standard library alone, as before
    assert not any("def area(r):" in p for p in stdlib_prompts(n, seed=0))


def test_code_dirs_names_a_missing_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path / "assets"))
    with pytest.raises(FileNotFoundError, match="data.code_dirs.*not a directory"):
        code_corpus((str(tmp_path / "nope"),))


def test_code_corpus_reads_only_as_many_files_as_it_needs(tmp_path, monkeypatch):
    """A site-packages has ~10^5 stubs: a run that needs a few thousand parses a seeded random
    share of the files, the same share for the same seed."""
    import dflash.data.corpora as corpora

    for i in range(600):
        (tmp_path / f"m{i:03d}.py").write_text(MOD.replace("area", f"area{i}"))
    pooled = corpora.code_corpus.__wrapped__((str(tmp_path),), need=10, seed=1)  # all cores
    parsed = []
    real = corpora.stdlib_items
    monkeypatch.setattr(corpora, "stdlib_items", lambda f: parsed.append(f) or real(f))
    monkeypatch.setattr(corpora.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    some = corpora.code_corpus.__wrapped__((str(tmp_path),), need=10, seed=1)  # one core
    assert 10 <= len(some) == len(parsed) <= 256  # one chunk of files, not all 600
    assert pooled == some  # the process pool reads the same files in the same order
    again = corpora.code_corpus.__wrapped__((str(tmp_path),), need=10, seed=1)
    assert again == some
    other = corpora.code_corpus.__wrapped__((str(tmp_path),), need=10, seed=2)
    assert set(other) != set(some)
    assert len(corpora.code_corpus.__wrapped__((str(tmp_path),))) == 600  # need=None: all
