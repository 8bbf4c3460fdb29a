"""Retention by count, size and age on real SQLite files."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from sidecar.trace.retention import RetentionPolicy, used_bytes
from sidecar.trace.spans import Level, Source, Span, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.traces.synthetic import make_trace

HOUR_NS = 3600 * 10**9


def _fill(store: TraceStore, n: int, *, start_ns: int, step_ns: int = 1, pad: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        trace, spans, stats = make_trace(created_ns=start_ns + i * step_ns, layers=2, pad=pad)
        store.write_trace(trace, spans, stats)
        ids.append(trace.trace_id)
    return ids


def _counts(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        return {
            t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("traces", "spans", "level_stats")
        }
    finally:
        conn.close()


def test_retention_by_count_keeps_the_newest_whole_traces(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with TraceStore(path) as store:
        ids = _fill(store, 10, start_ns=time.time_ns())
        per_trace = _counts(path)["spans"] // 10
        assert store.apply_retention(RetentionPolicy(max_traces=4)) == 6
        assert [t.trace_id for t in store.list_traces()] == ids[:-5:-1]
        for old in ids[:6]:
            assert store.get_trace(old) is None and store.spans(old) == []
            assert store.level_stats(old) == []
        for new in ids[6:]:
            assert len(store.spans(new)) == per_trace and len(store.level_stats(new)) == 3
        assert _counts(path) == {"traces": 4, "spans": 4 * per_trace, "level_stats": 12}
        assert store.apply_retention(RetentionPolicy(max_traces=4)) == 0  # already within


def test_retention_by_age_includes_orphan_late_spans(tmp_path: Path) -> None:
    now = time.time_ns()
    with TraceStore(tmp_path / "t.db") as store:
        old = _fill(store, 5, start_ns=now - 2 * HOUR_NS)
        new = _fill(store, 5, start_ns=now - 60 * 10**9)

        def orphan(at_ns: int) -> str:
            tid = new_trace_id()
            span = Span(tid, new_span_id(), None, Level.SERVER, "compute", "compute",
                        at_ns, at_ns + 1000, Source.BACKEND)  # fmt: skip
            store.append_spans(tid, [span])
            return tid

        old_orphan, new_orphan = orphan(now - 3 * HOUR_NS), orphan(now - 10**9)
        assert store.apply_retention(RetentionPolicy(max_age_s=3600), now_ns=now) == 6
        assert {t.trace_id for t in store.list_traces()} == set(new)
        assert all(store.get_trace(t) is None for t in old)
        assert store.spans(old_orphan) == [] and len(store.spans(new_orphan)) == 1


def test_retention_by_size_shrinks_the_database_and_deletes_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with TraceStore(path) as store:
        ids = _fill(store, 40, start_ns=time.time_ns(), pad=1500)
        before = used_bytes(store.db)
        pages_before = store.db.conn.execute("PRAGMA page_count").fetchone()[0]
        limit = before // 2
        deleted = store.apply_retention(RetentionPolicy(max_bytes=limit))
        assert used_bytes(store.db) <= limit
        assert 10 <= deleted < 40  # about half, not everything
        kept = {t.trace_id for t in store.list_traces(limit=100)}
        assert kept == set(ids[deleted:])  # the newest survive
        # Freed pages went back to the file system (auto_vacuum=INCREMENTAL).
        assert store.db.conn.execute("PRAGMA page_count").fetchone()[0] < pages_before * 0.6
        assert store.db.conn.execute("PRAGMA freelist_count").fetchone()[0] == 0


def test_combined_policy_and_unlimited_policy(tmp_path: Path) -> None:
    now = time.time_ns()
    with TraceStore(tmp_path / "t.db") as store:
        _fill(store, 3, start_ns=now - 2 * HOUR_NS)
        newest = _fill(store, 6, start_ns=now - 10**9)
        assert store.apply_retention(RetentionPolicy()) == 0
        policy = RetentionPolicy(max_traces=4, max_age_s=3600, max_bytes=10**9)
        assert store.apply_retention(policy, now_ns=now) == 5
        assert [t.trace_id for t in store.list_traces()] == newest[:1:-1]


@pytest.mark.parametrize(
    "kwargs", [{"max_traces": -1}, {"max_bytes": 0}, {"max_age_s": 0.0}, {"max_age_s": -5}]
)
def test_invalid_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]
