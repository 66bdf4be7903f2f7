"""Each config key's one-line description, read from the schemas' source: the comment on the
field's own lines, else the comment block right above it (comments rather than `metadata=`, so
that documenting a field costs no line in the schema modules). `--help` (dflash.run.help) and
docs/configuration.md (`python -m dflash.tools.config_docs`) print them;
`tests/test_config_docs.py` fails when a field has no description.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
import typing

from .run import GROUPS, RunConfig


def field_docs() -> dict[str, dict[str, str]]:
    """class name -> field -> one-line description (empty when the field has none)."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted({inspect.getsourcefile(c) for c in (RunConfig, *GROUPS.values())}):
        out.update(_file_docs(open(path).read()))
    return out


def _file_docs(src: str) -> dict[str, dict[str, str]]:
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(src).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = out.setdefault(node.name, {})
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                own = [
                    comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments
                ]
                above, i = [], stmt.lineno - 1
                while i in comments and i not in code_lines:
                    above.insert(0, comments[i])
                    i -= 1
                docs[stmt.target.id] = " ".join(own or above)
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
        if dataclasses.is_dataclass(v):
            return "(group)"
    else:
        return "(required)"
    return "null" if v is None else repr(v).replace("'", "")


def rows():
    """(dotted key, type, default, description) for every field, top-level keys first."""
    docs = field_docs()
    for f in dataclasses.fields(RunConfig):
        if f.name not in GROUPS:
            yield f.name, str(f.type), _default(f), docs["RunConfig"].get(f.name, "")
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{group}.{f.name}", str(f.type), _default(f), docs[cls.__name__].get(f.name, "")
            item = typing.get_args(hints[f.name])
            if item and dataclasses.is_dataclass(item[0]):  # a list of items: each item's keys
                for g in dataclasses.fields(item[0]):
                    doc = docs[item[0].__name__].get(g.name, "")
                    yield f"{group}.{f.name}[].{g.name}", str(g.type), _default(g), doc
