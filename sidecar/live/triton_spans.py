"""Triton's OpenTelemetry spans -> server spans (`Level.SERVER`, `Source.BACKEND`) of a trace.

What Triton 2.51 exports per request (OTel C++ SDK 1.13, OTLP/JSON, checked against a real
server; see docs/triton-tracing.md):

- `InferRequest`: the frontend's span; its parent is the span id the caller sent in
  `traceparent`. Events `GRPC_WAITREAD_START/END` (or `HTTP_RECV_START/END`),
  `INFER_RESPONSE_COMPLETE`, `GRPC_SEND_START/END`.
- a *model span* named after the model (attributes `triton.model_name`,
  `triton.model_version`, `triton.trace_id`, `triton.trace_parent_id`), child of
  `InferRequest`; events `REQUEST_START`, `QUEUE_START`, `REQUEST_END`.
- `compute`, child of the model span; events `COMPUTE_START`, `COMPUTE_INPUT_END`,
  `COMPUTE_OUTPUT_START`, `COMPUTE_END`.

Converted spans keep Triton's trace id, span ids and parent ids, so the tree hangs under the
proxy's span. Kinds: `request` (InferRequest), `model` (the model span), `compute`, and
derived children `queue` (QUEUE_START -> first COMPUTE_START, under the model span),
`compute_input`, `compute_infer`, `compute_output` (under `compute`). Derived span ids are
a hash of the compute/model span id and the phase, so a re-sent payload gives the same ids.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.live.otlp_receiver import OtlpSpan
from sidecar.trace import schema
from sidecar.trace.spans import Level, Source, Span

log = logging.getLogger(__name__)

REQUEST_SPAN_NAME = "InferRequest"
COMPUTE_SPAN_NAME = "compute"
MODEL_NAME_ATTRIBUTE = "triton.model_name"
MODEL_VERSION_ATTRIBUTE = "triton.model_version"

PHASES = schema.TRITON_PHASES
# derived compute phases: (kind, start event, end event), all on the `compute` span
_COMPUTE_PHASES = (
    ("compute_input", "COMPUTE_START", "COMPUTE_INPUT_END"),
    (schema.COMPUTE_INFER, "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
    ("compute_output", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
)


@dataclass(frozen=True)
class PhaseDuration:
    """One observation for `xsp_backend_phase_duration_seconds{model, phase}`."""

    model: str
    phase: str
    seconds: float


@dataclass
class TritonTrace:
    """Triton's spans of one trace, converted.

    `parent_span_id` is the parent of the `InferRequest` span: the proxy's span id sent in
    `traceparent` (None when Triton traced the request on its own).
    """

    trace_id: str
    spans: list[Span] = field(default_factory=list)
    phases: list[PhaseDuration] = field(default_factory=list)
    parent_span_id: str | None = None
    model: str = ""
    model_version: str = ""

    @property
    def complete(self) -> bool:
        """Whether the frontend's `InferRequest` span is present (Triton ends it last)."""
        return any(s.kind == "request" for s in self.spans)


def _events(span: OtlpSpan) -> dict[str, int]:
    """First time of each event name (Triton sends each at most once per span)."""
    out: dict[str, int] = {}
    for event in span.events:
        out.setdefault(event.name, event.time_ns)
    return out


def _derived_id(span_id: str, phase: str) -> str:
    return hashlib.blake2b(f"{span_id}/{phase}".encode(), digest_size=8).hexdigest()


def _is_model_span(span: OtlpSpan) -> bool:
    return MODEL_NAME_ATTRIBUTE in span.attributes or any(
        e.name == "REQUEST_START" for e in span.events
    )


def _kind(span: OtlpSpan) -> str:
    if span.name == REQUEST_SPAN_NAME:
        return "request"
    if span.name == COMPUTE_SPAN_NAME:
        return "compute"
    if _is_model_span(span):
        return "model"
    return span.name  # a span this converter does not know: kept under its own name


def _model_of(span: OtlpSpan) -> tuple[str, str]:
    name = span.attributes.get(MODEL_NAME_ATTRIBUTE, span.name)
    version = span.attributes.get(MODEL_VERSION_ATTRIBUTE, "")
    return str(name), "" if version in ("", None) else str(version)


