"""Every relative link in the tracked Markdown files resolves: the file (or folder, or image) is
there and, where the link names a section (`file.md#section`), the file has a heading with that
GitHub anchor. The docs cross-link a lot (results, history entries, recipes); a renamed heading
or a moved file should fail here, not in a reader's browser."""

import os
import re
import subprocess
from collections import Counter

import pytest
from conftest import ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _markdown_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout: the tracked Markdown files are unknown")
    return [f for f in out.stdout.split() if os.path.exists(os.path.join(ROOT, f))]


def _unfenced(text: str) -> str:
    """The text outside fenced code blocks (a `#` line there is a comment, not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text outside code blocks and inline code (a link there is an example)."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped (but - and _), lower case,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a file's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen, out = Counter(), set()
    for m in HEADING.finditer(_unfenced(text)):
        a = github_anchor(m.group(1))
        out.add(a if not seen[a] else f"{a}-{seen[a]}")
        seen[a] += 1
    return out


def broken_links(files: list[str], root: str) -> list[str]:
    texts = {f: open(os.path.join(root, f), encoding="utf-8").read() for f in files}
    heads = {os.path.normpath(f): anchors(t) for f, t in texts.items()}
    bad = []
    for f, text in texts.items():
        for target in LINK.findall(_prose(text)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(f), path) if path else f)
            if not os.path.exists(os.path.join(root, rel)):
                bad.append(f"{f}: {target} (no such file)")
            elif anchor and rel.endswith(".md") and anchor not in heads.get(rel, set()):
                bad.append(f"{f}: {target} (no heading with that anchor in {rel})")
    return bad


def test_github_anchor_follows_githubs_rule():
    assert (
        github_anchor("2026-12-06: SmolLM2 (H100), tau 3.382!")
        == "2026-12-06-smollm2-h100-tau-3382"
    )
    assert github_anchor("Chat and code: `+exp=qwen05_chat`") == "chat-and-code-expqwen05_chat"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### A\n") == {"a", "a-1", "a-2"}


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n## Part two\n")
    (tmp_path / "b.md").write_text(
        "[ok](docs/a.md#part-two) [ok](docs/a.md) [ok](#here) [web](https://x.org/y#z)\n"
        "`[code](gone.md)`\n# Here\n[bad](docs/a.md#part-three) [gone](docs/c.md)\n"
    )
    assert broken_links(["b.md", "docs/a.md"], str(tmp_path)) == [
        "b.md: docs/a.md#part-three (no heading with that anchor in docs/a.md)",
        "b.md: docs/c.md (no such file)",
    ]


def test_every_relative_link_in_the_docs_resolves():
    files = _markdown_files()
    assert "README.md" in files and len(files) > 5
    assert broken_links(files, ROOT) == []
