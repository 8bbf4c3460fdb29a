"""A report refuses a store written with a newer trace schema than it knows, in one line, and
reads older ones as before."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.load.store_file import SchemaTooNewError, connect_ro
from sidecar.trace.schema import SCHEMA_VERSION
from tests.analysis.helpers import CPU_DB, REPO

SCRIPT = REPO / "analysis" / "report.py"


def _store(tmp_path: Path, version: int) -> Path:
    """A copy of the CPU scenario's store with its `user_version` set to `version`."""
    db = tmp_path / "traces.db"
    shutil.copy(CPU_DB, db)
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()
    return db


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_the_scenario_store_is_a_version_this_analysis_reads() -> None:
    """The checked-in stores were written at version 1 (before `trace_parts`): an older
    version, read as it was; a store the sidecar writes today is `SCHEMA_VERSION`."""
    conn = connect_ro(CPU_DB)
    assert 1 <= conn.execute("PRAGMA user_version").fetchone()[0] <= SCHEMA_VERSION
    conn.close()


@pytest.mark.parametrize("command", [[], ["export-parquet", "--out", "OUT"]])
def test_a_newer_store_is_refused_in_one_line(tmp_path: Path, command: list[str]) -> None:
    db = _store(tmp_path, SCHEMA_VERSION + 1)
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    out = _report(*args[:1], str(db), *args[1:])
    assert out.returncode == 1, out.stderr
    assert out.stdout == ""
    assert out.stderr == (
        f"report.py: {db} has trace schema version {SCHEMA_VERSION + 1}; this analysis reads "
        f"versions up to {SCHEMA_VERSION}: upgrade xsp-sidecar\n"
    )


def test_connect_refuses_a_newer_store_and_reads_an_older_one(tmp_path: Path) -> None:
    with pytest.raises(SchemaTooNewError, match=f"version {SCHEMA_VERSION + 1};"):
        connect_ro(_store(tmp_path, SCHEMA_VERSION + 1))
    conn = connect_ro(_store(tmp_path, SCHEMA_VERSION - 1))
    assert conn.execute("SELECT COUNT(*) FROM traces").fetchone()[0] > 0
    conn.close()


def test_an_older_store_reports_as_before(tmp_path: Path) -> None:
    db = _store(tmp_path, SCHEMA_VERSION)
    now = _report(str(db), "--format", "json")
    _store(tmp_path, SCHEMA_VERSION - 1)  # the same file, one version older
    old = _report(str(db), "--format", "json")
    assert now.returncode == 0 and old.returncode == 0, old.stderr
    reports = [json.loads(out.stdout) for out in (now, old)]
    for doc in reports:
        del doc["meta"]["generated"]  # when it ran
    assert reports[0] == reports[1]