def _base_span(span: OtlpSpan, kind: str, extra: dict[str, Any]) -> Span:
    attributes: dict[str, Any] = {
        schema.EVENTS: [{"name": e.name, "time_ns": e.time_ns} for e in span.events],
        schema.OTEL_SPAN_KIND: span.kind,
        schema.SERVICE: str(span.resource.get("service.name", "")),
        **span.attributes,
        **extra,
    }
    if span.status_code:
        attributes[schema.STATUS_CODE] = span.status_code
        attributes[schema.STATUS_MESSAGE] = span.status_message
    return Span(
        trace_id=span.trace_id,
        span_id=span.span_id,
        parent_id=span.parent_span_id,
        level=Level.SERVER,
        name=span.name,
        kind=kind,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        source=Source.BACKEND,
        attributes=attributes,
    )


def _phase_span(parent: Span, phase: str, start_ns: int, end_ns: int, model: str) -> Span:
    return Span(
        trace_id=parent.trace_id,
        span_id=_derived_id(parent.span_id, phase),
        parent_id=parent.span_id,
        level=Level.SERVER,
        name=phase,
        kind=phase,
        start_ns=start_ns,
        end_ns=end_ns,
        source=Source.BACKEND,
        attributes={schema.MODEL: model, schema.DERIVED_FROM: "triton_events"},
    )


def _convert_one(trace_id: str, otlp_spans: list[OtlpSpan]) -> TritonTrace:
    result = TritonTrace(trace_id=trace_id)
    by_id = {s.span_id: s for s in otlp_spans}
    # the model a span belongs to: its own, or that of the nearest model-span ancestor
    model_spans = {s.span_id: _model_of(s) for s in otlp_spans if _kind(s) == "model"}

    def model_for(span: OtlpSpan) -> tuple[str, str]:
        seen: set[str] = set()
        current: OtlpSpan | None = span
        while current is not None and current.span_id not in seen:
            if current.span_id in model_spans:
                return model_spans[current.span_id]
            seen.add(current.span_id)
            current = by_id.get(current.parent_span_id or "")
        return "", ""

    first_compute_start: dict[str, int] = {}  # model span id -> earliest COMPUTE_START
    converted: list[Span] = []
    for otlp in otlp_spans:
        kind = _kind(otlp)
        model, version = model_for(otlp)
        extra = {"model": model, "model_version": version} if model else {}
        span = _base_span(otlp, kind, extra)
        converted.append(span)
        if kind == "request":
            result.parent_span_id = otlp.parent_span_id
        elif kind == "model" and not result.model:
            result.model, result.model_version = model, version
        elif kind == "compute":
            events = _events(otlp)
            for phase, start_event, end_event in _COMPUTE_PHASES:
                if start_event in events and end_event in events:
                    converted.append(
                        _phase_span(span, phase, events[start_event], events[end_event], model)
                    )
            if "COMPUTE_START" in events and otlp.parent_span_id is not None:
                parent = otlp.parent_span_id
                start = events["COMPUTE_START"]
                first_compute_start[parent] = min(first_compute_start.get(parent, start), start)
    for otlp in otlp_spans:
        if otlp.span_id not in model_spans:
            continue
        queue_start = _events(otlp).get("QUEUE_START")
        compute_start = first_compute_start.get(otlp.span_id)
        if queue_start is not None and compute_start is not None:
            model_span = next(s for s in converted if s.span_id == otlp.span_id)
            converted.append(
                _phase_span(
                    model_span, "queue", queue_start, compute_start, model_spans[otlp.span_id][0]
                )
            )
    for span in converted:
        if span.kind in PHASES:
            model = str(span.attributes.get(schema.MODEL, ""))
            seconds = max(span.end_ns - span.start_ns, 0) / 1e9
            result.phases.append(PhaseDuration(model=model, phase=span.kind, seconds=seconds))
    _number_siblings(converted)
    converted.sort(key=lambda s: (s.start_ns, -s.end_ns))
    result.spans = converted
    return result


def _number_siblings(spans: list[Span]) -> None:
    """Set `index` to the execution order among siblings of the same parent."""
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        children.setdefault(span.parent_id, []).append(span)
    for group in children.values():
        for index, span in enumerate(sorted(group, key=lambda s: (s.start_ns, s.span_id))):
            span.index = index


def convert_triton_spans(spans: Iterable[OtlpSpan]) -> list[TritonTrace]:
    """Convert Triton's OTLP spans, grouped by trace id (in order of first appearance)."""
    groups: dict[str, list[OtlpSpan]] = {}
    for span in spans:
        groups.setdefault(span.trace_id, []).append(span)
    return [_convert_one(trace_id, group) for trace_id, group in groups.items()]


