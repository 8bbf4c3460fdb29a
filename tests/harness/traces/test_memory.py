"""InMemoryTraceStore behaves like TraceStore: the same checks run against both."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.trace.errors import TraceStoreError
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.spans import Level, Source, Span, new_span_id
from sidecar.trace.store import TraceStore, TraceStoreLike
from tests.harness.traces.memory import InMemoryTraceStore
from tests.harness.traces.synthetic import make_trace


@pytest.fixture(params=["sqlite", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TraceStoreLike]:
    s: TraceStoreLike = (
        TraceStore(tmp_path / "t.db") if request.param == "sqlite" else InMemoryTraceStore()
    )
    yield s
    s.close()


def test_round_trip_and_copies(store: TraceStoreLike) -> None:
    trace, spans, stats = make_trace(layers=2)
    trace.attributes["shape"] = (1, 3)  # tuples come back as JSON lists from both stores
    store.write_trace(trace, spans, stats)
    back = store.get_trace(trace.trace_id)
    assert back is not None and back.attributes["shape"] == [1, 3]
    back.attributes["shape"].append(9)  # mutating a result does not change the store
    assert store.get_trace(trace.trace_id).attributes["shape"] == [1, 3]  # type: ignore[union-attr]
    trace.attributes["shape"] = [1, 3]
    assert store.get_trace(trace.trace_id) == trace
    assert sorted(store.spans(trace.trace_id), key=lambda s: s.span_id) == sorted(
        spans, key=lambda s: s.span_id
    )
    assert [s.name for s in store.spans(trace.trace_id, Level.LAYER)] == ["conv_0", "conv_1"]
    assert store.level_stats(trace.trace_id) == stats


def test_listing_late_spans_and_validation(store: TraceStoreLike) -> None:
    base = time.time_ns()
    ids = []
    for i in range(4):
        t, s, st = make_trace(model="a" if i < 2 else "b", created_ns=base + i, layers=1)
        store.write_trace(t, s, st)
        ids.append(t.trace_id)
    assert [t.trace_id for t in store.list_traces()] == ids[::-1]
    assert [t.trace_id for t in store.list_traces(model="a")] == ids[1::-1]
    assert [t.trace_id for t in store.list_traces(since_ns=base + 2, limit=1)] == [ids[3]]
    late = Span("not-yet", new_span_id(), None, Level.SERVER, "q", "queue", 5, 6, Source.BACKEND)
    store.append_spans("not-yet", [late])
    assert store.get_trace("not-yet") is None and store.spans("not-yet") == [late]
    bad, bad_spans, _ = make_trace(layers=1)
    bad_spans[0].attributes["x"] = object()
    with pytest.raises(TraceStoreError, match="JSON"):
        store.write_trace(bad, bad_spans)
    with pytest.raises(ValueError, match="trace"):
        store.write_trace(bad, make_trace(layers=1)[1])
    assert store.get_trace(bad.trace_id) is None


def test_retention_by_count_and_age(store: TraceStoreLike) -> None:
    now = time.time_ns()
    old = [make_trace(created_ns=now - 7200 * 10**9 + i, layers=1) for i in range(3)]
    new = [make_trace(created_ns=now - 10**9 + i, layers=1, pad=500) for i in range(6)]
    for parts in old + new:
        store.write_trace(*parts)
    assert store.apply_retention(RetentionPolicy(max_age_s=3600)) == 3
    assert store.apply_retention(RetentionPolicy(max_traces=5)) == 1
    kept = [t.trace_id for t in store.list_traces()]
    assert kept == [p[0].trace_id for p in new[:0:-1]]


def test_in_memory_size_retention_deletes_oldest_by_estimated_bytes() -> None:
    memory = InMemoryTraceStore()
    base = time.time_ns()
    parts = [make_trace(created_ns=base + i, layers=2, pad=200) for i in range(4)]
    for p in parts:
        memory.write_trace(*p)
    before = memory.used_bytes()
    assert memory.apply_retention(RetentionPolicy(max_bytes=before // 2)) == 2
    assert memory.used_bytes() <= before // 2
    assert [t.trace_id for t in memory.list_traces()] == [
        parts[3][0].trace_id,
        parts[2][0].trace_id,
    ]
