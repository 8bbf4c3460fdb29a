"""A sampled request's hand-overs on their own, on the real hub and `SamplingMetrics` of
`test_observer.py` with its in-memory `SampleHandler`; the unary and stream paths through them
are `test_observer.py`'s and `test_stream_sampling.py`'s."""

from __future__ import annotations

import pytest

from sidecar.sampling.sampled_request import (
    RelayedRequest,
    Sample,
    hand_over,
    request_span,
    store_request_span,
)
from sidecar.trace.spans import Level, Source, new_span_id, new_trace_id
from tests.sampling.test_observer import Setup

SAMPLE = Sample(new_trace_id(), new_span_id(), "m", "ModelInfer")


def relayed(model: str | None = "m", **marks: object) -> RelayedRequest:
    return RelayedRequest(
        method="ModelStreamInfer",
        path="/inference.GRPCInferenceService/ModelStreamInfer",
        model=model,
        start_ns=1_000,
        end_ns=3_500,
        duration_s=2.5e-6,
        grpc_code="UNKNOWN",
        grpc_message="bad input",
        request_bytes=12,
        response_bytes=34,
        marks=marks,
    )


def test_a_queued_job_carries_the_sample_and_marks_its_trace() -> None:
    s = Setup()
    assert hand_over(s.hub, "m", SAMPLE, b"message", "forced")
    (job,) = s.handler.jobs
    assert (job.trace_id, job.parent_span_id, job.model, job.method) == (
        SAMPLE.trace_id,
        SAMPLE.span_id,
        SAMPLE.model,
        SAMPLE.method,
    )
    assert job.request_message == b"message" and job.reason == "forced"
    assert s.hub.is_sampled_trace(SAMPLE.trace_id)
    assert s.handler.remembered == [("m", "ModelInfer", b"message")]


def test_a_full_queue_drops_the_sample() -> None:
    s = Setup()
    s.handler.queue_full = True
    assert not hand_over(s.hub, "m", SAMPLE, b"message", "rate")
    assert s.dropped("queue_full") == 1
    assert not s.hub.is_sampled_trace(SAMPLE.trace_id) and s.handler.remembered == []


def test_the_request_span_says_what_the_relay_saw() -> None:
    request = relayed(None, stream_message=True, relay_request_start_ns=1_000)
    span = request_span(SAMPLE.trace_id, SAMPLE.span_id, request)
    assert (span.trace_id, span.span_id, span.parent_id) == (SAMPLE.trace_id, SAMPLE.span_id, None)
    assert (span.level, span.source) == (Level.REQUEST, Source.PROXY)
    assert (span.name, span.kind) == (request.path, request.method)
    assert (span.start_ns, span.end_ns) == (request.start_ns, request.end_ns)
    assert list(span.attributes.items()) == [
        ("grpc_code", "UNKNOWN"),
        ("grpc_message", "bad input"),
        ("request_bytes", 12),
        ("response_bytes", 34),
        ("path", request.path),
        ("protocol", "grpc"),
        ("model", ""),  # no model read: an empty name
        ("stream_message", True),
        ("relay_request_start_ns", 1_000),
    ]


def test_a_stored_span_gets_its_exemplar() -> None:
    s = Setup()
    store_request_span(s.hub, SAMPLE.trace_id, SAMPLE.span_id, relayed())
    ((trace_id, (span,)),) = s.handler.spans
    assert trace_id == SAMPLE.trace_id and span.span_id == SAMPLE.span_id
    assert s.handler.exemplars == [("ModelStreamInfer", "m", 2.5e-6, SAMPLE.trace_id)]


def test_a_failed_span_write_is_counted_and_raised_without_an_exemplar() -> None:
    s = Setup()
    s.handler.store_broken = True
    with pytest.raises(RuntimeError):
        store_request_span(s.hub, SAMPLE.trace_id, SAMPLE.span_id, relayed())
    assert s.registry.get_sample_value("xsp_trace_store_write_failures_total") == 1
    assert s.handler.exemplars == []
