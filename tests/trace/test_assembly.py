"""The trace assembler on a real SQLite store: the three parts of a sampled trace in every
order, each part missing (final at the deadline), each part twice, a restart half-way, live-only
traces and traces whose backend does not trace.

The replay part is written as the profiling worker's process writes it: by a store of its own
on the same file, followed by the worker's result handed to the assembler.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar.trace import fidelity, parts
from sidecar.trace.assembly import TRACING_OFF, Part, TraceAssembler, parts_expected
from sidecar.trace.otlp_export import OtlpTraceExport
from sidecar.trace.spans import (
    LIVE_ONLY,
    Level,
    LevelStats,
    Source,
    Span,
    Trace,
    new_span_id,
    new_trace_id,
)
from sidecar.trace.store import TraceStore
from sidecar.trace.writer import TraceWriter

T0 = 1_790_000_000_000_000_000
TIMEOUT_S = 60.0
WINDOW = {"inferences": 2, "executions": 1, "batch_sizes": {"2": 1}}
FIDELITY = {
    "live_compute_ns": 400_000,
    "live_source": "compute_infer",
    "replay_model_ns": 100_000,
    "ratio": 0.25,
    "server_batch_window": WINDOW,
}
BACKEND_SPANS = [("request", 900_000), ("compute_infer", 400_000)]
WHOLE = {"state": "whole", "missing": [], "why": ""}


class Clock:
    """A clock the test moves by hand (epoch ns)."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now

    def past_deadline(self) -> None:
        self.now += int(TIMEOUT_S * 1e9) + 1


class Sampled:
    """One sampled trace's parts, and how each reaches the store."""

    def __init__(self, db: Path, assembler: TraceAssembler) -> None:
        self.db = db
        self.assembler = assembler
        self.trace_id = new_trace_id()
        self.request_id = new_span_id()
        self.model_id = new_span_id()

    def request(self) -> None:
        span = Span(self.trace_id, self.request_id, None, Level.REQUEST, "/x/ModelInfer",
                    "ModelInfer", T0, T0 + 2_000_000, Source.PROXY,
                    attributes={"model": "m", "server_batch_window": WINDOW})  # fmt: skip
        assert self.assembler.add_spans(self.trace_id, [span])

    def backend(self) -> None:
        spans = [self._server(i, kind, ns) for i, (kind, ns) in enumerate(BACKEND_SPANS)]
        assert self.assembler.add_spans(self.trace_id, spans)

    def _server(self, i: int, kind: str, ns: int) -> Span:
        return Span(self.trace_id, f"{i + 1:016x}", self.request_id, Level.SERVER, kind, kind,
                    T0 + 100_000, T0 + 100_000 + ns, Source.BACKEND)  # fmt: skip

    def replay(self) -> None:
        """As the worker does: its process stores the trace, then its result comes."""
        trace = Trace(self.trace_id, "m", T0, batch_size=2, sample_reason="rate",
                      attributes={"method": "ModelInfer"})  # fmt: skip
        model = Span(self.trace_id, self.model_id, self.request_id, Level.MODEL, "m", "model",
                     T0 + 50_000, T0 + 150_000, Source.REPLAY, run_level=Level.MODEL)  # fmt: skip
        stats = LevelStats(self.trace_id, Level.MODEL, 5, 1, 100_000, 100_000, 90_000, 110_000,
                           1.0)  # fmt: skip
        with TraceStore(self.db) as worker_store:
            worker_store.write_trace(trace, [model], [stats])
        assert self.assembler.replay_done(self.trace_id, "ok")

    def part(self, part: Part) -> Callable[[], None]:
        return {Part.REQUEST: self.request, Part.BACKEND: self.backend, Part.REPLAY: self.replay}[
            part
        ]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "traces.db"


@pytest.fixture
def assembler(db: Path, clock: Clock) -> Iterator[TraceAssembler]:
    made = _assembler(db, clock)
    yield made
    made.close()


