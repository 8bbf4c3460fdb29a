"""Stored traces, also sent to the fleet's tracing backend with OpenTelemetry's OTLP exporter.

Every span the store commits (the proxy's request span, the backend's spans, the replay's
M ▸ L ▸ K spans) is converted to an OpenTelemetry `ReadableSpan` with its original trace and
span ids, parent link and timestamps, and handed to the SDK's `BatchSpanProcessor`: batched, on
its own thread, over a bounded queue. `offer` never blocks and never raises: a span that finds
the queue full is dropped. Outcomes are counted per span in plain ints (`exported`, `dropped`,
`failed`), exported on /metrics by `OtlpExportCollector` as `xsp_otlp_export_total{outcome}`.

The trace's header (`xsp.status`, `xsp.replay`, ...) goes on its replay model spans; a
live-only trace has none, so its header goes on its request span (the proxy's, its root),
which the store commits after the trace row: the export keeps the header of such a row until
that span comes (at most `WAITING_HEADERS` rows, the oldest given up first).

Endpoints (`--otlp-export`): `http(s)://host:4318/v1/traces` -> OTLP/HTTP protobuf;
`grpc://host:4317` or `--otlp-export-protocol grpc` -> OTLP/gRPC (plaintext unless `https://`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.trace.otlp_target import OtlpTarget, parse_target
from sidecar.trace.spans import LIVE_ONLY, Level, LevelStats, Span, Trace

log = logging.getLogger(__name__)

EXPORT_OUTCOMES = ("exported", "dropped", "failed")  # `xsp_otlp_export_total{outcome}`
SERVICE_NAME = "xsp-sidecar"
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("xsp-sidecar")
WAITING_HEADERS = 4096  # live-only trace rows whose request span has not been offered yet


def make_exporter(target: OtlpTarget, timeout_s: float = 10.0) -> SpanExporter:
    """OpenTelemetry's own OTLP span exporter for `target`."""
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(
            endpoint=target.endpoint, insecure=target.insecure, timeout=int(timeout_s)
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=target.endpoint, timeout=int(timeout_s))


# --- conversion -----------------------------------------------------------------------------


def _value(value: Any) -> Any:
    """An OTel attribute value: scalars as they are, flat scalar lists as tuples, else JSON."""
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple) and value:
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and kinds <= {str, bool, int, float}:
            return tuple(value)
    return json.dumps(value, separators=(",", ":"), default=str)


def _trace_attributes(trace: Trace, stats: Sequence[LevelStats]) -> dict[str, Any]:
    """What the trace header and the leveled runs add to a replay model span."""
    attrs: dict[str, Any] = {
        "xsp.model": trace.model,
        "xsp.model_version": trace.model_version,
        "xsp.runtime": trace.runtime,
        "xsp.device": trace.device,
        "xsp.sample_reason": trace.sample_reason,
        "xsp.status": trace.status,
    }
    if trace.batch_size is not None:
        attrs["xsp.batch_size"] = trace.batch_size
    if trace.error:
        attrs["xsp.error"] = trace.error
    if trace.attributes.get("replay"):  # why no replay ran (`not_replayable: ...`)
        attrs["xsp.replay"] = str(trace.attributes["replay"])
    for stat in stats:
        attrs[f"xsp.latency_ns.{stat.level.value}"] = stat.trimmed_mean_ns
        attrs[f"xsp.overhead_ratio.{stat.level.value}"] = stat.overhead_ratio
    return attrs


def to_otel_span(
    span: Span, resource: Resource, extra: Mapping[str, Any] | None = None
) -> ReadableSpan:
    """One stored span as an OTel span: same ids, parent, timestamps; `xsp.*` attributes."""
    trace_id = int(span.trace_id, 16)
    attrs: dict[str, Any] = {
        "xsp.level": span.level.value,
        "xsp.source": span.source.value,
        "xsp.kind": span.kind,
        "xsp.index": span.index,
    }
    if span.duration_ns is not None:
        attrs["xsp.duration_ns"] = span.duration_ns
    if span.run_level is not None:
        attrs["xsp.run_level"] = span.run_level.value
    for key, value in span.attributes.items():
        if value is not None:
            attrs[f"xsp.{key}"] = _value(value)
    attrs.update(extra or {})
    parent = (
        SpanContext(trace_id, int(span.parent_id, 16), is_remote=False, trace_flags=_SAMPLED)
        if span.parent_id
        else None
    )
    status = Status(StatusCode.UNSET)
    if attrs.get("xsp.status") == "error" or attrs.get("xsp.grpc_code") not in (None, "OK"):
        status = Status(StatusCode.ERROR)
    kind = SpanKind.SERVER if span.level is Level.REQUEST else SpanKind.INTERNAL
    return ReadableSpan(
        name=span.name,
        context=SpanContext(trace_id, int(span.span_id, 16), is_remote=False, trace_flags=_SAMPLED),
        parent=parent,
        resource=resource,
        attributes=attrs,
        kind=kind,
        status=status,
        start_time=span.start_ns,
        end_time=span.end_ns,
        instrumentation_scope=_SCOPE,
    )


def to_otel_spans(
    spans: Iterable[Span],
    resource: Resource,
    trace: Trace | None = None,
    level_stats: Sequence[LevelStats] = (),
) -> list[ReadableSpan]:
    """A trace's spans; the header and level statistics go on its replay model spans (a
    live-only trace's on its request span)."""
    header = _trace_attributes(trace, level_stats) if trace is not None else None
    on = Level.REQUEST if trace is not None and trace.status == LIVE_ONLY else Level.MODEL
    return [to_otel_span(s, resource, header if s.level is on else None) for s in spans]


