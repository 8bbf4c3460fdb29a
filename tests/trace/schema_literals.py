"""Where `sidecar/` and `analysis/` name a trace's attributes and levels, read with `ast`.

`uses(path)` finds the names a module uses as a span or trace attribute key or as a level,
and how: a string literal (`attributes["op_type"]`, `attributes={"op_type": ...}`, SQL's
`'$.op_type'` and `level = 'layer'`, `span.level == "layer"`) or a keyword (`attrs.update(
op_type=...)`). `tests/trace/test_schema.py` checks each against `sidecar.trace.schema`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Variables and fields that hold a span's or a trace's attributes
HOLDERS = frozenset({"attributes", "attrs", "marks", "trace_attributes", "span_attributes"})
_METHODS = frozenset({"get", "pop", "setdefault"})
# Fields and columns that hold a level
LEVEL_HOLDERS = frozenset({"level", "run_level"})
JSON_PATH = re.compile(r"\$\.([A-Za-z_][A-Za-z0-9_]*)")
SQL_LEVEL = re.compile(
    r"\b(?:run_)?level\s*(?:=|<>|!=|IS NOT DISTINCT FROM|IS DISTINCT FROM)\s*'([a-z_]+)'"
    r"|\b(?:run_)?level\s+(?:NOT\s+)?IN\s*\(([^)]*)\)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Use:
    """One name used as an attribute key (`what = "attribute"`) or a level, at a line."""

    path: str
    line: int
    name: str
    what: str  # "attribute" or "level"
    literal: bool  # a string literal (else a keyword argument's name)
    span: tuple[int, int, int, int] | None = None  # the literal's (line, col, end line, end col)


def _holder(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in HOLDERS
    if isinstance(node, ast.Attribute):
        return node.attr in HOLDERS
    return False


def _level_holder(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in LEVEL_HOLDERS
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value in LEVEL_HOLDERS
    return False


def _str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _dict_keys(node: ast.AST) -> Iterator[ast.Constant]:
    if isinstance(node, ast.Dict):
        for key in node.keys:
            if key is not None and _str(key) is not None:
                assert isinstance(key, ast.Constant)
                yield key


def _strings(node: ast.AST) -> Iterator[tuple[int, str]]:
    """A node's own string text: a literal's, or an f-string's literal parts."""
    if isinstance(node, ast.JoinedStr):
        for part in node.values:
            if (s := _str(part)) is not None:
                yield node.lineno, s
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.lineno, node.value


def _sql_levels(text: str) -> Iterator[str]:
    for m in SQL_LEVEL.finditer(text):
        if m.group(1):
            yield m.group(1)
        else:
            yield from re.findall(r"'([a-z_]+)'", m.group(2))


def uses(path: Path, rel: str) -> Iterator[Use]:
    """The attribute and level names `path` uses (`rel`: its path as reported)."""
    tree = ast.parse(path.read_text(), str(path))
    in_fstring: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            in_fstring.update(id(v) for v in node.values)

    def where(node: ast.AST) -> tuple[int, int, int, int] | None:
        if not isinstance(node, ast.Constant) or node.end_lineno is None:
            return None
        return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset or 0

    def attr(node: ast.AST, name: str, literal: bool = True) -> Use:
        return Use(rel, getattr(node, "lineno", 0), name, "attribute", literal, where(node))

    def level(node: ast.AST, name: str) -> Use:
        return Use(rel, getattr(node, "lineno", 0), name, "level", True, where(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _holder(node.value):
            if (s := _str(node.slice)) is not None:
                yield attr(node.slice, s)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and _holder(func.value):
                if func.attr in _METHODS and node.args and (s := _str(node.args[0])) is not None:
                    yield attr(node.args[0], s)
                if func.attr == "update":
                    for kw in node.keywords:
                        if kw.arg is not None:
                            yield attr(node, kw.arg, literal=False)
                    for arg in node.args:
                        for key in _dict_keys(arg):
                            yield attr(key, str(key.value))
            for kw in node.keywords:
                if kw.arg in HOLDERS:
                    for key in _dict_keys(kw.value):
                        yield attr(key, str(key.value))
                    if isinstance(kw.value, ast.Call) and _is_dict_call(kw.value):
                        for k in kw.value.keywords:
                            if k.arg is not None:
                                yield attr(kw.value, k.arg, literal=False)
            is_at = isinstance(func, ast.Attribute) and func.attr == "at" and len(node.args) == 1
            if is_at and (s := _str(node.args[0])) is not None:  # `frames.at(level)`
                yield level(node.args[0], s)
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "isin"
                and _level_holder(func.value)
            ):
                for arg in node.args:
                    for elt in getattr(arg, "elts", []):
                        if (s := _str(elt)) is not None:
                            yield level(elt, s)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            "attributes" in node.name
        ):  # `def _trace_attributes(self): return {...}`
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    for key in _dict_keys(ret.value):
                        yield attr(key, str(key.value))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_holder(t) for t in targets):
                for key in _dict_keys(node.value):
                    yield attr(key, str(key.value))
                if isinstance(node.value, ast.Call) and _is_dict_call(node.value):
                    for k in node.value.keywords:
                        if k.arg is not None:
                            yield attr(node.value, k.arg, literal=False)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_level_holder(s) for s in sides):
                for side in sides:
                    for elt in [side, *getattr(side, "elts", [])]:
                        if (s := _str(elt)) is not None:
                            yield level(elt, s)
            for op, right in zip(node.ops, node.comparators, strict=True):
                is_in = isinstance(op, (ast.In, ast.NotIn)) and _holder(right)
                if is_in and (s := _str(node.left)) is not None:
                    yield attr(node.left, s)
        if isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in in_fstring:
            for line, text in _strings(node):
                for name in JSON_PATH.findall(text):
                    yield Use(rel, line, name, "attribute", True)
                for name in _sql_levels(text):
                    yield Use(rel, line, name, "level", True)


def _is_dict_call(node: ast.Call) -> bool:
    return isinstance(node.func, ast.Name) and node.func.id == "dict"


def sources(repo: Path) -> list[Path]:
    """The product's modules, generated protobuf code left out."""
    files = [*repo.glob("sidecar/**/*.py"), *repo.glob("analysis/**/*.py")]
    return sorted(f for f in files if "_proto" not in f.parts and not f.name.endswith("_pb2.py"))


def all_uses(repo: Path) -> list[Use]:
    return [u for f in sources(repo) for u in uses(f, str(f.relative_to(repo)))]


if __name__ == "__main__":
    import collections
    import sys

    found = all_uses(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    for (what, name), n in sorted(collections.Counter((u.what, u.name) for u in found).items()):
        print(what, name, n, sorted({u.path for u in found if u.name == name and u.what == what}))
