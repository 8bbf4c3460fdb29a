"""Imports run down the data flow (docs/architecture.md): a package imports only the packages
listed for it here, so a seam that starts to run back up fails this test, not a review.

Read from the source with `ast` (nothing is imported); `from sidecar import __version__` counts
as importing `sidecar` itself, which every layer may do.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BOTTOM = {"sidecar", "analysis"}  # their __init__.py: a version or a docstring, nothing else


def units(*names: str) -> set[str]:
    return {f"sidecar.{name}" for name in names}


def stages(*names: str) -> set[str]:
    """The analysis package's units (its stages and its top modules)."""
    return {f"analysis.{name}" for name in names}


# What each unit may import besides itself and `sidecar`. Top-level modules are units too.
ALLOWED: dict[str, set[str]] = {
    "sidecar": set(),
    "sidecar.trace": set(),
    "sidecar.endpoint": set(),
    # trace: the request span's attribute names a backend adds (`trace.schema`)
    "sidecar.backends": units("profiling", "trace"),
    "sidecar.proxy": units("backends", "endpoint"),
    "sidecar.profiling": units("trace"),
    "sidecar.live": units("endpoint", "trace"),
    "sidecar.replay": units("backends", "profiling", "trace"),
    "sidecar.sampling": units("backends", "proxy", "live", "profiling", "replay", "trace"),
    "sidecar.admin": units("backends", "sampling", "replay", "trace"),
    "sidecar.health": units("backends", "endpoint"),
    "sidecar.config_parsers": units("backends", "profiling", "trace"),
    "sidecar.config": units("backends", "config_parsers", "endpoint", "profiling", "trace"),
    "sidecar.serve": units(
        "admin", "backends", "config", "endpoint", "health", "proxy", "replay", "sampling", "trace"
    ),
    # backends: the repository lookup it hands the runners of a model.py and an ensemble
    "sidecar.profile": units("backends", "profiling", "trace"),
    "sidecar.commands": units("config", "profile", "serve"),
    "sidecar.cli": units("commands"),
    "sidecar.__main__": units("cli"),
    # analysis/: the stages of the offline report, bottom to top (SQLite -> Arrow -> DuckDB)
    "analysis": set(),
    "analysis.tuning": set(),  # the measured constants, each with its bench, under every stage
    "analysis.load": stages("tuning") | units("trace"),
    "analysis.relations": stages("tuning", "load") | units("profiling", "trace"),
    "analysis.analyses": stages("load", "relations") | units("profiling", "trace"),
    "analysis.findings": stages("load", "analyses") | units("profiling", "trace"),
    "analysis.render": stages("load", "analyses", "findings") | units("profiling", "trace"),
    "analysis.fleet": stages("load", "analyses") | units("profiling", "trace"),
    "analysis.keys": set(),
    "analysis._extra": set(),
    "analysis.trace_analysis": stages(
        "tuning", "load", "relations", "analyses", "findings", "keys"
    ),
    "analysis.report": stages(
        "_extra", "keys", "load", "analyses", "findings", "render", "fleet", "trace_analysis"
    )
    | units("trace"),
}


def unit_of(module: str) -> str:
    """`sidecar.sampling.worker` -> `sidecar.sampling`; `analysis.load.tracedb` ->
    `analysis.load`."""
    return ".".join(module.split(".")[:2])