TraceCallback = Callable[[TritonTrace], None]

# How a pending trace left the collector: the label set of `xsp_otlp_traces_total{outcome}`.
TRACE_OUTCOMES = (
    "complete",  # its InferRequest span arrived
    "expired",  # older than max_age_s, emitted incomplete
    "evicted",  # more than max_pending traces waited; the oldest went out incomplete
    "flushed",  # emitted incomplete by flush(everything=True) / close()
)
# Why a span was not kept: the label set of `xsp_otlp_spans_dropped_total{reason}`.
DROP_REASONS = ("trace_spans", "trace_bytes", "total_spans", "total_bytes")

_OBJECT_BYTES = 64  # rough CPython sizes, for the byte bounds (not an exact accounting)
_SPAN_BYTES = 700  # an OtlpSpan with its ids, dicts and list (tracemalloc, CPython 3.11)
_EVENT_BYTES = 150


def _value_bytes(value: Any) -> int:
    if isinstance(value, str | bytes):
        return 49 + len(value)
    if isinstance(value, dict):
        return _OBJECT_BYTES * (1 + len(value)) + sum(
            _value_bytes(k) + _value_bytes(v) for k, v in value.items()
        )
    if isinstance(value, list | tuple):
        return _OBJECT_BYTES + sum(8 + _value_bytes(v) for v in value)
    return 32


def approx_span_bytes(span: OtlpSpan) -> int:
    """Memory an `OtlpSpan` holds, roughly (its resource dict is shared within a payload)."""
    return (
        _SPAN_BYTES
        + len(span.name)
        + len(span.scope)
        + len(span.status_message)
        + _value_bytes(span.attributes)
        + sum(_EVENT_BYTES + len(e.name) + _value_bytes(e.attributes) for e in span.events)
    )


@dataclass
class CollectorStats:
    """A snapshot of the collector: what waits now and what happened so far."""

    pending_traces: int = 0
    pending_spans: int = 0
    pending_bytes: int = 0
    traces_by_outcome: dict[str, int] = field(default_factory=dict)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    callback_errors: int = 0


@dataclass
class _Pending:
    first_seen: float
    spans: list[OtlpSpan] = field(default_factory=list)
    bytes: int = 0


