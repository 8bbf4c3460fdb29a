"""The columnar reader (`analysis/load/columnar.py`): filters run inside SQLite's query, a large
store's spans are read in parallel parts with the same rows as one reader, and values of
another SQLite type than the first rows' (which ADBC would refuse) are read all the same.
Real SQLite stores, copies of the checked-in ones."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import duckdb
import pytest

from analysis.fleet import analyses as fleet
from analysis.load import columnar
from analysis.load.tracedb import TraceFilter, load_traces
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB, parquet_rows, q


def test_filters_run_in_sqlites_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --model, the query SQLite runs returns that model's spans only: nothing else
    leaves SQLite to be dropped afterwards."""
    queries: list[str] = []
    real = columnar.report_spans_sql

    def spy(checks: str, sub: str | None) -> str:
        queries.append(real(checks, sub))
        return queries[-1]

    monkeypatch.setattr(columnar, "report_spans_sql", spy)
    data = load_traces([LIVE_DB], TraceFilter(models=("big_cnn",)))
    assert set(data.traces["model"]) == {"big_cnn"}
    (query,) = queries
    (returned,) = q(LIVE_DB, f"SELECT count(*) FROM ({query}) WHERE _first = 0")[0]
    (selected,) = q(
        LIVE_DB,
        "SELECT count(*) FROM spans s JOIN traces t USING (trace_id) WHERE t.model = 'big_cnn' "
        "AND NOT (s.level = 'kernel' AND s.kind IN ('runtime', 'driver'))",
    )[0]
    assert returned == selected == data.span_count()
    (everything,) = q(LIVE_DB, "SELECT count(*) FROM spans")[0]
    assert returned < everything


def test_a_large_stores_spans_are_read_in_parts_with_the_sameparquet_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tmp_path / "whole"
    fleet.export_parquet([GPU_DB], whole, threads=1)
    monkeypatch.setattr(columnar, "EXPORT_PART_ROWS", 100)
    parts = tmp_path / "parts"
    counts = fleet.export_parquet([GPU_DB], parts, threads=3)
    assert len(list((parts / "spans").glob("*.parquet"))) == 3
    assert len(list((whole / "spans").glob("*.parquet"))) == 1
    for table in fleet.TABLES:
        assert parquet_rows(parts, table) == parquet_rows(whole, table)
    assert counts.spans == len(parquet_rows(whole, "spans"))


def test_values_of_another_type_than_the_first_rows_are_read(tmp_path: Path) -> None:
    """ADBC types each column after its first rows: NULL run levels first, text later; a real
    duration among integers (rounded half to even); a text idx is a damaged row."""
    db = tmp_path / "mixed.sqlite"
    shutil.copy(CPU_DB, db)
    conn = sqlite3.connect(db)
    try:
        conn.execute(
            "UPDATE spans SET run_level = NULL "
            "WHERE rowid IN (SELECT rowid FROM spans ORDER BY rowid LIMIT 40)"
        )
        (rowid, span_id, trace_id, start_ns) = conn.execute(
            "SELECT rowid, span_id, trace_id, start_ns FROM spans WHERE level = 'layer' "
            "ORDER BY rowid DESC LIMIT 1"
        ).fetchone()
        conn.execute("UPDATE spans SET duration_ns = 1234.5 WHERE rowid = ?", (rowid,))
        (text_idx,) = conn.execute(
            "SELECT span_id FROM spans WHERE level = 'layer' ORDER BY rowid DESC LIMIT 1 OFFSET 1"
        ).fetchone()
        conn.execute("UPDATE spans SET idx = 'x' WHERE span_id = ?", (text_idx,))
        conn.commit()
    finally:
        conn.close()
    out = tmp_path / "fleet"
    fleet.export_parquet([db], out)
    con = duckdb.connect()
    try:
        spans = con.sql(f"SELECT span_id, run_level, duration_ns FROM '{out}/spans/*.parquet'")
        rows = {r[0]: r for r in spans.fetchall()}
    finally:
        con.close()
    assert rows[span_id][2] == 1234
    assert text_idx not in rows
    assert sum(r[1] is None for r in rows.values()) == 40
    data = load_traces([db])  # (the loaded spans name no span id: a span by its trace, start)
    tkey = int(data.traces.loc[data.traces["trace_id"] == trace_id, "tkey"].iloc[0])
    found = (
        data.span_store()
        .cursor()
        .execute(  # (the layer level is held in DuckDB)
            "SELECT duration_ns FROM layer_spans WHERE tkey = ? AND start_ns = ?", [tkey, start_ns]
        )
    )
    assert [r[0] for r in found.fetchall()] == [1234]
    assert [r.row for r in data.bad_rows] == [text_idx]  # skipped, and named
    assert [r.reason for r in data.bad_rows] == ["not an integer ('x')"]


@pytest.mark.parametrize("orphan", ["", "5", "0" * 32, "7f", "zzz", None, b"\x00blob"])
def test_a_span_outside_the_sound_traces_is_found_wherever_its_id_sorts(
    tmp_path: Path, orphan: object
) -> None:
    """`all_in_sound_traces` seeks from one distinct trace id to the next: a span of no trace
    is found whether its id sorts first, between two traces, last, is NULL or a blob."""
    db = tmp_path / "orphan.sqlite"
    shutil.copy(GPU_DB, db)
    assert columnar.all_in_sound_traces(db)
    conn = sqlite3.connect(db)
    try:
        conn.execute(
            "INSERT INTO spans (trace_id, span_id, level, name, kind, start_ns, end_ns, "
            "duration_ns) VALUES (?, 'x1', 'model', 'm', 'model', 1, 2, 1)",
            (orphan,),
        )
        conn.commit()
        (distinct_outside,) = conn.execute(  # the same question over every index entry
            "SELECT EXISTS (SELECT 1 FROM (SELECT DISTINCT trace_id FROM spans) d WHERE NOT "
            f"coalesce(d.trace_id IN (SELECT trace_id FROM traces WHERE {columnar.trace_ok()}),"
            " 0))"
        ).fetchone()
    finally:
        conn.close()
    assert distinct_outside
    assert not columnar.all_in_sound_traces(db)