def imports(path: Path, roots: tuple[str, ...] = ("sidecar", "analysis")) -> set[str]:
    """Absolute module names under `roots` that `path` imports (anywhere in it, lazy imports
    included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("sidecar", "analysis"):  # `from sidecar import config_parsers`
                names.update(
                    node.module if alias.name.startswith("__") else f"{node.module}.{alias.name}"
                    for alias in node.names
                )
            else:
                names.add(node.module)
    return {n for n in names if n.split(".")[0] in roots}


def sources() -> list[Path]:
    files = [*REPO.glob("sidecar/**/*.py"), *REPO.glob("analysis/**/*.py")]
    return sorted(f for f in files if "_proto" not in f.parts)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def violations(paths: list[Path]) -> dict[str, list[str]]:
    """`{module: [imports against the layers]}` for the modules that have any."""
    found = {}
    for path in paths:
        module = module_name(path)
        unit = unit_of(module)
        if unit not in ALLOWED:
            found[module] = [f"{unit} is a new unit: give it a row in ALLOWED and in the map"]
            continue
        allowed = ALLOWED[unit] | BOTTOM | {unit}
        wrong = sorted(name for name in imports(path) if unit_of(name) not in allowed)
        if wrong:
            found[module] = wrong
    return found


def test_imports_follow_the_layers() -> None:
    assert violations(sources()) == {}


def test_an_import_that_runs_back_up_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    sampling = REPO / "sidecar" / "sampling" / "pipeline.py"
    source = sampling.read_text() + "\nfrom sidecar.admin.service import ProfilerService\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert violations([sampling]) == {"sidecar.sampling.pipeline": ["sidecar.admin.service"]}


def test_the_analysis_stages_run_one_way() -> None:
    """No analysis unit may import, through the others, a unit that may import it: the table
    itself has no circle (load -> relations -> analyses -> findings -> render; fleet beside)."""
    stages_allowed = {u: {a for a in ok if a.startswith("analysis.")} for u, ok in ALLOWED.items()}
    stages_allowed = {u: ok for u, ok in stages_allowed.items() if u.startswith("analysis")}
    for unit in stages_allowed:
        seen, todo = set(), list(stages_allowed[unit])
        while todo:
            nxt = todo.pop()
            if nxt not in seen:
                seen.add(nxt)
                todo.extend(stages_allowed.get(nxt, ()))
        assert unit not in seen, f"{unit} may import itself through {sorted(seen)}"


def test_an_analysis_stage_that_imports_one_above_it_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = REPO / "analysis" / "load" / "tracedb.py"
    source = loader.read_text() + "\nfrom analysis.analyses.common import Frames\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert violations([loader]) == {"analysis.load.tracedb": ["analysis.analyses.common"]}


# -- import cycles ------------------------------------------------------------------------------
# Inside a unit the table says nothing, so a circle can grow there: module A imports B, which
# imports A, usually kept alive by moving one import into a function. These checks read the
# module graph (sidecar.* and analysis.* modules, lazy imports included).


def module_imports(path: Path, known: set[str]) -> list[tuple[str, int, str | None]]:
    """`(module, line, function)` for each of our modules `path` imports; `function` names
    the function the import sits in (None at module level, `if` blocks included).

    `from package import name` counts as importing `package.name` where that is a module, else
    `package` itself. The packages Python initialises on the way to a module are not counted."""
    found: list[tuple[str, int, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name if function is None else f"{function}.{child.name}")
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                targets = [
                    f"{child.module}.{alias.name}"
                    if f"{child.module}.{alias.name}" in known
                    else child.module
                    for alias in child.names
                ]
            # a module with no source here (the C `_framewalk`) is no part of a circle
            found.extend((t, child.lineno, function) for t in targets if t in known)
            visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), None)
    return found


def module_graph(paths: list[Path]) -> dict[str, dict[str, list[tuple[int, str | None]]]]:
    """`{module: {imported module: [(line, function), ...]}}` over `paths`."""
    names = {module_name(p): p for p in paths}
    graph: dict[str, dict[str, list[tuple[int, str | None]]]] = {}
    for module, path in names.items():
        edges: dict[str, list[tuple[int, str | None]]] = {}
        for target, line, function in module_imports(path, set(names)):
            if target == module:
                continue
            sites = edges.setdefault(target, [])
            if (line, function) not in sites:  # `from m import (a, b)`: one site
                sites.append((line, function))
        graph[module] = edges
    return graph


def path_between(graph: dict[str, dict[str, list]], start: str, goal: str) -> list[str] | None:
    """The shortest import chain `start -> ... -> goal` (breadth first), or None."""
    came: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        for nxt in sorted(graph.get(node, {})):
            if nxt in came:
                continue
            came[nxt] = node
            if nxt == goal:
                chain = [nxt]
                while (prev := came[chain[-1]]) is not None:
                    chain.append(prev)
                return chain[::-1]
            queue.append(nxt)
    return None


def import_cycles(paths: list[Path]) -> list[list[str]]:
    """Each import circle as its modules (sorted), one list per strongly connected group."""
    graph = module_graph(paths)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(groups)


def hidden_cycle_imports(paths: list[Path]) -> list[str]:
    """Imports placed inside a function that close a circle: the function-level import of B
    in A, where B (through anything) imports A at module level or lazily."""
    graph = module_graph(paths)
    found = []
    for module, edges in sorted(graph.items()):
        for target, sites in sorted(edges.items()):
            back = path_between(graph, target, module)
            if back is None:
                continue
            for line, function in sites:
                if function is not None:
                    found.append(
                        f"{module}:{line} imports {target} inside {function}(), closing "
                        + " -> ".join([module, *back])
                    )
    return found


def test_no_import_cycles() -> None:
    assert import_cycles(sources()) == []


def test_no_import_hidden_in_a_function_closes_a_cycle() -> None:
    assert hidden_cycle_imports(sources()) == []


def planted(monkeypatch: pytest.MonkeyPatch, path: Path, extra: str) -> None:
    """`path` reads as its source plus `extra` (the other files as they are)."""
    read = Path.read_text
    source = read(path) + extra
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: source if self == path else read(self, *a, **k)
    )


def test_a_cycle_inside_a_package_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpu/ncu.py` imports `gpu/demangle.py`; a module-level import back closes a circle."""
    demangle = REPO / "sidecar" / "profiling" / "gpu" / "demangle.py"
    planted(monkeypatch, demangle, "\nfrom sidecar.profiling.gpu.ncu import read_ncu_csv\n")
    circle = ["sidecar.profiling.gpu.demangle", "sidecar.profiling.gpu.ncu"]
    assert import_cycles(sources()) == [circle]
    assert hidden_cycle_imports(sources()) == []  # in plain sight, not hidden


def test_an_import_hidden_in_a_function_that_closes_a_cycle_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    demangle = REPO / "sidecar" / "profiling" / "gpu" / "demangle.py"
    lazy = "\n\ndef _late() -> None:\n    from sidecar.profiling.gpu import ncu  # noqa\n"
    planted(monkeypatch, demangle, lazy)
    circle = ["sidecar.profiling.gpu.demangle", "sidecar.profiling.gpu.ncu"]
    assert import_cycles(sources()) == [circle]
    (hidden,) = hidden_cycle_imports(sources())
    assert hidden.startswith("sidecar.profiling.gpu.demangle:")
    assert hidden.endswith(
        "imports sidecar.profiling.gpu.ncu inside _late(), closing sidecar.profiling.gpu.demangle"
        " -> sidecar.profiling.gpu.ncu -> sidecar.profiling.gpu.demangle"
    )


def test_the_product_never_imports_the_test_harness() -> None:
    """The local servers, test models, synthetic traces and the demo live in `tests/harness/`;
    nothing under `sidecar/` or `analysis/` imports `tests` (the wheel does not carry it)."""
    found = {module_name(path): sorted(imports(path, ("tests",))) for path in sources()}
    assert {module: names for module, names in found.items() if names} == {}


def test_an_import_of_the_harness_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = REPO / "sidecar" / "serve.py"
    source = serve.read_text() + "\n    from tests.harness.process import free_port\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert imports(serve, ("tests",)) == {"tests.harness.process"}
