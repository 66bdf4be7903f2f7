"""data.code_dirs: more Python sources beside the standard library for data.source=stdlib."""

import pytest

from dflash.corpora import code_corpus, stdlib_corpus, stdlib_prompts

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


def test_code_corpus_is_kept_on_disk_until_a_file_changes(tmp_path, monkeypatch):
    import dflash.corpora as corpora

    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path / "assets"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "geo.py").write_text(MOD)
    first = corpora.code_corpus.__wrapped__((str(src),))
    assert len(list((tmp_path / "assets" / "corpus").iterdir())) == 1

    def no_parse(path):
        raise AssertionError("parsed again")

    monkeypatch.setattr(corpora, "stdlib_items", no_parse)
    assert corpora.code_corpus.__wrapped__((str(src),)) == first  # from disk
    (src / "geo.py").write_text(MOD + "\n\ndef more():\n    '''More.'''\n")
    with pytest.raises(AssertionError, match="parsed again"):
        corpora.code_corpus.__wrapped__((str(src),))
