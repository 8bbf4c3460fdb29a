"""A sampled request's hand-overs, one implementation for unary calls (`observer`) and an
inference stream's messages (`stream_sampling`): its `ProfileJob` to the worker (`hand_over`),
or, where no replay can run its model, its live-only trace row to the store (`keep_live_only`);
then the relay's span of it, the trace's request span, to the store with its exemplar on the
latency (`store_request_span`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from sidecar.backends.replayability import Replayability
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.handler import SampleHandler
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.trace import schema
from sidecar.trace.spans import Level, Source, Span

GRPC, HTTP = "grpc", "http"  # a request span's `protocol`


class Hub(Protocol):
    """What the hand-overs use of the relay's `observer.SamplingHub`."""

    metrics: SamplingMetrics
    handler: SampleHandler

    def drop(self, label: str, reason: str) -> None: ...

    def mark_sampled(self, trace_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Sample:
    """A sampled request's trace ids, and the model and method its job replays."""

    trace_id: str
    span_id: str
    model: str
    method: str  # the job's method (`Backend.replayable`'s value), e.g. ModelInfer
    # the request carried the trace's traceparent to the backend (its spans may join the
    # trace); False for a stream's message and a slow sample (its trace is made after it)
    traced: bool = True


@dataclass(frozen=True, slots=True)
class RelayedRequest:
    """A sampled request as the relay saw it: what its request span says."""

    method: str  # the relay's method, the span's kind
    path: str
    model: str | None
    start_ns: int  # Unix epoch ns
    end_ns: int
    duration_s: float  # the exemplar's latency
    grpc_code: str
    grpc_message: str
    request_bytes: int
    response_bytes: int
    marks: Mapping[str, object]  # further attributes: the relay marks (docs/contracts.md)
    protocol: str = GRPC  # the relay that saw it: `grpc` or `http`


def _job(sample: Sample, message: bytes, reason: str) -> ProfileJob:
    return ProfileJob(
        trace_id=sample.trace_id,
        parent_span_id=sample.span_id,
        model=sample.model,
        method=sample.method,
        request_message=message,
        reason=reason,
        received_ns=time.time_ns(),
        traced=sample.traced,
    )


def keep_live_only(hub: Hub, label: str, sample: Sample, reason: str, why: Replayability) -> bool:
    """A sample whose model no replay can run: no job; its live-only trace row (`why` in its
    `replay` attribute) goes to the store and its trace is marked sampled, so the backend's
    spans and the request span join it. False when the row could not be handed to the trace
    writer: then it is dropped as `store_failing`. The caller gives its duty-cycle share back
    first (nothing runs)."""
    if not hub.handler.keep_live(_job(sample, b"", reason), why):
        hub.metrics.dropped.labels(label, "store_failing").inc()
        return False
    hub.mark_sampled(sample.trace_id)
    return True


def hand_over(hub: Hub, label: str, sample: Sample, message: bytes, reason: str) -> bool:
    """Queue the sample's job (`reason`: the trace's `sample_reason`) and mark its trace
    sampled; False when the queue is full: then it is dropped as `queue_full`."""
    job = _job(sample, message, reason)
    if not hub.handler.submit(job):
        hub.drop(label, "queue_full")
        return False
    hub.mark_sampled(sample.trace_id)
    hub.handler.remember(sample.model, sample.method, message)
    return True


def request_span(trace_id: str, span_id: str, request: RelayedRequest) -> Span:
    """The relay's span of a sampled request, the root of its trace."""
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=None,
        level=Level.REQUEST,
        name=request.path,
        kind=request.method,
        start_ns=request.start_ns,
        end_ns=request.end_ns,
        source=Source.PROXY,
        attributes={
            schema.GRPC_CODE: request.grpc_code,
            schema.GRPC_MESSAGE: request.grpc_message,
            schema.REQUEST_BYTES: request.request_bytes,
            schema.RESPONSE_BYTES: request.response_bytes,
            schema.PATH: request.path,
            schema.PROTOCOL: request.protocol,
            schema.MODEL: request.model or "",
            **request.marks,
        },
    )


def store_request_span(hub: Hub, trace_id: str, span_id: str, request: RelayedRequest) -> None:
    """The request span of a queued sample to the store, its exemplar on the latency. A
    failed write is counted in `store_write_failures` and raised (no exemplar then)."""
    try:
        hub.handler.store_spans(trace_id, [request_span(trace_id, span_id, request)])
    except Exception:
        hub.metrics.store_write_failures.inc()
        raise
    label = hub.handler.model_label(request.model)
    hub.handler.record_exemplar(request.method, label, request.duration_s, trace_id)