class TritonSpanCollector:
    """Joins Triton's spans of a trace across OTLP payloads and emits each trace once.

    Triton's batch span processor may split one request's spans over several exports; it ends
    (and so exports) `InferRequest` last, so a trace is emitted when that span arrives. Traces
    whose `InferRequest` never comes are emitted as incomplete after `max_age_s` (by `flush()`,
    which the sweeper thread of `start()` calls every `sweep_interval_s`, and by `add`), or
    when more than `max_pending` traces wait (oldest first). What waits is bounded: a trace keeps
    at most `max_spans_per_trace` spans and `max_bytes_per_trace` bytes, all traces together
    `max_pending_spans` and `max_pending_bytes`; spans beyond are dropped and counted. An
    `InferRequest` span is only held to the per-trace bytes (it sends its trace out at once).
    `add` fits `OtlpReceiver`'s callback; `on_trace` failures are logged and counted.
    """

    def __init__(
        self,
        on_trace: TraceCallback,
        *,
        max_age_s: float = 30.0,
        max_pending: int = 1000,
        max_spans_per_trace: int = 256,
        max_bytes_per_trace: int = 1 << 20,
        max_pending_spans: int = 20_000,
        max_pending_bytes: int = 32 << 20,
        sweep_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        limits = (max_pending, max_spans_per_trace, max_bytes_per_trace, max_pending_spans)
        if min(limits) <= 0 or max_pending_bytes <= 0 or not sweep_interval_s > 0:
            raise ValueError("the collector's limits and sweep interval must be positive")
        self.on_trace = on_trace
        self.max_age_s = max_age_s
        self.max_pending = max_pending
        self.max_spans_per_trace = max_spans_per_trace
        self.max_bytes_per_trace = max_bytes_per_trace
        self.max_pending_spans = max_pending_spans
        self.max_pending_bytes = max_pending_bytes
        self.sweep_interval_s = sweep_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._spans = 0
        self._bytes = 0
        self._outcomes = dict.fromkeys(TRACE_OUTCOMES, 0)
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._callback_errors = 0
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def stats(self) -> CollectorStats:
        with self._lock:
            return CollectorStats(
                pending_traces=len(self._pending),
                pending_spans=self._spans,
                pending_bytes=self._bytes,
                traces_by_outcome=dict(self._outcomes),
                dropped_by_reason=dict(self._dropped),
                callback_errors=self._callback_errors,
            )

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> TritonSpanCollector:
        """Start the sweeper thread that expires old traces even when no payload arrives."""
        if self._sweeper is None:
            self._stop.clear()
            self._sweeper = threading.Thread(
                target=self._sweep, name="otlp-trace-sweeper", daemon=True
            )
            self._sweeper.start()
        return self

    def close(self) -> None:
        """Stop the sweeper and emit everything still pending."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(5)
            self._sweeper = None
        self.flush(everything=True)

    def _sweep(self) -> None:
        while not self._stop.wait(self.sweep_interval_s):
            try:
                self.flush()
            except Exception:  # keep sweeping; flush already guards the callback
                log.exception("expiring pending backend traces failed")

    # -- spans in, traces out ------------------------------------------------------------------
    def add(self, spans: list[OtlpSpan]) -> None:
        ready: list[list[OtlpSpan]] = []
        now = self._clock()
        with self._lock:
            for span in spans:
                self._keep(span, now)
            for span in spans:
                if span.name == REQUEST_SPAN_NAME and span.trace_id in self._pending:
                    ready.append(self._pop(span.trace_id, "complete"))
            ready.extend(self._take_expired(now))
        for group in ready:
            self._emit(group)

    def flush(self, *, everything: bool = False) -> None:
        """Emit traces older than `max_age_s` (all of them with `everything=True`)."""
        with self._lock:
            if everything:
                groups = [self._pop(trace_id, "flushed") for trace_id in list(self._pending)]
            else:
                groups = self._take_expired(self._clock())
        for group in groups:
            self._emit(group)

    def _keep(self, span: OtlpSpan, now: float) -> None:
        """Add a span to its pending trace unless a bound says no (holds the lock)."""
        size = approx_span_bytes(span)
        entry = self._pending.get(span.trace_id)
        spans, held = (len(entry.spans), entry.bytes) if entry is not None else (0, 0)
        completes = span.name == REQUEST_SPAN_NAME  # leaves at once with its trace
        reason = None
        if held + size > self.max_bytes_per_trace:
            reason = "trace_bytes"
        elif completes:
            pass
        elif spans >= self.max_spans_per_trace:
            reason = "trace_spans"
        elif self._spans >= self.max_pending_spans:
            reason = "total_spans"
        elif self._bytes + size > self.max_pending_bytes:
            reason = "total_bytes"
        if reason is not None:
            self._dropped[reason] += 1
            return
        if entry is None:
            entry = self._pending[span.trace_id] = _Pending(first_seen=now)
        entry.spans.append(span)
        entry.bytes += size
        self._spans += 1
        self._bytes += size

    def _pop(self, trace_id: str, outcome: str) -> list[OtlpSpan]:
        entry = self._pending.pop(trace_id)
        self._spans -= len(entry.spans)
        self._bytes -= entry.bytes
        self._outcomes[outcome] += 1
        return entry.spans

    def _take_expired(self, now: float) -> list[list[OtlpSpan]]:
        expired = [
            trace_id
            for trace_id, entry in self._pending.items()
            if now - entry.first_seen >= self.max_age_s
        ]
        groups = [self._pop(trace_id, "expired") for trace_id in expired]
        overflow = len(self._pending) - self.max_pending
        if overflow > 0:  # oldest first (dicts keep insertion order)
            evicted = list(self._pending)[:overflow]
            groups += [self._pop(trace_id, "evicted") for trace_id in evicted]
        return groups

    def _emit(self, group: list[OtlpSpan]) -> None:
        # de-duplicate re-sent spans by id, keeping the last copy
        unique = list({span.span_id: span for span in group}.values())
        for trace in convert_triton_spans(unique):
            try:
                self.on_trace(trace)
            except Exception:  # a failing consumer must not stop the others or the sweeper
                log.exception("the backend-trace callback failed for trace %s", trace.trace_id)
                with self._lock:
                    self._callback_errors += 1

    def __enter__(self) -> TritonSpanCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
