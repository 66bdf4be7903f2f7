"""A structural lint of docker/Dockerfile, /.dockerignore and the documented run lines (no Docker
engine on CI machines, and hadolint is not a Python package)."""

import fnmatch
import os
import re
import shlex

from conftest import ROOT

DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
DOCKERIGNORE = os.path.join(ROOT, ".dockerignore")
DOCKER_README = os.path.join(ROOT, "docker", "README.md")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        op, _, args = buf.strip().partition(" ")
        out.append((op.upper(), args.strip()))
        buf = ""
    return out


def ignore_patterns(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for the patterns used here: a match of the path or of any parent dir."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in (p.rstrip("/") for p in patterns):
        for cand in prefixes:
            if fnmatch.fnmatch(cand, pat):
                return True
            if pat.startswith("**/") and any(
                fnmatch.fnmatch("/".join(parts[j : i + 1]), pat[3:])
                for i in range(len(parts))
                for j in range(i + 1)
            ):
                return True
    return False


def run_mounts(line: str) -> tuple[dict[str, str], list[str]]:
    """container path -> host path of each -v, and the arguments after the image."""
    args = shlex.split(line)
    mounts, i = {}, args.index("run") + 1
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        if flag in ("-v", "--volume"):
            host, container = args[i + 1].split(":")[:2]
            mounts[container] = host
        i += 2 if flag in _FLAGS_WITH_VALUE else 1
    return mounts, args[i + 1 :]


_FLAGS_WITH_VALUE = {"-v", "--volume", "--gpus", "-e", "--env", "--name", "-w", "--shm-size"}


def lint(dockerfile: str, dockerignore: str, run_lines: list[str]) -> list[str]:
    problems = []
    ins = instructions(dockerfile)
    froms = [a for op, a in ins if op == "FROM"]
    if not ins or ins[0][0] not in ("FROM", "ARG"):
        problems.append("the first instruction must be FROM (or ARG)")
    for image in froms:
        ref = image.split()[0]
        tag = ref.rsplit("/", 1)[-1]
        if "@sha256:" not in ref and (":" not in tag or tag.endswith(":latest")):
            problems.append(f"FROM {ref}: pin a tag or digest")
    for op, a in ins:
        if op == "ADD" and re.search(r"https?://", a):
            problems.append(f"ADD {a}: download in a RUN step with a checksum, not ADD <url>")
    patterns = ignore_patterns(dockerignore)
    for op, a in ins:
        if op != "COPY" or a.startswith("--from"):
            continue
        srcs = [s for s in a.split()[:-1] if not s.startswith("--")]
        for s in srcs:
            if not os.path.exists(os.path.join(ROOT, s)):
                problems.append(f"COPY {s}: not in the build context")
            elif is_ignored(s, patterns):
                problems.append(f"COPY {s}: excluded by .dockerignore")
    for must in (
        ".git/HEAD",
        "outputs/smoke-1/checkpoints/step_00000300/model.safetensors",
        "runs/x/checkpoints/step_1/train_state.pt",
        "wandb/offline-run-1/run.wandb",
        "outputs/r/wandb/latest-run",
        "dflash/__pycache__/data.cpython-311.pyc",
        ".pytest_cache/v/cache",
        ".ruff_cache/x",
    ):
        if not is_ignored(must, patterns):
            problems.append(f".dockerignore lets {must} into the build context")
    volumes = set()
    for op, a in ins:
        if op == "VOLUME":
            volumes |= set(re.findall(r'"([^"]+)"', a) or a.split())
    if not run_lines:
        problems.append("no documented `docker run` line")
    for line in run_lines:
        mounts, cmd = run_mounts(line)
        if set(mounts) != volumes:
            problems.append(
                f"run line mounts {sorted(mounts)}, the image declares {sorted(volumes)}"
            )
        for arg in cmd:
            for path in re.findall(r"(?<![\w.$])(/[\w./-]+)", arg):
                if not any(path == m or path.startswith(m + "/") for m in mounts):
                    problems.append(f"run line reads {path}, which no -v mounts")
    return problems


def documented_run_lines() -> list[str]:
    lines = []
    for path in (DOCKERFILE, DOCKER_README):
        for ln in open(path).read().splitlines():
            ln = ln.strip().lstrip("#").strip()
            if ln.startswith("docker run"):
                lines.append(ln)
    return lines


def test_dockerfile_dockerignore_and_run_lines_pass_the_lint():
    lines = documented_run_lines()
    assert len(lines) == 2  # the Dockerfile header and docker/README.md
    problems = lint(open(DOCKERFILE).read(), open(DOCKERIGNORE).read(), lines)
    assert problems == []


def test_lint_catches_each_kind_of_problem():
    bad = (
        "FROM ubuntu\nADD https://example.com/x.tgz /x\nCOPY nosuchdir ./a\nCOPY tests ./t\n"
        'VOLUME ["/models", "/app/outputs"]\n'
    )
    run = (
        "docker run --gpus all -v /models:/models dflash python train.py data.paths=[/data/p.jsonl]"
    )
    problems = lint(bad, "tests/\n", [run])
    joined = "\n".join(problems)
    for expect in (
        "FROM ubuntu: pin a tag",
        "ADD https://example.com/x.tgz",
        "COPY nosuchdir: not in the build context",
        ".dockerignore lets .git/HEAD",
        "run line mounts ['/models'], the image declares ['/app/outputs', '/models']",
        "run line reads /data/p.jsonl, which no -v mounts",
        "COPY tests: excluded by .dockerignore",
    ):
        assert expect in joined, joined
