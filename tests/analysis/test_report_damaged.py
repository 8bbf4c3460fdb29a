"""A damaged trace store: bad rows are skipped, counted and named; good numbers stay as they
are; nothing crashes and no RuntimeWarning escapes. The damage is done with real SQLite
UPDATEs on copies of the checked-in stores."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from analysis.trace_analysis import TraceAnalysis
from tests.analysis.helpers import CPU_DB, GPU_DB, REPO, close, q, tmean

SCRIPT = REPO / "analysis" / "report.py"


def _copy(src: Path, tmp_path: Path, name: str = "damaged.sqlite") -> Path:
    dst = tmp_path / name
    shutil.copy(src, dst)
    return dst


def _exec(db: Path, sql: str, params: tuple[object, ...] = ()) -> None:
    conn = sqlite3.connect(db)
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def _layer_spans(db: Path, batch: int, name: str) -> list[tuple[str, str, int]]:
    """(trace id, span id, duration) of one layer's L-run spans at one batch size."""
    return q(
        db,
        "SELECT s.trace_id, s.span_id, s.duration_ns FROM spans s JOIN traces t "
        "USING (trace_id) WHERE t.batch_size = ? AND s.level = 'layer' "
        "AND s.run_level = 'layer' AND s.name = ? ORDER BY s.trace_id",
        (batch, name),
    )


@pytest.fixture()
def damaged(tmp_path: Path) -> tuple[Path, dict[str, tuple[str, str]]]:
    """The CPU store with three durations broken (NULL, negative, text), one attribute text
    that is not JSON and one level_stats row without its statistic."""
    db = _copy(CPU_DB, tmp_path)
    rows = _layer_spans(db, 1, "Relu_0_out_nchwc")
    assert len(rows) == 5
    broken = {
        "NULL": rows[0][:2],
        "negative": rows[1][:2],
        "not a number": rows[2][:2],
    }
    _exec(db, "UPDATE spans SET duration_ns = NULL WHERE span_id = ?", (rows[0][1],))
    _exec(db, "UPDATE spans SET duration_ns = -16000 WHERE span_id = ?", (rows[1][1],))
    _exec(db, "UPDATE spans SET duration_ns = 'abc' WHERE span_id = ?", (rows[2][1],))
    # a layer span of another batch size whose attribute text is not JSON
    (tid, sid) = q(
        db,
        "SELECT s.trace_id, s.span_id FROM spans s JOIN traces t USING (trace_id) "
        "WHERE t.batch_size = 2 AND s.level = 'layer' AND s.name = 'MaxPool_0' LIMIT 1",
    )[0]
    _exec(db, "UPDATE spans SET attributes = '{\"op_type\": \"MaxPool\", oops' WHERE span_id = ?",
          (sid,))  # fmt: skip
    broken["not valid JSON"] = (tid, sid)
    (tid,) = q(db, "SELECT trace_id FROM traces WHERE batch_size = 4 LIMIT 1")[0]
    _exec(
        db,
        "UPDATE level_stats SET trimmed_mean_ns = NULL WHERE trace_id = ? AND level = 'layer'",
        (tid,),
    )
    broken["level_stats"] = (tid, "layer")
    return db, broken


def _analyse(db: Path) -> TraceAnalysis:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # none may escape
        ta = TraceAnalysis.from_paths([db])
        ta.run_all()
        ta.findings()
    return ta


def test_bad_rows_are_named_skipped_and_counted(
    damaged: tuple[Path, dict[str, tuple[str, str]]],
) -> None:
    db, broken = damaged
    ta = _analyse(db)
    rows = ta.get_skipped_rows()
    assert len(rows) == 5 and set(rows["action"]) == {"row skipped"}
    by_span = {(r.trace_id, r.row): r for r in rows.itertuples()}
    null = by_span[broken["NULL"]]
    assert (null.table, null.column, null.reason) == ("spans", "duration_ns", "NULL")
    neg = by_span[broken["negative"]]
    assert neg.column == "duration_ns" and neg.reason == "negative (-16000)"
    text = by_span[broken["not a number"]]
    assert text.column == "duration_ns" and "not a number ('abc')" in text.reason
    js = by_span[broken["not valid JSON"]]
    assert js.column == "attributes" and "not valid JSON" in js.reason
    stats = by_span[broken["level_stats"]]
    assert (stats.table, stats.column, stats.reason) == ("level_stats", "trimmed_mean_ns", "NULL")
    # the spans are gone from the data, every trace is still there
    assert len(ta.data.traces) == 15
    # (the loaded spans name no span id: the four damaged spans are missing from the count)
    assert ta.data.span_count() == _analyse(CPU_DB).data.span_count() - 4


