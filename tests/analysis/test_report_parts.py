"""The single-store report's loader reads a store's spans in batches of rowids, two readers
ahead of the analyses: the same spans in the same order, and the same analyses and report,
as one reader over the whole store. Real SQLite, the checked-in stores."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from analysis.analyses.common import Frames
from analysis.load import columnar, tracedb
from analysis.load.tracedb import TraceData, TraceFilter, load_traces
from analysis.relations.kernel_rows import kernel_rows
from analysis.report import main
from analysis.trace_analysis import TraceAnalysis
from tests.analysis.golden import damage_store
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """A copy of the CPU store with damaged rows (skipped and named), as the goldens'."""
    db = tmp_path / "damaged.sqlite"
    shutil.copy(CPU_DB, db)
    damage_store(db)
    return db


def _batches(monkeypatch: pytest.MonkeyPatch, rows: int) -> list[int]:
    """Force batches of `rows` rowids; returns the list the loader's batch counts go to."""
    counts: list[int] = []
    real = columnar.batch_ranges

    def spy(path: str | Path, n: int) -> list[tuple[int, int] | None]:
        counts.append(len(ranges := real(path, n)))
        return ranges

    monkeypatch.setattr(columnar, "REPORT_BATCH_ROWS", rows)
    monkeypatch.setattr(columnar, "batch_ranges", spy)
    return counts


def _kernels(data: TraceData) -> pd.DataFrame:
    return kernel_rows(Frames(data)).query("SELECT * FROM kernels ORDER BY row")


@pytest.mark.parametrize("rest_rows", [7, tracedb.REST_ROWS], ids=["rest-of-7", "rest-default"])
@pytest.mark.parametrize("name", ["cpu", "gpu", "live", "damaged"])
def test_spans_read_in_batches_are_those_of_one_reader(
    name: str, rest_rows: int, damaged: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the rows taken the pandas way gathered a few batches' at a time
    (`REST_ROWS`: 7), not only all at the end."""
    db = {"cpu": CPU_DB, "gpu": GPU_DB, "live": LIVE_DB, "damaged": damaged}[name]
    whole = load_traces([db])
    monkeypatch.setattr(tracedb, "REST_ROWS", rest_rows)
    counts = _batches(monkeypatch, 37)
    monkeypatch.setattr(columnar.os, "cpu_count", lambda: 3)
    split = load_traces([db])
    assert counts and counts[0] > 3  # more batches than readers
    pd.testing.assert_frame_equal(split.spans, whole.spans)
    pd.testing.assert_frame_equal(_kernels(split), _kernels(whole))
    assert split.bad_rows == whole.bad_rows
    one = TraceAnalysis(whole).run_all()
    for key, res in TraceAnalysis(split).run_all().items():
        pd.testing.assert_frame_equal(res.table, one[key].table)


def test_the_report_of_a_store_read_in_batches_is_that_of_one_batch(
    damaged: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The whole report (findings, every analysis, the damaged rows), two stores at once."""

    def report(out: Path) -> str:
        assert main([str(GPU_DB), str(damaged), "--format", "json", "--out", str(out)]) == 0
        text = (out / "report.json").read_text()
        return "\n".join(line for line in text.splitlines() if '"generated"' not in line)

    counts = _batches(monkeypatch, 10**9)
    whole = report(tmp_path / "whole")
    assert counts == [1, 1]
    counts = _batches(monkeypatch, 29)
    split = report(tmp_path / "split")
    assert min(counts) > 2
    assert split == whole


def test_a_filtered_read_keeps_one_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite walks the selected traces' index for a filter: one reader keeps its order."""
    counts = _batches(monkeypatch, 37)
    data = load_traces([LIVE_DB], TraceFilter(models=("big_cnn",)))
    assert set(data.traces["model"]) == {"big_cnn"}
    assert counts == []
    monkeypatch.setattr(columnar, "REPORT_BATCH_ROWS", 10**9)
    one = load_traces([LIVE_DB], TraceFilter(models=("big_cnn",)))
    pd.testing.assert_frame_equal(data.spans, one.spans)


_HOLD_LOCK = """
import sqlite3, sys, time
writer = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0)
while True:  # (until the batch readers already reading let go of the store)
    try:
        writer.execute("BEGIN EXCLUSIVE")
        break
    except sqlite3.OperationalError:
        time.sleep(0.01)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_batch_reader_waits_for_a_lock_on_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that finds the store locked (here: another process's exclusive lock, taken
    as the first batch starts and let go a moment later) waits for it, instead of failing
    the report with 'database is locked'."""
    db = tmp_path / "cpu.sqlite"  # (a rollback-journal store: the lock keeps readers out)
    shutil.copy(CPU_DB, db)
    whole = load_traces([db])
    _batches(monkeypatch, 37)
    real = columnar._report_part
    holders: list[subprocess.Popen[str]] = []

    first = threading.Lock()  # (two readers start at once: one takes the lock)

    def locking(path: Path, uri: str, query: str, threads: int | None) -> object:
        with first:
            if not holders:
                cmd = [sys.executable, "-c", _HOLD_LOCK, str(db), "0.5"]
                holders.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
                assert holders[0].stdout is not None
                assert holders[0].stdout.readline().strip() == "locked"
        return real(path, uri, query, threads)

    monkeypatch.setattr(columnar, "_report_part", locking)
    split = load_traces([db])
    assert holders and holders[0].wait() == 0
    pd.testing.assert_frame_equal(split.spans, whole.spans)
