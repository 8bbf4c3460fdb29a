"""Conversion of Triton's OpenTelemetry spans, on a payload captured from a real Triton 2.51."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.live.otlp_receiver import OtlpSpan, parse_otlp_json
from sidecar.live.triton_spans import (
    PHASES,
    TritonSpanCollector,
    TritonTrace,
    approx_span_bytes,
    convert_triton_spans,
)
from sidecar.trace.spans import Level, Source, Span

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "otlp" / "triton-2.51-two-requests.json"
CNN_TRACE = "0af7651916cd43dd8448eb211c80319c"
CNN_PROXY_SPAN = "b7ad6b7169203331"


def captured() -> list[OtlpSpan]:
    return parse_otlp_json(FIXTURE.read_bytes())


def check_tree(trace: TritonTrace, proxy_span_id: str) -> None:
    """The shape every converted Triton request must have (also used by the end-to-end test)."""
    by_kind: dict[str, list[Span]] = {}
    for span in trace.spans:
        by_kind.setdefault(span.kind, []).append(span)
        assert span.trace_id == trace.trace_id
        assert (span.level, span.source) == (Level.SERVER, Source.BACKEND)
        assert span.duration_ns is not None and span.duration_ns > 0, span
    for kind in ("request", "model", "compute", *PHASES):
        assert len(by_kind.get(kind, [])) == 1, f"expected one {kind} span: {trace.spans}"
    one = {kind: spans[0] for kind, spans in by_kind.items()}
    assert trace.parent_span_id == proxy_span_id
    assert one["request"].parent_id == proxy_span_id
    assert one["model"].parent_id == one["request"].span_id
    assert one["compute"].parent_id == one["model"].span_id
    assert one["queue"].parent_id == one["model"].span_id
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert one[phase].parent_id == one["compute"].span_id

    def inside(child: Span, parent: Span) -> bool:
        return parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns

    assert inside(one["model"], one["request"])
    assert inside(one["queue"], one["model"]) and inside(one["compute"], one["model"])
    assert one["queue"].end_ns <= one["compute"].start_ns
    phases = [one[p] for p in ("compute_input", "compute_infer", "compute_output")]
    assert all(inside(p, one["compute"]) for p in phases)
    assert phases[0].end_ns <= phases[1].start_ns and phases[1].end_ns <= phases[2].start_ns
    assert [p.index for p in phases] == [0, 1, 2]
    assert {p.phase for p in trace.phases} == set(PHASES)
    for sample in trace.phases:
        assert sample.model == trace.model and sample.seconds > 0
        assert sample.seconds == pytest.approx(one[sample.phase].timeline_ns / 1e9)


def test_converts_captured_payload() -> None:
    traces = {t.trace_id: t for t in convert_triton_spans(captured())}
    assert set(traces) == {CNN_TRACE, "1af7651916cd43dd8448eb211c80319c"}
    cnn = traces[CNN_TRACE]
    assert (cnn.model, cnn.model_version, cnn.complete) == ("simple_cnn", "1", True)
    check_tree(cnn, CNN_PROXY_SPAN)
    check_tree(traces["1af7651916cd43dd8448eb211c80319c"], "c7ad6b7169203331")
    assert traces["1af7651916cd43dd8448eb211c80319c"].model == "add_sub"


def test_phase_times_come_from_events() -> None:
    spans = [s for s in captured() if s.trace_id == CNN_TRACE]
    compute = next(s for s in spans if s.name == "compute")
    model = next(s for s in spans if s.name == "simple_cnn")
    events = {e.name: e.time_ns for e in compute.events + model.events}
    (trace,) = convert_triton_spans(spans)
    got = {s.kind: (s.start_ns, s.end_ns) for s in trace.spans}
    assert got["queue"] == (events["QUEUE_START"], events["COMPUTE_START"])
    assert got["compute_input"] == (events["COMPUTE_START"], events["COMPUTE_INPUT_END"])
    assert got["compute_infer"] == (events["COMPUTE_INPUT_END"], events["COMPUTE_OUTPUT_START"])
    assert got["compute_output"] == (events["COMPUTE_OUTPUT_START"], events["COMPUTE_END"])
    # Triton's own span ids are kept; derived ids are stable across conversions
    again = convert_triton_spans(spans)[0]
    assert [s.span_id for s in trace.spans] == [s.span_id for s in again.spans]
    assert {s.span_id for s in spans} <= {s.span_id for s in trace.spans}


def test_missing_compute_span_gives_no_queue_phase() -> None:
    spans = [s for s in captured() if s.trace_id == CNN_TRACE and s.name != "compute"]
    (trace,) = convert_triton_spans(spans)
    assert {s.kind for s in trace.spans} == {"request", "model"}
    assert trace.phases == []


def test_collector_joins_split_payloads_and_emits_once() -> None:
    emitted: list[TritonTrace] = []
    collector = TritonSpanCollector(emitted.append)
    spans = [s for s in captured() if s.trace_id == CNN_TRACE]
    for span in spans:  # Triton ends compute, then the model span, then InferRequest
        collector.add([span])
    assert len(emitted) == 1 and collector.pending == 0
    check_tree(emitted[0], CNN_PROXY_SPAN)


def test_collector_flushes_incomplete_traces_by_age() -> None:
    now = [0.0]
    emitted: list[TritonTrace] = []
    collector = TritonSpanCollector(emitted.append, max_age_s=5.0, clock=lambda: now[0])
    compute = [s for s in captured() if s.trace_id == CNN_TRACE and s.name == "compute"]
    collector.add(compute)
    collector.flush()
    assert emitted == [] and collector.pending == 1
    now[0] = 6.0
    collector.flush()
    assert len(emitted) == 1 and not emitted[0].complete
    assert [s.kind for s in emitted[0].spans] == [
        "compute",
        "compute_input",
        "compute_infer",
        "compute_output",
    ]


def test_collector_bounds_pending_traces() -> None:
    emitted: list[TritonTrace] = []
    collector = TritonSpanCollector(emitted.append, max_pending=1)
    computes = [s for s in captured() if s.name == "compute"]
    collector.add([computes[0]])
    collector.add([computes[1]])
    assert collector.pending == 1
    assert [t.trace_id for t in emitted] == [computes[0].trace_id]
    collector.flush(everything=True)
    assert collector.pending == 0 and len(emitted) == 2


# --------------------------------------------------------------------------- bounds (issue 9)


def copies(span: OtlpSpan, count: int, trace_id: str, **changes: object) -> list[OtlpSpan]:
    """`count` copies of a real span under one trace id, each with its own span id."""
    return [
        dataclasses.replace(span, trace_id=trace_id, span_id=f"{i + 1:016x}", **changes)
        for i in range(count)
    ]


def first(name: str) -> OtlpSpan:
    return next(s for s in captured() if s.trace_id == CNN_TRACE and s.name == name)


def test_unfinished_traces_hold_a_bounded_number_of_spans() -> None:
    # the attack of issue 9, scaled down: unfinished trace ids flooded with spans
    emitted: list[TritonTrace] = []
    collector = TritonSpanCollector(emitted.append, max_spans_per_trace=100)
    for t in range(6):
        collector.add(copies(first("compute"), 2000, f"{t + 1:032x}"))
    stats = collector.stats()
    assert (stats.pending_traces, stats.pending_spans) == (6, 600)
    assert stats.dropped_by_reason["trace_spans"] == 6 * 1900
    assert stats.pending_bytes == 600 * approx_span_bytes(first("compute"))
    assert emitted == []
    # the InferRequest span still completes a full trace
    collector.add([dataclasses.replace(first("InferRequest"), trace_id=f"{1:032x}")])
    assert len(emitted) == 1 and emitted[0].complete
    assert collector.stats().traces_by_outcome["complete"] == 1
    assert collector.stats().pending_spans == 500


def test_span_bytes_are_bounded_per_trace_and_in_total() -> None:
    compute = first("compute")
    big = dataclasses.replace(compute, attributes={"blob": "x" * 300_000})
    size = approx_span_bytes(big)
    collector = TritonSpanCollector(
        lambda trace: None, max_bytes_per_trace=3 * size, max_pending_bytes=5 * size
    )
    collector.add(copies(big, 4, "a" * 32))
    assert collector.stats().dropped_by_reason["trace_bytes"] == 1
    collector.add(copies(big, 4, "b" * 32))
    stats = collector.stats()
    assert stats.dropped_by_reason["total_bytes"] == 2
    assert (stats.pending_spans, stats.pending_bytes) == (5, 5 * size)


def test_total_pending_spans_are_bounded() -> None:
    collector = TritonSpanCollector(lambda trace: None, max_pending_spans=10)
    for t in range(5):
        collector.add(copies(first("compute"), 3, f"{t + 1:032x}"))
    stats = collector.stats()
    assert stats.pending_spans == 10
    assert stats.dropped_by_reason["total_spans"] == 5


def test_traces_expire_by_time_without_a_new_payload() -> None:
    now = [0.0]
    emitted: list[TritonTrace] = []
    done = threading.Event()

    def on_trace(trace: TritonTrace) -> None:
        emitted.append(trace)
        done.set()

    with TritonSpanCollector(
        on_trace, max_age_s=5.0, sweep_interval_s=0.01, clock=lambda: now[0]
    ) as collector:
        collector.add([first("compute")])
        now[0] = 6.0  # no add() after this: only the sweeper can emit
        assert done.wait(20)
        stats = collector.stats()
    assert len(emitted) == 1 and not emitted[0].complete
    assert stats.traces_by_outcome["expired"] == 1
    assert (stats.pending_traces, stats.pending_spans, stats.pending_bytes) == (0, 0, 0)
    assert not [t for t in threading.enumerate() if t.name == "otlp-trace-sweeper"]


def test_sweeper_survives_a_failing_callback() -> None:
    now = [0.0]
    emitted: list[str] = []
    done = threading.Event()

    def on_trace(trace: TritonTrace) -> None:
        if not emitted:
            emitted.append("failed")
            raise RuntimeError("store is down")
        emitted.append(trace.trace_id)
        done.set()

    with TritonSpanCollector(
        on_trace, max_age_s=5.0, sweep_interval_s=0.01, clock=lambda: now[0]
    ) as collector:
        collector.add(copies(first("compute"), 1, "a" * 32))
        now[0] = 6.0
        _wait(lambda: collector.stats().callback_errors == 1)
        collector.add(copies(first("compute"), 1, "b" * 32))
        now[0] = 12.0
        assert done.wait(20)
    assert emitted == ["failed", "b" * 32]


def test_close_emits_what_is_pending_and_stops_the_sweeper() -> None:
    emitted: list[TritonTrace] = []
    collector = TritonSpanCollector(emitted.append).start()
    collector.add([first("compute")])
    collector.close()
    assert len(emitted) == 1
    assert collector.stats().traces_by_outcome["flushed"] == 1
    assert not [t for t in threading.enumerate() if t.name == "otlp-trace-sweeper"]


def _wait(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)
