"""The package's shape: small modules, instruments out of production code, imports flowing one
way (launcher -> run -> helpers), no module imported back by one it imports."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "dflash"


def _modules() -> dict:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name: str, path: Path, modules: dict) -> set:
    """dflash modules imported anywhere in the file (module level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = ".".join(base[: len(base) - node.level + 1])
                mod = f"{root}.{node.module}" if node.module else root
            else:
                mod = node.module or ""
            cands = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found |= {c for c in cands if c in modules and c != name}
    return found


def test_no_module_over_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: c for n, c in long.items() if c > 400} == {}


def test_production_modules_never_import_the_testing_module():
    mods = _modules()
    users = [n for n, p in mods.items() if "dflash.tools.testing" in _imports(n, p, mods)]
    assert "dflash.tools.testing" in mods
    assert users == []


def test_no_import_cycles():
    mods = _modules()
    graph = {n: _imports(n, p, mods) for n, p in mods.items()}
    # a package's __init__ may not import its own submodules' importers back; plain DFS
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def test_flow_is_launcher_then_runs_then_helpers():
    mods = _modules()
    graph = {n: _imports(n, p, mods) for n, p in mods.items()}
    runs = {
        "dflash.train.colocated",
        "dflash.train.split.run",
        "dflash.train.split.worker",
        "dflash.train.split.trainer",
    }
    # a folder's __init__ names its entry points (the launcher, the runs) and is imported by none
    # of the modules below
    exporters = {n for n, p in mods.items() if p.name == "__init__.py"}
    for n, deps in graph.items():
        if n in ("dflash.run.launcher", "dflash.tools.testing") or n in runs | exporters:
            continue
        assert not deps & (runs | {"dflash.run.launcher"}), (
            n,
            deps & (runs | {"dflash.run.launcher"}),
        )
    assert "dflash.run.launcher" not in set().union(*(graph[n] for n in set(graph) - exporters))
    assert runs <= set(graph)  # the names above exist: the check is not vacuous


# Which folder may import which: each folder imports only the folders listed for it (and itself).
# Read bottom-up: config and common are shared basics; the target is below the drafter (a warm
# start copies target layers into the drafter, never the reverse); data regenerates with the
# target; decoding drafts with the drafter; evaluation uses decoding's acceptance rules and data's
# prompts; training uses all of those; run (the launcher and entry glue) starts training; tools sit
# on top. `dflash` itself (the package root) is importable from anywhere.
BASICS = {"config", "common"}
MAY_IMPORT = {
    "config": set(),
    "common": {"config"},
    "target": BASICS,
    "drafter": BASICS | {"target"},
    "data": BASICS | {"target"},
    "decoding": BASICS | {"target", "drafter"},
    "eval": BASICS | {"target", "drafter", "data", "decoding"},
    "train": BASICS | {"target", "drafter", "data", "decoding", "eval"},
    "run": BASICS | {"target", "drafter", "data", "decoding", "eval", "train"},
    "tools": BASICS | {"target", "drafter", "data", "decoding", "eval", "train", "run"},
}


def _folder(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def folder_violations(graph: dict) -> list:
    """(module, imported module) pairs that go against MAY_IMPORT."""
    bad = []
    for n, deps in graph.items():
        a = _folder(n)
        for m in sorted(deps):
            b = _folder(m)
            if a is None or b is None or a == b:
                continue
            if b not in MAY_IMPORT.get(a, set()):
                bad.append((n, m))
    return bad


def folder_cycles(graph: dict) -> list:
    """Pairs of folders that import each other, directly or through others."""
    edges = {}
    for n, deps in graph.items():
        for m in deps:
            a, b = _folder(n), _folder(m)
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)

    def reach(a):
        seen, todo = set(), [a]
        while todo:
            for b in edges.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    return sorted((a, b) for a in edges for b in reach(a) if a < b and a in reach(b))


def test_every_module_lives_in_a_folder_of_the_table():
    loose = [n for n in _modules() if n != "dflash" and _folder(n) not in MAY_IMPORT]
    assert loose == [], f"modules outside the folders of MAY_IMPORT: {loose}"
    sizes = {}
    for n, p in _modules().items():
        if p.parent != PKG:
            sizes[p.parent] = sizes.get(p.parent, 0) + 1
    assert {str(d.relative_to(PKG)): c for d, c in sizes.items() if c > 12} == {}


def test_folders_import_only_downwards():
    mods = _modules()
    graph = {n: _imports(n, p, mods) for n, p in mods.items()}
    assert folder_violations(graph) == []
    assert folder_cycles(graph) == []


def test_the_folder_checks_catch_a_wrong_import_and_a_cycle():
    """The two checks above are not vacuous: an upward import and a two-folder loop are caught."""
    graph = {"dflash.target.load": {"dflash.train.step"}, "dflash.train.step": set()}
    assert folder_violations(graph) == [("dflash.target.load", "dflash.train.step")]
    graph["dflash.train.step"] = {"dflash.target.load"}
    assert folder_cycles(graph) == [("target", "train")]
