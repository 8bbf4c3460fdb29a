"""The measured constants sit in one module, `analysis/tuning.py`, each with the bench that set
it: a comment above it that quotes a section of docs/benchmarks.md by its title."""

from __future__ import annotations

import ast
import re

from tests.analysis.helpers import REPO

TUNING = REPO / "analysis" / "tuning.py"


def constants() -> dict[str, str]:
    """`{name: the comment block above it}` for each module-level constant of tuning.py."""
    lines = TUNING.read_text().splitlines()
    found = {}
    for node in ast.parse(TUNING.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            above, i = [], node.lineno - 2
            while i >= 0 and lines[i].startswith("#"):
                above.insert(0, lines[i].lstrip("# "))
                i -= 1
            found[node.targets[0].id] = " ".join(above)
    return found


def test_each_constant_names_the_bench_section_that_set_it() -> None:
    titles = [
        line.removeprefix("## ")
        for line in (REPO / "docs" / "benchmarks.md").read_text().splitlines()
        if line.startswith("## ")
    ]
    found = constants()
    assert {"MEMORY_LIMIT", "THREADS", "INSERT_ROWS", "REST_ROWS", "SLOWEST"} <= set(found)
    unnamed, named_above = [], False
    for name, comment in found.items():  # "Same section": the one the constant above named
        quoted = re.findall(r'"([^"]+)"', comment)
        named = any(t.startswith(q) for q in quoted for t in titles)
        if not named and not ("Same section" in comment and named_above):
            unnamed.append(name)
        named_above = named or ("Same section" in comment and named_above)
    assert unnamed == []


def test_no_other_module_defines_them() -> None:
    names = set(constants())
    again = []
    for path in sorted((REPO / "analysis").rglob("*.py")):
        if path == TUNING:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                again += [
                    f"{path.relative_to(REPO)}: {t.id}"
                    for t in targets
                    if isinstance(t, ast.Name) and t.id in names
                ]
    assert again == []
