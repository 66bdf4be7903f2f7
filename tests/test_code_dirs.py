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


def test_code_dirs_add_documented_stubs_and_skip_tests_and_humaneval(tmp_path):
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


def test_code_dirs_names_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.code_dirs.*not a directory"):
        code_corpus((str(tmp_path / "nope"),))
