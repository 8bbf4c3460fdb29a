"""`report.py` starts reading the first store's spans before it imports the analyses
(`columnar.SpanBatches.started`): the spans so read are the loader's own, and a store the
reads cannot start on is still named by the loader. Real SQLite, the checked-in stores."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.analyses.common import Frames
from analysis.keys import ANALYSIS_KEYS
from analysis.load import columnar
from analysis.load.tracedb import TraceDatabaseError, TraceFilter, load_traces
from analysis.relations.kernel_rows import kernel_rows
from analysis.trace_analysis import ANALYSES
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB


def test_the_command_lines_keys_are_the_analyses_in_order() -> None:
    assert tuple(ANALYSES) == ANALYSIS_KEYS


@pytest.mark.parametrize(
    "flt",
    [TraceFilter(), TraceFilter(models=("big_cnn", "tiny_resnet"))],
    ids=["all", "some models"],
)
@pytest.mark.parametrize("rows", [37, 10**9], ids=["batches", "one batch"])
def test_spans_read_before_the_load_are_the_loaders_own(
    flt: TraceFilter, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(columnar, "REPORT_BATCH_ROWS", rows)
    for db in (GPU_DB, LIVE_DB):
        first = columnar.SpanBatches.started(db, flt)
        assert first is not None
        early = load_traces([db, CPU_DB], flt, first)
        late = load_traces([db, CPU_DB], flt)
        assert late.span_count() > 100
        pd.testing.assert_frame_equal(early.spans, late.spans)
        a, b = kernel_rows(Frames(early)), kernel_rows(Frames(late))
        for relation in ("kernels", "layers"):  # the levels held in DuckDB
            sql = f"SELECT * FROM {relation} ORDER BY row"
            pd.testing.assert_frame_equal(a.query(sql), b.query(sql), obj=relation)
        pd.testing.assert_frame_equal(early.traces, late.traces)
        assert early.bad_rows == late.bad_rows


def test_reads_that_cannot_start_leave_the_loader_to_name_the_store(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    assert columnar.SpanBatches.started(missing, TraceFilter()) is None
    not_a_store = tmp_path / "notes.db"
    not_a_store.write_text("not SQLite")
    assert columnar.SpanBatches.started(not_a_store, TraceFilter()) is None
    with pytest.raises(TraceDatabaseError, match=r"notes\.db"):
        load_traces([not_a_store])
