"""TraceWriter: a background thread with a bounded queue that never raises into callers."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from sidecar.trace import parts as trace_parts
from sidecar.trace.errors import StoreFullError, TraceStoreError
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.spans import Level, Source, Span, new_span_id
from sidecar.trace.store import PendingWrite, TraceStore
from sidecar.trace.writer import TraceWriter
from tests.harness.traces.memory import InMemoryTraceStore
from tests.harness.traces.synthetic import make_trace


def _wait_until(cond: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_reader_reads_while_the_writer_thread_writes(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    writer = TraceWriter(path, batch_max=8)
    reader = TraceStore(path)  # its own connection, used from another thread
    n = 300
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read_loop() -> None:
        try:
            while not done.is_set():
                traces = reader.list_traces(limit=n)
                seen.append(len(traces))
                for t in traces[:5]:  # a committed trace is always complete
                    assert len(reader.spans(t.trace_id)) == t.attributes["span_count"]
                    assert len(reader.level_stats(t.trace_id)) == 3
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    ids = []
    for _ in range(n):
        trace, spans, stats = make_trace(layers=4, kernels_per_layer=3)
        while not writer.submit(trace, spans, stats):  # the test wants every trace written
            time.sleep(0.001)
        ids.append(trace.trace_id)
        if len(ids) % 10 == 0:
            time.sleep(0.002)  # let the reader interleave with the writes
    assert writer.flush(timeout=60)
    done.set()
    thread.join()
    writer.close()
    assert errors == [], errors  # no "database is locked", no partial trace
    assert seen == sorted(seen) and any(0 < k < n for k in seen)  # read during the writes
    assert writer.written == n and writer.failed == 0
    assert {t.trace_id for t in reader.list_traces(limit=n)} == set(ids)
    reader.close()


def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    writer = TraceWriter(path, queue_size=3, batch_max=64)
    # Another connection holds the write lock, so the writer thread blocks inside its write.
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    assert writer.submit(*make_trace(layers=1))
    assert _wait_until(lambda: writer.queue_depth == 0)  # taken; now waiting for the lock
    results = [writer.submit(*make_trace(layers=1)) for _ in range(8)]
    assert results == [True] * 3 + [False] * 5
    assert writer.dropped == 5 and writer.queue_depth == 3
    blocker.execute("ROLLBACK")
    assert writer.flush(timeout=10)
    assert writer.written == 4 and writer.failed == 0 and writer.dropped == 5
    writer.close()
    assert writer.submit(*make_trace(layers=1)) is False  # closed: refused and counted
    assert writer.dropped == 6


def test_writer_survives_bad_traces_and_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    errors: list[Exception] = []
    writer = TraceWriter(path, batch_max=16, on_error=errors.append)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "CREATE TRIGGER poison BEFORE INSERT ON traces WHEN NEW.model = 'poison' "
        "BEGIN SELECT RAISE(ABORT, 'poisoned trace'); END"
    )
    good = [make_trace(layers=1) for _ in range(10)]
    unjsonable = make_trace(layers=1)
    unjsonable[1][0].attributes["oops"] = object()
    batch = [*good[:5], make_trace(model="poison", layers=1), unjsonable, *good[5:]]
    for parts in batch:
        assert writer.submit(*parts)
    assert writer.flush(timeout=10)
    assert writer.failed == 2 and writer.written == 10
    assert len(errors) == 2 and all(isinstance(e, TraceStoreError) for e in errors)
    assert any("poisoned trace" in str(e) for e in errors)
    assert any("JSON" in str(e) for e in errors)
    assert writer.alive
    late = make_trace(layers=1)
    assert writer.submit(*late) and writer.flush(timeout=10)
    writer.close()
    with TraceStore(path) as store:
        stored = {t.trace_id for t in store.list_traces()}
    assert stored == {p[0].trace_id for p in [*good, late]}


def test_writer_survives_a_full_store_and_recovers(tmp_path: Path) -> None:
    errors: list[Exception] = []
    store = TraceStore(tmp_path / "t.db")
    writer = TraceWriter(store, on_error=errors.append)
    pages = store.db.conn.execute("PRAGMA page_count").fetchone()[0]
    store.db.conn.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's "disk is full"
    for _ in range(5):
        assert writer.submit(*make_trace(layers=30, pad=2000))
    assert writer.flush(timeout=10)
    assert writer.failed == 5 and writer.written == 0
    assert errors and all(isinstance(e, StoreFullError) for e in errors)
    store.db.conn.execute("PRAGMA max_page_count = 1073741823")  # space freed
    assert writer.submit(*make_trace(layers=2)) and writer.flush(timeout=10)
    assert writer.written == 1
    writer.close()


def test_a_bad_path_fails_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(TraceStoreError, match="does not exist"):
        TraceWriter(tmp_path / "missing" / "t.db")


def test_late_spans_and_retention_run_in_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    writer = TraceWriter(path, retention=RetentionPolicy(max_traces=5), retention_interval_s=0)
    base = time.time_ns()
    parts = [make_trace(created_ns=base + i, layers=1) for i in range(12)]
    for p in parts:
        assert writer.submit(*p)
    newest = parts[-1][0]
    late = Span(newest.trace_id, new_span_id(), None, Level.SERVER, "queue", "queue", 1, 2,
                Source.BACKEND)  # fmt: skip
    assert writer.submit_spans(newest.trace_id, [late])
    assert writer.flush(timeout=10)
    assert _wait_until(lambda: writer.retention_deleted >= 7)  # the idle pass applies it
    writer.close()
    with TraceStore(path) as store:
        assert [t.trace_id for t in store.list_traces()] == [p[0].trace_id for p in parts[:-6:-1]]
        assert late in store.spans(newest.trace_id, Level.SERVER)


def test_writer_over_the_in_memory_store() -> None:
    memory = InMemoryTraceStore()
    with TraceWriter(memory) as writer:
        parts = make_trace(layers=2)
        assert writer.submit(*parts) and writer.flush(timeout=5)
        assert memory.get_trace(parts[0].trace_id) == parts[0]
    assert writer.written == 1
    with pytest.raises(TraceStoreError, match="closed"):
        memory.get_trace(parts[0].trace_id)  # the writer owned and closed it


def test_an_assembly_event_alone_is_written_but_not_counted(tmp_path: Path) -> None:
    """The trace assembler's events (`submit_write`) are no traces: `written` and `dropped`
    count records only."""
    trace, spans, stats = make_trace(layers=1)
    with TraceWriter(tmp_path / "t.db") as writer:
        expected = trace_parts.Expected(trace.trace_id, frozenset(trace_parts.Part), 1)
        event = trace_parts.Event(expected)
        assert writer.submit_write(PendingWrite(trace.trace_id, assembly=event))
        assert writer.submit(trace, spans, stats)
        assert writer.flush(5)
        assert (writer.written, writer.dropped, writer.failed) == (1, 0, 0)
    with sqlite3.connect(tmp_path / "t.db") as conn:
        state = trace_parts.load(conn, trace.trace_id)
    assert state is not None and state.state == trace_parts.PENDING  # the live parts are due


def test_a_failed_assembly_event_alone_does_not_report_the_store_failing(tmp_path: Path) -> None:
    """The records' writes say whether the store works (the sampler backs off on them)."""
    errors: list[Exception] = []
    trace, spans, _ = make_trace(layers=1)
    with TraceWriter(tmp_path / "t.db", on_error=errors.append) as writer:
        writer.store.close()  # every write fails from now on
        event = trace_parts.Event(received=frozenset({trace_parts.Part.REQUEST}))
        assert writer.submit_write(PendingWrite(trace.trace_id, assembly=event))
        assert writer.flush(5)
        assert errors == [] and writer.failed == 0
        assert writer.submit_spans(trace.trace_id, spans)
        assert writer.flush(5)
        assert len(errors) == 1 and writer.failed == 1
