"""The README's two newcomer commands work as written: its install line leaves the optional extras
out, so the tests it runs next pass without them (a test that needs one is skipped, saying which),
and CI runs that install line before it adds any extra."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

# optional extras the README's install line leaves out -> the module a test would import
EXTRAS = {"deepspeed": "deepspeed"}


def _readme_lines() -> list[str]:
    """The README's first code block, comments cut: line 1 installs and runs, line 2 tests."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [ln.split("#")[0].strip() for ln in block.splitlines()]


def _readme_commands() -> list[str]:
    return [c.strip() for c in _readme_lines()[0].split("&&")]


@pytest.mark.slow  # ~1 min; CI runs the README's pytest before it installs the extras, too
def test_fast_tier_passes_without_the_optional_extras(tmp_path):
    """The fast tests of every file that names an extra run with that extra missing (hidden
    as a missing install hides it): they pass or
    skip saying which extra, none fails."""
    # as a missing install: `import deepspeed` fails and importlib.util.find_spec finds nothing
    # (accelerate probes with find_spec before it imports)
    hide = "".join(f"sys.modules[{m!r}] = None\n" for m in EXTRAS.values())
    (tmp_path / "sitecustomize.py").write_text("import sys\n" + hide)
    files = sorted(
        os.path.join("tests", f)
        for f in os.listdir(os.path.join(ROOT, "tests"))
        if f.startswith("test_")
        and f != "test_readme.py"
        and any(m in open(os.path.join(ROOT, "tests", f)).read() for m in EXTRAS)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert files and r.returncode == 0, r.stdout[-3000:]
    for name in EXTRAS:  # a skip says which extra it needs
        for line in r.stdout.splitlines():
            if line.startswith("SKIPPED") and name in line:
                assert f"needs the {name} extra: pip install 'dflash[{name}]'" in line, line


def test_ci_runs_the_readme_install_line_before_adding_extras():
    """.ci/run installs exactly what the README's line installs (torch from the configured
    index: the README's --index-url is the public CPU wheel index), runs the README's pytest,
    and only then installs the extras."""
    install = [c for c in _readme_commands() if c.startswith("pip install")]
    assert len(install) == 2 and install[1] == "pip install -e '.[test]'", install
    ci = [ln.split("#")[0].strip() for ln in open(os.path.join(ROOT, ".ci", "run"))]
    ci = [ln for ln in ci if ln]
    at = []
    for cmd in install:
        want = re.sub(r"\s+--index-url\s+\S+", "", cmd).replace("pip install", "pip install -q")
        hits = [i for i, ln in enumerate(ci) if ln == f"python3 -m {want}"]
        assert hits, f".ci/run does not run the README's `{cmd}`"
        at.append(hits[0])
    test_cmd = _readme_lines()[1]
    assert test_cmd.startswith("pytest"), test_cmd
    want = "python3 -m " + test_cmd.replace("pytest", "pytest -q", 1)
    readme_pytest = [i for i, ln in enumerate(ci) if ln == want]
    extras = [i for i, ln in enumerate(ci) if "pip install" in ln and i not in at]
    assert readme_pytest and extras, ci
    assert at[0] < at[1] < readme_pytest[0] < min(extras)
