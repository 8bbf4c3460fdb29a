"""`report.py export-parquet` as a process: it starts without pandas and the analyses
(`analysis.fleet.export`), writes what `export_parquet` writes and says so, and names a
missing store. Real stores (the checked-in ones), real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analysis.fleet import analyses as fleet
from tests.analysis.helpers import GPU_DB, LIVE_DB, parquet_rows

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "analysis" / "report.py"


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPORT), *args], capture_output=True, text=True, timeout=120
    )


def test_the_export_module_imports_neither_pandas_nor_the_analyses() -> None:
    code = "import sys, analysis.fleet.export; print(' '.join(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    loaded = set(run.stdout.split())
    assert "duckdb" in loaded and "pandas" not in loaded
    assert {m for m in loaded if m.startswith("analysis.")} == {
        "analysis.load", "analysis.load.columnar", "analysis.load.damage",
        "analysis.load.store_file", "analysis.analyses", "analysis.analyses.fidelity_attrs",
        "analysis.fleet", "analysis.fleet.export", "analysis.tuning",
    }  # fmt: skip


def test_the_command_writes_what_export_parquet_writes(tmp_path: Path) -> None:
    run = _report("export-parquet", str(GPU_DB), str(LIVE_DB), "--out", str(tmp_path / "cli"))
    assert run.returncode == 0, run.stderr
    counts = fleet.export_parquet([GPU_DB, LIVE_DB], tmp_path / "lib")
    assert f"wrote {counts.traces} traces, {counts.spans} spans" in run.stderr
    for table in fleet.TABLES:
        assert parquet_rows(tmp_path / "cli", table) == parquet_rows(tmp_path / "lib", table)


def test_a_missing_store_is_named(tmp_path: Path) -> None:
    run = _report("export-parquet", str(tmp_path / "none.db"), "--out", str(tmp_path / "x"))
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"report.py: {tmp_path / 'none.db'}: no such file (expected a trace database)"
    )
    run = _report("export-parquet", str(GPU_DB))
    assert run.returncode == 2 and "--out" in run.stderr


def test_each_reader_makes_one_duckdb_for_all_its_jobs_and_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DuckDB database costs 11 ms to make: three stores' nine jobs, two readers, two
    databases (not nine), closed at the end; the rows those of one reader alone."""
    from analysis.fleet import export as fleet_export

    made: list[duckdb.DuckDBPyConnection] = []
    real = fleet_export.reader_duckdb

    def counted() -> duckdb.DuckDBPyConnection:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(fleet_export, "reader_duckdb", counted)
    stores = [GPU_DB, LIVE_DB, GPU_DB]
    two = fleet_export.export_parquet(stores, tmp_path / "two", threads=2)
    assert 1 <= len(made) <= 2
    for con in made:
        with pytest.raises(duckdb.ConnectionException):
            con.execute("SELECT 1")
    assert two == fleet_export.export_parquet(stores, tmp_path / "one", threads=1)
    for table in fleet_export.TABLES:
        assert parquet_rows(tmp_path / "two", table) == parquet_rows(tmp_path / "one", table)
