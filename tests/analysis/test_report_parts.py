"""The single-store report's loader reads a large store in parallel rowid ranges: the same
spans in the same order, and the same analyses, as one reader. Real SQLite, the checked-in
stores."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis import columnar
from analysis.trace_analysis import TraceAnalysis
from analysis.tracedb import TraceFilter, load_traces
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB


@pytest.mark.parametrize("db", [CPU_DB, GPU_DB, LIVE_DB], ids=lambda p: Path(p).parent.name)
def test_spans_read_in_parts_are_those_of_one_reader(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts: list[int] = []
    real = columnar.span_ranges

    def spy(path: str | Path, n: int) -> list[tuple[int, int] | None]:
        parts.append(len(ranges := real(path, max(n, 3))))
        return ranges

    whole = load_traces([db])
    monkeypatch.setattr(columnar, "PART_ROWS", 50)
    monkeypatch.setattr(columnar, "span_ranges", spy)
    split = load_traces([db])
    assert parts == [3]
    pd.testing.assert_frame_equal(split.spans, whole.spans)
    assert split.bad_rows == whole.bad_rows
    one = TraceAnalysis(whole).run_all()
    for key, res in TraceAnalysis(split).run_all().items():
        pd.testing.assert_frame_equal(res.table, one[key].table)


def test_a_filtered_read_keeps_one_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite walks the selected traces' index for a filter: one reader keeps its order."""
    monkeypatch.setattr(columnar, "PART_ROWS", 50)
    monkeypatch.setattr(columnar.os, "cpu_count", lambda: 3)
    data = load_traces([LIVE_DB], TraceFilter(models=("big_cnn",)))
    assert set(data.traces["model"]) == {"big_cnn"}
    monkeypatch.setattr(columnar, "PART_ROWS", 10**9)
    one = load_traces([LIVE_DB], TraceFilter(models=("big_cnn",)))
    pd.testing.assert_frame_equal(data.spans, one.spans)