@pytest.fixture
def refreshed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The trace ids whose fidelity is computed, in this process (the worker's store too)."""
    seen: list[str] = []
    real = fidelity.refresh

    def counting(conn: sqlite3.Connection, trace_ids: Any) -> None:
        ids = list(trace_ids)
        seen.extend(ids)
        real(conn, ids)

    monkeypatch.setattr(parts.fidelity, "refresh", counting)
    return seen


def _assembler(db: Path, clock: Clock, **options: Any) -> TraceAssembler:
    return TraceAssembler(TraceWriter(db), timeout_s=TIMEOUT_S, clock=clock, **options)


def _sample(db: Path, assembler: TraceAssembler, **how: Any) -> Sampled:
    sampled = Sampled(db, assembler)
    expected, absent = parts_expected(
        live=how.get("live", True), no_backend=how.get("no_backend"), no_replay=how.get("no_replay")
    )
    assert assembler.expect(sampled.trace_id, expected, absent)
    _settle(assembler)  # the job is queued after its expectation: the worker's write comes later
    return sampled


def _state(db: Path, trace_id: str) -> parts.State | None:
    with sqlite3.connect(db) as conn:
        return parts.load(conn, trace_id)


def _attributes(db: Path, trace_id: str) -> dict[str, Any]:
    with TraceStore(db) as store:
        trace = store.get_trace(trace_id)
    return {} if trace is None else trace.attributes


def _settle(assembler: TraceAssembler) -> None:
    assert assembler.writer.flush(10)


@pytest.mark.parametrize("order", list(itertools.permutations(Part)), ids=str)
def test_every_order_of_the_three_parts_makes_one_whole_trace(
    db: Path, assembler: TraceAssembler, order: tuple[Part, ...], refreshed: list[str]
) -> None:
    sampled = _sample(db, assembler)
    for i, part in enumerate(order):
        sampled.part(part)()
        _settle(assembler)
        state = _state(db, sampled.trace_id)
        assert state is not None and state.received == frozenset(order[: i + 1])
        if i < 2:
            assert state.state == parts.PENDING
            assert "fidelity" not in _attributes(db, sampled.trace_id)  # not before the end
    attributes = _attributes(db, sampled.trace_id)
    assert attributes["assembly"] == WHOLE
    assert attributes["fidelity"] == FIDELITY
    assert attributes["method"] == "ModelInfer"  # the replay's own attributes are kept
    assert refreshed.count(sampled.trace_id) == 1  # fidelity computed once


@pytest.mark.parametrize("missing", list(Part), ids=str)
def test_a_missing_part_makes_the_trace_incomplete_at_its_deadline(
    db: Path, assembler: TraceAssembler, clock: Clock, missing: Part
) -> None:
    sampled = _sample(db, assembler)
    for part in Part:
        if part is not missing:
            sampled.part(part)()
    assembler.expire()  # not yet due
    _settle(assembler)
    state = _state(db, sampled.trace_id)
    assert state is not None and state.state == parts.PENDING
    clock.past_deadline()
    assembler.expire()
    _settle(assembler)
    state = _state(db, sampled.trace_id)
    assert state is not None
    outcome = {
        "state": "incomplete",
        "missing": [missing.value],
        "why": f"timeout: no {missing.value} part by the deadline",
    }
    assert state.record() == outcome
    if missing is not Part.REPLAY:  # no trace row without the replay
        attributes = _attributes(db, sampled.trace_id)
        assert attributes["assembly"] == outcome
        live = missing is not Part.BACKEND
        assert attributes["fidelity"]["live_compute_ns"] == (400_000 if live else None)
        assert ("server_batch_window" in attributes["fidelity"]) is (missing is not Part.REQUEST)


def test_a_late_part_makes_an_expired_trace_whole(
    db: Path, assembler: TraceAssembler, clock: Clock
) -> None:
    sampled = _sample(db, assembler)
    sampled.request()
    sampled.replay()
    clock.past_deadline()
    assembler.expire()
    sampled.backend()
    _settle(assembler)
    attributes = _attributes(db, sampled.trace_id)
    assert attributes["assembly"] == WHOLE and attributes["fidelity"] == FIDELITY


@pytest.mark.parametrize("twice", list(Part), ids=str)
def test_a_part_twice_changes_nothing(
    db: Path, assembler: TraceAssembler, twice: Part, refreshed: list[str]
) -> None:
    sampled = _sample(db, assembler)
    for part in Part:
        sampled.part(part)()
    _settle(assembler)
    with TraceStore(db) as store:
        spans_before = len(store.spans(sampled.trace_id))
    sampled.part(twice)()
    assert assembler.expect(sampled.trace_id, frozenset(Part))  # the expectation twice too
    _settle(assembler)
    with TraceStore(db) as store:
        assert len(store.spans(sampled.trace_id)) == spans_before == 4
    attributes = _attributes(db, sampled.trace_id)
    assert attributes["assembly"] == WHOLE and attributes["fidelity"] == FIDELITY
    # the replay's row is written again by the worker: its outcome goes on again, unchanged
    assert refreshed.count(sampled.trace_id) == (2 if twice is Part.REPLAY else 1)


def test_a_restart_half_way_loses_nothing(db: Path, clock: Clock) -> None:
    first = _assembler(db, clock)
    sampled = _sample(db, first)
    due = _sample(db, first)
    sampled.request()
    due.request()
    first.close()  # the sidecar stops: both traces stay pending in the store
    state = _state(db, sampled.trace_id)
    assert state is not None and state.state == parts.PENDING

    second = _assembler(db, clock)
    try:
        sampled.assembler = second
        sampled.backend()
        sampled.replay()
        _settle(second)
        assert _attributes(db, sampled.trace_id)["assembly"] == WHOLE
        clock.past_deadline()
        second.start()  # expires what the last run left overdue
        _settle(second)
        state = _state(db, due.trace_id)
        assert state is not None and state.state == parts.INCOMPLETE
        assert state.missing == ["backend", "replay"]
    finally:
        second.close()


def test_a_live_only_trace_is_final_without_waiting_for_a_replay(
    db: Path, assembler: TraceAssembler
) -> None:
    why = "not_replayable: model 'pipeline' is served by 'ensemble'"
    sampled = _sample(db, assembler, no_replay=why)
    row = Trace(sampled.trace_id, "pipeline", T0, status=LIVE_ONLY, attributes={"replay": why})
    assert assembler.add_trace(row)
    sampled.backend()
    _settle(assembler)
    assert "assembly" not in _attributes(db, sampled.trace_id)  # the request span is due
    sampled.request()
    _settle(assembler)
    attributes = _attributes(db, sampled.trace_id)
    assert attributes["assembly"] == {
        "state": "incomplete",
        "missing": ["replay"],
        "why": f"replay: {why}",
    }
    assert attributes["fidelity"] == {**FIDELITY, "replay_model_ns": None, "ratio": None}


def test_a_backend_that_does_not_trace_is_named_why(db: Path, assembler: TraceAssembler) -> None:
    sampled = _sample(db, assembler, no_backend=TRACING_OFF)
    sampled.replay()
    sampled.request()
    _settle(assembler)
    attributes = _attributes(db, sampled.trace_id)
    assert attributes["assembly"] == {
        "state": "incomplete",
        "missing": ["backend"],
        "why": f"backend: {TRACING_OFF}",
    }
    assert attributes["fidelity"] == {
        "live_compute_ns": None,
        "live_source": None,
        "replay_model_ns": 100_000,
        "ratio": None,
        "server_batch_window": WINDOW,
    }


@pytest.mark.parametrize("outcome", ["timeout", "crash", "store_error"])
def test_a_replay_that_never_stored_is_named_why(
    db: Path, assembler: TraceAssembler, outcome: str
) -> None:
    sampled = _sample(db, assembler)
    sampled.request()
    sampled.backend()
    assert assembler.replay_done(sampled.trace_id, outcome, "it went wrong")
    _settle(assembler)
    state = _state(db, sampled.trace_id)
    assert state is not None and state.record() == {
        "state": "incomplete",
        "missing": ["replay"],
        "why": f"replay: {outcome}: it went wrong",
    }


def test_an_admin_replay_expects_the_replay_alone(db: Path, assembler: TraceAssembler) -> None:
    sampled = _sample(db, assembler, live=False)
    sampled.replay()
    _settle(assembler)
    assert _attributes(db, sampled.trace_id)["assembly"] == WHOLE


def test_a_part_before_the_expectation_counts(db: Path, assembler: TraceAssembler) -> None:
    sampled = Sampled(db, assembler)
    sampled.backend()  # e.g. a capture's spans, before the job's expectation was written
    _settle(assembler)
    assert assembler.expect(sampled.trace_id, *parts_expected(live=True))
    sampled.request()
    sampled.replay()
    _settle(assembler)
    assert _attributes(db, sampled.trace_id)["assembly"] == WHOLE


def test_a_trace_not_under_assembly_keeps_its_fidelity_up_to_date(db: Path) -> None:
    """E.g. one written by `xsp-sidecar profile` or whole by a test: refreshed on each write."""
    with TraceStore(db) as store:
        trace = Trace(new_trace_id(), "m", T0)
        server = Span(trace.trace_id, new_span_id(), None, Level.SERVER, "c", "compute_infer",
                      T0, T0 + 500, Source.BACKEND)  # fmt: skip
        store.write_trace(trace, [])
        store.append_spans(trace.trace_id, [server])
        got = store.get_trace(trace.trace_id)
    assert got is not None and got.attributes["fidelity"]["live_compute_ns"] == 500
    assert "assembly" not in got.attributes


def test_every_part_goes_to_the_export_the_replay_read_back(db: Path, clock: Clock) -> None:
    exporter = InMemorySpanExporter()
    export = OtlpTraceExport(exporter, schedule_delay_ms=10)
    assembler = _assembler(db, clock, export=export)
    try:
        sampled = _sample(db, assembler)
        for part in Part:
            sampled.part(part)()
        _settle(assembler)
        assert export.flush(10)
    finally:
        assembler.close()
        export.close()
    names = sorted(span.name for span in exporter.get_finished_spans())
    assert names == sorted(["/x/ModelInfer", "request", "compute_infer", "m"])
    assert export.dropped == 0
