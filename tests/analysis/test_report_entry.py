"""`analysis/report.py`, the report's entry point, run both ways: by its path from a checkout
(`python analysis/report.py`) and as the installed package's module (`python -m
analysis.report`), from a folder that is not the checkout, with no sys.path edits."""

from __future__ import annotations

import importlib.machinery
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.analysis.helpers import CPU_DB, REPO

SCRIPT = REPO / "analysis" / "report.py"
ARGS = [str(CPU_DB), "--only", "A1,A15", "--format", "json"]


def _run(cmd: list[str], cwd: Path, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    out = subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_by_path_and_as_a_module_the_same_report(tmp_path: Path) -> None:
    by_path = _run([sys.executable, str(SCRIPT), *ARGS], tmp_path)
    as_module = _run([sys.executable, "-m", "analysis.report", *ARGS], tmp_path)
    assert '"A15"' in by_path
    stamp = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")  # when the report was made
    assert stamp.sub("T", by_path) == stamp.sub("T", as_module)


def test_by_path_the_package_beside_the_file_not_another(tmp_path: Path) -> None:
    """Another `analysis` first on the path (another version's, none of these modules) is not
    the one run."""
    other = tmp_path / "other" / "analysis"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('"""Another version of the package."""\n')
    (other / "_extra.py").write_text("raise SystemExit('the other analysis package')\n")
    report = _run([sys.executable, str(SCRIPT), *ARGS], tmp_path, PYTHONPATH=str(other.parent))
    assert '"A15"' in report


def test_by_path_sys_path_stays_as_it_is(tmp_path: Path) -> None:
    code = (
        "import runpy, sys\n"
        "before = list(sys.path)\n"
        f"sys.argv = [{str(SCRIPT)!r}, {', '.join(map(repr, ARGS))}]\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        "assert sys.path == before, (before, sys.path)\n"
        "print(sys.modules['analysis'].__file__, file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == str(REPO / "analysis" / "__init__.py")


def test_no_module_of_analysis_edits_sys_path() -> None:
    edits = re.compile(r"sys\.path\s*(\.\s*(insert|append|pop|remove|extend|clear)\b|\+?=(?!=)|\[)")
    found = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "analysis").rglob("*.py"))
        if edits.search(path.read_text())
    ]
    assert found == []


def test_no_name_at_the_top_of_analysis_shadows_a_module_of_the_environment() -> None:
    """Run by its path, analysis/ is first on sys.path: its top-level names (modules and
    subpackages) then hide any module of the same name. None may be one the environment has."""
    top = REPO / "analysis"
    names = sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in top.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    )
    assert {"report", "load", "analyses"} <= set(names)
    path = [p for p in sys.path if Path(p or ".").resolve() != top]
    taken = [n for n in names if importlib.machinery.PathFinder.find_spec(n, path) is not None]
    taken += [n for n in names if n in sys.builtin_module_names]
    assert taken == []