# --- export ---------------------------------------------------------------------------------


class _CountingExporter(SpanExporter):
    """Counts each batch the real exporter sends as exported or failed, per span."""

    def __init__(self, inner: SpanExporter, owner: OtlpTraceExport) -> None:
        self.inner = inner
        self.owner = owner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # e.g. connection refused: the batch is lost, counted
            self.owner._count("failed", len(spans), exc)
            return SpanExportResult.FAILURE
        ok = result is SpanExportResult.SUCCESS
        self.owner._count("exported" if ok else "failed", len(spans), None if ok else result)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class OtlpTraceExport:
    """A bounded, batched OTLP export of stored spans; never blocks its callers.

    `max_queue_size` spans may wait; the SDK's processor exports up to `max_batch` at a time
    every `schedule_delay_ms` (or sooner when a batch is full).
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int = 8192,
        max_batch: int = 512,
        schedule_delay_ms: int = 2000,
        export_timeout_ms: int = 30000,
        resource: Resource | None = None,
    ) -> None:
        self.resource = resource or Resource.create({"service.name": SERVICE_NAME})
        self.exported = 0
        self.dropped = 0
        self.failed = 0
        self.last_error: str = ""
        self._lock = threading.Lock()
        self._closed = False
        self._max_queue_size = max_queue_size
        # live-only trace rows by trace id, until their request span is offered (`offer`)
        self._waiting: OrderedDict[str, Trace] = OrderedDict()
        self._processor = BatchSpanProcessor(
            _CountingExporter(exporter, self),
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_ms,
            max_export_batch_size=min(max_batch, max_queue_size),
            export_timeout_millis=export_timeout_ms,
        )

    @classmethod
    def to(cls, url: str, protocol: str = "auto", **options: Any) -> OtlpTraceExport:
        """An export to `url` (see `parse_target`) with OpenTelemetry's OTLP exporter."""
        return cls(make_exporter(parse_target(url, protocol)), **options)

    def offer(
        self,
        spans: Sequence[Span],
        trace: Trace | None = None,
        level_stats: Sequence[LevelStats] = (),
    ) -> int:
        """Queue spans for export; returns how many were queued (the rest are dropped)."""
        trace = self._header_of(spans, trace)
        try:
            otel = to_otel_spans(spans, self.resource, trace, level_stats)
        except Exception as exc:  # a record that cannot be converted (bad id): not exported
            self._count("failed", len(spans), exc)
            return 0
        queued = 0
        processor = self._processor
        # the SDK's span queue: its own `queue` in 1.26, its BatchProcessor's `_queue` in newer SDKs
        inner = getattr(processor, "_batch_processor", None)
        waiting = inner._queue if inner is not None else getattr(processor, "queue")  # noqa: B009
        for span in otel:
            # A span that finds the queue full is dropped here, not handed on: the SDK would
            # drop its oldest span silently, or none where its thread took a batch between this
            # check and the append (then a drop counted here was exported too). One producer
            # (the writer's thread) and a consumer that only takes: after this check, the
            # append cannot overflow.
            if self._closed or len(waiting) >= self._max_queue_size:
                self._count("dropped", 1, None)
                continue
            processor.on_end(span)
            queued += 1
        return queued

    def _header_of(self, spans: Sequence[Span], trace: Trace | None) -> Trace | None:
        """The trace whose header goes with `spans` (one trace's): `trace`, or the live-only
        row kept for their request span. A live-only row offered without its request span is
        kept for it. (Called from one thread, the writer's, as `offer` is.)"""
        has_request = any(s.level is Level.REQUEST for s in spans)
        if trace is not None:
            if trace.status == LIVE_ONLY and not has_request:
                self._waiting[trace.trace_id] = trace
                while len(self._waiting) > WAITING_HEADERS:
                    self._waiting.popitem(last=False)
            return trace
        if has_request and spans:
            return self._waiting.pop(spans[0].trace_id, None)
        return None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export what is queued now; False when it did not finish within `timeout_s`."""
        return self._processor.force_flush(int(timeout_s * 1000))

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is queued, waiting at most `timeout_s` (an exporter retrying a dead
        endpoint goes on in its daemon thread and ends with the process)."""
        if self._closed:
            return
        self._closed = True
        stopper = threading.Thread(
            target=self._processor.shutdown, name="xsp-otlp-export-stop", daemon=True
        )
        stopper.start()
        stopper.join(timeout_s)
        if stopper.is_alive():
            log.warning(
                "OTLP export did not finish within %.1f s; queued spans are lost", timeout_s
            )

    def _count(self, outcome: str, n: int, error: object) -> None:
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + n)
        if error is not None:
            self.last_error = str(error)
            log.debug("OTLP export of %d span(s) failed: %s", n, error)


class OtlpExportCollector(Collector):
    """Exports `xsp_otlp_export_total{outcome}` (spans) from an export; None: nothing."""

    def __init__(
        self, export: OtlpTraceExport | None, registry: CollectorRegistry | None = None
    ) -> None:
        self.export = export
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterable[Metric]:
        export = self.export
        if export is None:
            return
        family = CounterMetricFamily(
            "xsp_otlp_export",
            "Stored spans sent to the OTLP trace endpoint (--otlp-export), by outcome",
            labels=["outcome"],
        )
        for outcome in EXPORT_OUTCOMES:
            family.add_metric([outcome], getattr(export, outcome))
        yield family
