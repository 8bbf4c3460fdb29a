"""The analysis stack (pandas, matplotlib, duckdb, pyarrow, ADBC's SQLite driver) is the
`analysis` extra: the sidecar never imports it, and `analysis/report.py` without it stops with
one line that names the extra."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib

from tests.analysis.helpers import REPO

STACK = {"pandas", "matplotlib", "duckdb", "pyarrow", "adbc_driver_sqlite"}


def _name(requirement: str) -> str:
    for stop in "[<>=!~ ;":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower().replace("-", "_")


def test_the_analysis_stack_is_an_extra_not_a_runtime_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not STACK & {_name(r) for r in project["dependencies"]}
    assert {_name(r) for r in project["optional-dependencies"]["analysis"]} == STACK


def test_the_sidecar_imports_none_of_the_analysis_stack() -> None:
    found = []
    for path in sorted((REPO / "sidecar").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [
                f"{path.relative_to(REPO)}:{node.lineno} {name}"
                for name in names
                if name.split(".")[0] in STACK
            ]
    assert found == []


def test_report_without_the_extra_names_it_in_one_line() -> None:
    # None in sys.modules makes both find_spec and import see the module as absent.
    code = (
        "import runpy, sys\n"
        "for name in ('pandas', 'matplotlib', 'duckdb', 'pyarrow', 'adbc_driver_sqlite'):\n"
        "    sys.modules[name] = None\n"
        "sys.argv = ['analysis/report.py', 'traces.db']\n"
        "runpy.run_path('analysis/report.py', run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "pandas, matplotlib, duckdb, pyarrow, adbc_driver_sqlite not installed" in lines[0]
    assert "pip install 'xsp-sidecar[analysis]'" in lines[0]