def test_good_numbers_are_unchanged(damaged: tuple[Path, dict[str, tuple[str, str]]]) -> None:
    db, broken = damaged
    ta = _analyse(db)
    clean = _analyse(CPU_DB)
    a2, a2_clean = ta.get_layer_table(), clean.get_layer_table()
    key = ["batch_size", "name"]
    merged = a2.merge(a2_clean, on=key, suffixes=("", "_clean"))
    assert len(merged) == len(a2_clean)
    hit = {(1, "Relu_0_out_nchwc"), (2, "MaxPool_0")}
    for row in merged.itertuples():
        if (row.batch_size, row.name) in hit:
            continue
        assert close(row.latency_ms, row.latency_ms_clean), (row.batch_size, row.name)
    # the damaged layer: the trimmed mean of its two sound traces only (plain SQL)
    good = [
        d for t, s, d in _layer_spans(CPU_DB, 1, "Relu_0_out_nchwc")
        if s not in {broken[k][1] for k in ("NULL", "negative", "not a number")}
    ]  # fmt: skip
    assert len(good) == 2
    relu = a2[(a2["batch_size"] == 1) & (a2["name"] == "Relu_0_out_nchwc")].iloc[0]
    assert close(relu["latency_ms"], tmean(good) / 1e6) and relu["n_traces"] == 2
    pool = a2[(a2["batch_size"] == 2) & (a2["name"] == "MaxPool_0")].iloc[0]
    assert pool["n_traces"] == 4
    # model latency (A1) comes from the M runs, which are intact
    a1, a1_clean = ta.get_model_throughput(), clean.get_model_throughput()
    assert all(close(a, b) for a, b in zip(a1["latency_ms"], a1_clean["latency_ms"], strict=True))


def test_damaged_trace_rows_drop_their_trace(tmp_path: Path) -> None:
    db = _copy(CPU_DB, tmp_path)
    (bad_attr, bad_batch, bad_peak) = [t for (t,) in q(db, "SELECT trace_id FROM traces")][:3]
    _exec(db, "UPDATE traces SET attributes = '{broken' WHERE trace_id = ?", (bad_attr,))
    _exec(db, "UPDATE traces SET batch_size = 'two' WHERE trace_id = ?", (bad_batch,))
    _exec(
        db,
        "UPDATE traces SET attributes = json_set(attributes, '$.peak_flops_per_s', 'fast') "
        "WHERE trace_id = ?",
        (bad_peak,),
    )
    ta = _analyse(db)
    rows = {(r.trace_id, r.column): r for r in ta.get_skipped_rows().itertuples()}
    assert rows[(bad_attr, "attributes")].action == "row skipped"
    assert "not a positive integer ('two')" in rows[(bad_batch, "batch_size")].reason
    assert rows[(bad_peak, "attributes.peak_flops_per_s")].action == "value ignored"
    every = {t for (t,) in q(db, "SELECT trace_id FROM traces")}
    assert set(ta.data.traces["trace_id"]) == every - {bad_attr, bad_batch}
    assert not ta.data.spans["trace_id"].isin([bad_attr, bad_batch]).any()


def test_kernel_level_damage(tmp_path: Path) -> None:
    db = _copy(GPU_DB, tmp_path)
    (_tid, sid, start) = q(
        db, "SELECT trace_id, span_id, start_ns FROM spans WHERE level='kernel' AND "
        "kind='kernel' LIMIT 1"
    )[0]  # fmt: skip
    _exec(db, "UPDATE spans SET end_ns = ? WHERE span_id = ?", (start - 5, sid))
    (sid2,) = q(db, "SELECT span_id FROM spans WHERE level='kernel' AND kind='kernel' "
                "AND span_id != ? LIMIT 1", (sid,))[0]  # fmt: skip
    _exec(db, "UPDATE spans SET attributes = json_set(attributes, '$.flops', 'lots') "
          "WHERE span_id = ?", (sid2,))  # fmt: skip
    ta = _analyse(db)
    rows = {r.row: r for r in ta.get_skipped_rows().itertuples()}
    assert rows[sid].column == "end_ns" and "before start_ns" in rows[sid].reason
    assert rows[sid2].column == "attributes.flops" and rows[sid2].action == "value ignored"
    assert ta.result("A8").ok and ta.result("time_breakdown").ok


@pytest.mark.parametrize("fmt", ["text", "markdown", "html", "json", "csv"])
def test_cli_names_skipped_rows_in_every_format(
    damaged: tuple[Path, dict[str, tuple[str, str]]], tmp_path: Path, fmt: str
) -> None:
    db, broken = damaged
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", str(SCRIPT), str(db), "--format", fmt,
         "--out", str(out), "--no-plots"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr
    assert "5 damaged rows skipped (1 in level_stats, 4 in spans)" in res.stderr
    for tid, sid in broken.values():
        assert tid in res.stderr and sid in res.stderr
    if fmt == "csv":
        skipped = (out / "skipped_rows.csv").read_text()
        assert all(sid in skipped for _, sid in broken.values())
        return
    text = next(out.iterdir()).read_text()
    if fmt == "json":
        doc = json.loads(text)
        assert doc["skipped_rows"]["count"] == 5
        named = {(r["trace_id"], r["row"], r["column"]) for r in doc["skipped_rows"]["rows"]}
        assert (*broken["NULL"], "duration_ns") in named
        assert doc["meta"]["skipped_rows"].startswith("5 damaged rows skipped")
        return
    assert "kipped rows" in text  # "skipped rows" / "Skipped rows" heading
    for _tid, sid in broken.values():
        assert sid in text
