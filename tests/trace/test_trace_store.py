"""TraceStore against real SQLite files: round trips, queries, atomicity and clear errors."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from sidecar.trace.errors import SchemaTooNewError, StoreFullError, TraceStoreError
from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace, new_span_id
from sidecar.trace.store import TraceStore
from tests.harness.traces.synthetic import make_trace

SPAN_COLUMNS = [
    "trace_id", "span_id", "parent_id", "level", "name", "kind", "start_ns", "end_ns",
    "duration_ns", "source", "run_level", "idx", "attributes",
]  # fmt: skip
TRACE_COLUMNS = [
    "trace_id", "model", "model_version", "batch_size", "runtime", "device", "sample_reason",
    "sidecar_version", "status", "error", "created_ns", "attributes",
]  # fmt: skip
STATS_COLUMNS = [
    "trace_id", "level", "iterations", "warmup", "trimmed_mean_ns", "median_ns", "min_ns",
    "max_ns", "overhead_ratio", "samples_ns",
]  # fmt: skip


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "traces.db"


def test_round_trip_keeps_every_field(db_path: Path) -> None:
    trace, spans, stats = make_trace(layers=2, kernels_per_layer=2)
    trace.status, trace.error = "error", "layer conv_1 failed: ÜNICODE ✓"
    trace.attributes["nested"] = {"a": [1, 2.5, None, True], "b": {"c": "d"}}
    spans[0].attributes["unicode"] = "名前"
    spans[2].index = 7
    with TraceStore(db_path) as store:
        store.write_trace(trace, spans, stats)
    with TraceStore(db_path, create=False) as store:  # a fresh connection reads it back
        assert store.get_trace(trace.trace_id) == trace
        back = {s.span_id: s for s in store.spans(trace.trace_id)}
        assert back == {s.span_id: s for s in spans}
        assert store.level_stats(trace.trace_id) == stats
    live = back[spans[0].span_id]
    assert live.run_level is None and live.source is Source.PROXY and live.level is Level.REQUEST
    assert isinstance(back[spans[1].span_id].level, Level)
    assert back[spans[1].span_id].duration_ns == 7_500_000  # statistic, not end - start


def test_columns_indexes_and_pragmas_match_the_documented_schema(db_path: Path) -> None:
    store = TraceStore(db_path)
    conn = sqlite3.connect(db_path)
    for table, columns in (
        ("traces", TRACE_COLUMNS),
        ("spans", SPAN_COLUMNS),
        ("level_stats", STATS_COLUMNS),
        ("schema_migrations", ["version", "name", "applied_ns"]),
        ("trace_parts", ["trace_id", "expected", "received", "absent", "deadline_ns", "state",
                         "why"]),
    ):  # fmt: skip
        assert [r[1] for r in conn.execute(f"PRAGMA table_info({table})")] == columns
    index_cols = {
        r[0]: [c[2] for c in conn.execute(f"PRAGMA index_info({r[0]})")]
        for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        if not r[0].startswith("sqlite_autoindex")
    }
    assert sorted(index_cols.values()) == sorted(
        [["trace_id"], ["trace_id", "level"], ["level", "kind"], ["name"],
         ["model", "batch_size"], ["created_ns"], ["state", "deadline_ns"]]
    )  # fmt: skip
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert store.db.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    plan = " ".join(
        str(r)
        for r in conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM spans WHERE trace_id = ? AND level = ?", ("a", "b")
        )
    )
    assert "USING INDEX" in plan
    store.close()


def test_spans_filter_by_level_and_come_back_in_timeline_order(db_path: Path) -> None:
    trace, spans, stats = make_trace(layers=3, kernels_per_layer=2)
    with TraceStore(db_path) as store:
        store.write_trace(trace, list(reversed(spans)), stats)
        layers = store.spans(trace.trace_id, Level.LAYER)
        assert [s.name for s in layers] == ["conv_0", "conv_1", "conv_2"]
        assert len(store.spans(trace.trace_id, Level.KERNEL)) == 6
        everything = store.spans(trace.trace_id)
        starts = [s.start_ns for s in everything]
        assert starts == sorted(starts) and len(everything) == len(spans)
        assert [s.level for s in store.level_stats(trace.trace_id)] == [
            Level.MODEL, Level.LAYER, Level.KERNEL,
        ]  # fmt: skip
        assert store.spans("no-such-trace") == [] and store.get_trace("no-such-trace") is None


def test_list_traces_newest_first_with_filters(db_path: Path) -> None:
    base = time.time_ns()
    with TraceStore(db_path) as store:
        for i in range(6):
            t, s, st = make_trace(model="a" if i % 2 else "b", created_ns=base + i, layers=1)
            store.write_trace(t, s, st)
        assert [t.created_ns - base for t in store.list_traces()] == [5, 4, 3, 2, 1, 0]
        assert [t.created_ns - base for t in store.list_traces(model="a")] == [5, 3, 1]
        assert [t.created_ns - base for t in store.list_traces(since_ns=base + 3)] == [5, 4, 3]
        assert [t.created_ns - base for t in store.list_traces(model="b", limit=2)] == [4, 2]
        assert store.list_traces(limit=0) == []
        with pytest.raises(ValueError, match="limit"):
            store.list_traces(limit=-1)


def test_late_spans_are_stored_before_and_after_the_trace_row(db_path: Path) -> None:
    trace, spans, stats = make_trace(layers=1, kernels_per_layer=0)
    backend = [
        Span(trace.trace_id, new_span_id(), spans[0].span_id, Level.SERVER, "compute", kind,
             100 + i, 200 + i, Source.BACKEND, index=i)
        for i, kind in enumerate(("queue", "compute_infer"))
    ]  # fmt: skip
    with TraceStore(db_path) as store:
        store.append_spans(trace.trace_id, backend[:1])  # before the trace exists
        assert store.get_trace(trace.trace_id) is None
        assert store.spans(trace.trace_id) == backend[:1]
        store.write_trace(trace, spans, stats)
        store.append_spans(trace.trace_id, backend[1:])  # after
        assert len(store.spans(trace.trace_id)) == len(spans) + 2
        assert len(store.spans(trace.trace_id, Level.SERVER)) == 2
        store.write_trace(trace, spans, stats)  # rewriting replaces, never duplicates
        assert len(store.spans(trace.trace_id)) == len(spans) + 2


def test_a_trace_is_all_or_nothing(db_path: Path) -> None:
    store = TraceStore(db_path)
    # A real SQLite failure in the middle of the span inserts: the trace row went in first.
    store.db.execute(
        "CREATE TRIGGER fail_mid_trace BEFORE INSERT ON spans WHEN NEW.name = 'conv_1' "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
    )
    trace, spans, stats = make_trace(layers=3)
    with pytest.raises(TraceStoreError, match="injected failure"):
        store.write_trace(trace, spans, stats)
    conn = sqlite3.connect(db_path)
    for table in ("traces", "spans", "level_stats"):
        assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == 0
    ok, ok_spans, ok_stats = make_trace(layers=1)
    store.write_trace(ok, ok_spans, ok_stats)  # the connection is usable afterwards
    assert store.get_trace(ok.trace_id) == ok
    store.close()


def test_records_of_another_trace_are_rejected(db_path: Path) -> None:
    trace, spans, _ = make_trace(layers=1)
    other, other_spans, _ = make_trace(layers=1)
    with TraceStore(db_path) as store:
        with pytest.raises(ValueError, match=other.trace_id):
            store.write_trace(trace, spans + other_spans[:1])
        assert store.get_trace(trace.trace_id) is None


def test_non_json_attributes_fail_clearly_and_nan_becomes_null(db_path: Path) -> None:
    trace, spans, stats = make_trace(layers=1)
    spans[1].attributes["bad"] = object()
    with TraceStore(db_path) as store:
        with pytest.raises(TraceStoreError, match="not JSON-serialisable"):
            store.write_trace(trace, spans, stats)
        spans[1].attributes["bad"] = [float("nan"), 1.0]
        store.write_trace(trace, spans, stats)
        assert store.spans(trace.trace_id, Level.MODEL)[0].attributes["bad"] == [None, 1.0]
        raw = store.db.conn.execute(
            "SELECT json_extract(attributes, '$.bad[1]') FROM spans WHERE level = 'model'"
        ).fetchone()[0]
        assert raw == 1.0  # SQLite's JSON functions can read what we wrote


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "traces.db"
    with pytest.raises(TraceStoreError) as info:
        TraceStore(path)
    assert str(path) in str(info.value) and "does not exist" in str(info.value)
    assert "--db" in str(info.value)


def test_parent_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(TraceStoreError, match="not a directory"):
        TraceStore(tmp_path / "file" / "traces.db")


def test_directory_as_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceStoreError, match="is a directory"):
        TraceStore(tmp_path)


def test_create_false_requires_an_existing_database(db_path: Path) -> None:
    with pytest.raises(TraceStoreError, match="no trace database"):
        TraceStore(db_path, create=False)
    assert not db_path.exists()


def test_a_file_that_is_not_sqlite_is_a_clear_error(db_path: Path) -> None:
    db_path.write_bytes(b"this is a text file, not a database" * 100)
    with pytest.raises(TraceStoreError, match="not a readable SQLite trace database"):
        TraceStore(db_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_is_a_clear_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(TraceStoreError, match="not writable"):
            TraceStore(ro / "traces.db")
    finally:
        ro.chmod(0o755)


def test_too_little_free_space_fails_at_start_up(db_path: Path) -> None:
    # The real free space of tmp_path's file system, checked against an impossible minimum.
    with pytest.raises(StoreFullError, match="bytes are free"):
        TraceStore(db_path, min_free_bytes=1 << 62)


def test_full_database_is_a_store_full_error_and_keeps_earlier_traces(db_path: Path) -> None:
    store = TraceStore(db_path)
    first = make_trace(layers=2)
    store.write_trace(*first)
    pages = store.db.conn.execute("PRAGMA page_count").fetchone()[0]
    store.db.conn.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own "disk full"
    big = make_trace(layers=50, pad=4000)
    with pytest.raises(StoreFullError, match="is full"):
        store.write_trace(*big)
    assert store.get_trace(first[0].trace_id) == first[0]
    assert store.get_trace(big[0].trace_id) is None
    store.close()


def test_full_disk_on_a_tiny_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); max_page_count test covers it")
    try:
        store = TraceStore(mnt / "traces.db", min_free_bytes=0)
        with pytest.raises(StoreFullError, match="is full"):
            for _ in range(100):
                store.write_trace(*make_trace(layers=20, pad=2000))
        store.close()
        (mnt / "filler").write_bytes(b"")  # the file system is full: start-up refuses clearly
        with pytest.raises(StoreFullError, match="bytes are free"):
            TraceStore(mnt / "other.db")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_newer_schema_is_refused(db_path: Path) -> None:
    TraceStore(db_path).close()
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(SchemaTooNewError, match="upgrade xsp-sidecar"):
        TraceStore(db_path)


def test_closed_store_says_so(db_path: Path) -> None:
    store = TraceStore(db_path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(TraceStoreError, match="closed"):
        store.get_trace("x")
    t = Trace(trace_id="x", model="m", created_ns=1)
    with pytest.raises(TraceStoreError, match="closed"):
        store.write_trace(t, [], [LevelStats("x", Level.MODEL, 1, 0, 1, 1, 1, 1, 1.0)])
