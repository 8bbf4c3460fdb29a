"""The relay's sampling hook: decide per request, mark sampled ones, hand copies to the worker.

For every request the relay calls `on_request_headers` (before forwarding the headers) and
`on_stream_end`; only for tentatively sampled requests does it collect the body and call
`on_request_body`. A sampled request gets a W3C `traceparent` so the backend's own spans
(Triton's OpenTelemetry trace) join the same trace, under the proxy's span. The first and last
calls also bump the relay's request counters (`ServingPressure`), the profiling worker's view
of how busy serving is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.backends import REPLAYABLE
from sidecar.proxy.streams import ConnectionInfo, HeaderDecision, RequestStart, StreamEnd
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.pressure import ServingPressure
from sidecar.sampling.sampler import Decision, Sampler, Tentative
from sidecar.trace.spans import Level, Source, Span, new_span_id, new_trace_id

log = logging.getLogger(__name__)

MAX_SAMPLED_BODY = 64 << 20


@dataclass(slots=True)
class _Pending:
    trace_id: str
    span_id: str
    tentative: Tentative
    method: str = "ModelInfer"  # the job's method
    decision: Decision | None = None
    queued: bool = False


def first_message(body: bytes) -> bytes | None:
    """The first gRPC message of a request body (None if compressed or truncated)."""
    if len(body) < 5 or body[0] != 0:
        return None
    length = int.from_bytes(body[1:5], "big")
    if len(body) < 5 + length:
        return None
    return body[5 : 5 + length]


class SamplingHub:
    """Shared sampling state of the relay; `observer_factory` gives each connection a hook.

    `submit` queues a job for the worker (never blocks); `store_spans` hands live spans to the
    trace writer; `model_label` bounds model names for metric labels; `remember` keeps the last
    sampled request per model for the admin API; a request for a model `known_model` rejects
    (not in the model repository) is dropped before it is queued. `on_sampled(start, trace_id,
    span_id)` hears of each request picked at header time (it must not block);
    `record_exemplar(method, model, duration_s, trace_id)` hears, at stream end, of each call
    whose request span went to the store (its bounded labels and the relay's duration), to link
    the latency histogram to the trace (`ProxyMetrics.record_exemplar`).
    """

    def __init__(
        self,
        sampler: Sampler,
        metrics: SamplingMetrics,
        submit: Callable[[ProfileJob], bool],
        store_spans: Callable[[str, list[Span]], object],
        model_label: Callable[[str | None], str],
        remember: Callable[[str, str, bytes], object] | None = None,
        known_model: Callable[[str], bool] | None = None,
        on_sampled: Callable[[RequestStart, str, str], object] | None = None,
        record_exemplar: Callable[[str, str, float, str], object] | None = None,
        pressure: ServingPressure | None = None,
    ) -> None:
        self.sampler = sampler
        self.pressure = pressure or ServingPressure()
        self.metrics = metrics
        self.submit = submit
        self.store_spans = store_spans
        self.model_label = model_label
        self.remember = remember
        self.known_model = known_model
        self.on_sampled = on_sampled
        self.record_exemplar = record_exemplar
        self.sampled_trace_ids: set[str] = set()
        self._lock = threading.Lock()

    def observer_factory(self, info: ConnectionInfo) -> SamplingObserver:
        return SamplingObserver(self)

    def is_sampled_trace(self, trace_id: str) -> bool:
        with self._lock:
            return trace_id in self.sampled_trace_ids

    def forget_trace(self, trace_id: str) -> None:
        with self._lock:
            self.sampled_trace_ids.discard(trace_id)

    def mark_sampled(self, trace_id: str) -> None:
        with self._lock:
            if len(self.sampled_trace_ids) > 10_000:  # bounded: drop the oldest guesses
                self.sampled_trace_ids.clear()
            self.sampled_trace_ids.add(trace_id)


class SamplingObserver:
    """Per-connection hook (see module docstring)."""

    __slots__ = ("_hub", "_pending")

    def __init__(self, hub: SamplingHub) -> None:
        self._hub = hub
        self._pending: dict[int, _Pending] = {}

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | None:
        hub = self._hub
        hub.pressure.request_started()
        if start.method not in REPLAYABLE:
            return None
        forced = False
        header = hub.sampler.settings.force_header
        if header is not None:
            wanted = header.encode("latin-1")
            for name, value in start.raw_headers:  # no dict per request: usually 5-8 fields
                if name == wanted:
                    forced = hub.sampler.is_forced(value.decode("latin-1"))
                    break
        tentative = hub.sampler.at_headers(forced)
        if tentative is Tentative.NO:
            return None
        if tentative is Tentative.GATED or tentative is Tentative.STORE_FAILING:
            self._pending[start.stream_id] = _Pending("", "", tentative)
            return None
        pending = _Pending(new_trace_id(), new_span_id(), tentative, REPLAYABLE[start.method])
        self._pending[start.stream_id] = pending
        if hub.on_sampled is not None:
            hub.on_sampled(start, pending.trace_id, pending.span_id)
        traceparent = f"00-{pending.trace_id}-{pending.span_id}-01"
        return HeaderDecision(
            extra_headers=(("traceparent", traceparent),),
            capture_body=True,
            capture_limit=MAX_SAMPLED_BODY,
        )

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        pending = self._pending.get(stream_id)
        if pending is None:
            return
        hub = self._hub
        label = hub.model_label(model)
        decision = hub.sampler.at_body(label, pending.tentative)
        pending.decision = decision
        hub.metrics.record_decision(label, decision)
        if decision is not Decision.SAMPLED:
            return
        message = first_message(body)
        if message is None or model is None:
            hub.sampler.duty.cancel()
            hub.metrics.dropped.labels(label, "unreadable_request").inc()
            return
        if hub.known_model is not None and not hub.known_model(model):
            hub.sampler.duty.cancel()
            hub.metrics.dropped.labels(label, "unknown_model").inc()
            return
        job = ProfileJob(
            trace_id=pending.trace_id,
            parent_span_id=pending.span_id,
            model=model,
            method=pending.method,
            request_message=message,
            reason="forced" if pending.tentative is Tentative.FORCED else "random",
            received_ns=time.time_ns(),
        )
        if hub.submit(job):
            pending.queued = True
            hub.mark_sampled(pending.trace_id)
            if hub.remember is not None:
                hub.remember(model, pending.method, message)
        else:
            hub.sampler.duty.cancel()
            hub.metrics.dropped.labels(label, "queue_full").inc()

    def on_stream_end(self, end: StreamEnd) -> None:
        hub = self._hub
        hub.pressure.request_ended()
        pending = self._pending.pop(end.stream_id, None)
        if end.method not in REPLAYABLE:
            return
        if pending is None:  # every request not picked at header time
            hub.metrics.record_decision(hub.model_label(end.model), Decision.SKIPPED_RATE)
            return
        if pending.tentative is Tentative.GATED or pending.tentative is Tentative.STORE_FAILING:
            label = hub.model_label(end.model)
            hub.metrics.record_decision(label, hub.sampler.at_body(label, pending.tentative))
            return
        if pending.decision is None:  # picked, but its body never arrived whole
            # counted as sampled, like every other sample dropped before profiling
            label = hub.model_label(end.model)
            hub.metrics.record_decision(label, Decision.SAMPLED)
            hub.metrics.dropped.labels(label, "body_unavailable").inc()
            return
        if not pending.queued:
            return
        span = Span(
            trace_id=pending.trace_id,
            span_id=pending.span_id,
            parent_id=None,
            level=Level.REQUEST,
            name=end.path,
            kind=end.method,
            start_ns=end.start_ns,
            end_ns=end.start_ns + int(end.duration_s * 1e9),
            source=Source.PROXY,
            attributes={
                "grpc_code": end.grpc_code,
                "grpc_message": end.grpc_message,
                "request_bytes": end.request_bytes,
                "response_bytes": end.response_bytes,
                "path": end.path,
                "model": end.model or "",
            },
        )
        try:
            hub.store_spans(pending.trace_id, [span])
        except Exception:
            hub.metrics.store_write_failures.inc()
            log.exception("could not hand the request span to the trace writer")
            return
        if hub.record_exemplar is not None:
            label = hub.model_label(end.model)
            hub.record_exemplar(end.method, label, end.duration_s, pending.trace_id)
