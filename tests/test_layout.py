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
    users = [n for n, p in mods.items() if "dflash.testing" in _imports(n, p, mods)]
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
    runs = {"dflash.colocated", "dflash.split.run", "dflash.split.worker", "dflash.split.trainer"}
    for n, deps in graph.items():
        if n in ("dflash.launch", "dflash.testing") or n in runs:
            continue
        assert not deps & (runs | {"dflash.launch"}), (n, deps & (runs | {"dflash.launch"}))
    assert "dflash.launch" not in set().union(*graph.values())
