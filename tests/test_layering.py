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

BOTTOM = {"sidecar"}  # sidecar/__init__.py: the version, nothing else


def units(*names: str) -> set[str]:
    return {f"sidecar.{name}" for name in names}


# What each unit may import besides itself and `sidecar`. Top-level modules are units too.
ALLOWED: dict[str, set[str]] = {
    "sidecar": set(),
    "sidecar.trace": set(),
    "sidecar.endpoint": set(),
    "sidecar.proxy": units("endpoint"),
    "sidecar.profiling": units("trace"),
    "sidecar.live": units("endpoint", "trace"),
    "sidecar.replay": units("profiling", "trace"),
    "sidecar.sampling": units("proxy", "live", "profiling", "replay", "trace"),
    "sidecar.admin": units("sampling", "replay", "trace"),
    "sidecar.health": units("endpoint"),
    "sidecar.config_parsers": units("profiling", "trace"),
    "sidecar.config": units("config_parsers", "endpoint", "profiling", "trace"),
    "sidecar.serve": units(
        "admin", "config", "endpoint", "health", "proxy", "replay", "sampling", "trace"
    ),
    "sidecar.profile": units("profiling", "trace"),
    "sidecar.commands": units("config", "profile", "serve"),
    "sidecar.cli": units("commands"),
    "sidecar.__main__": units("cli"),
    "analysis": units("profiling", "trace"),
}


def unit_of(module: str) -> str:
    """`sidecar.sampling.worker` -> `sidecar.sampling`; `analysis.report` -> `analysis`."""
    parts = module.split(".")
    return parts[0] if parts[0] == "analysis" or len(parts) == 1 else ".".join(parts[:2])


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
