"""Prometheus view of the OTLP receiver and the backend-span collector (a custom collector).

Both keep their own counters under their own locks; this reads a snapshot at scrape time, so
nothing on the receiving path touches prometheus_client. Every label value of `reason` and
`outcome` is exported (zeros included), so the label sets are fixed.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.live.otlp_receiver import REJECT_REASONS, OtlpReceiver
from sidecar.live.triton_spans import DROP_REASONS, TRACE_OUTCOMES, TritonSpanCollector


class OtlpMetricsCollector(Collector):
    """Exports `xsp_otlp_*` metrics from a receiver (None when it is off) and a span collector."""

    def __init__(
        self,
        receiver: OtlpReceiver | None,
        spans: TritonSpanCollector,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.receiver = receiver
        self.spans = spans
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterable[Metric]:
        yield from self._receiver_metrics()
        yield from self._collector_metrics()

    def _receiver_metrics(self) -> Iterable[Metric]:
        if self.receiver is None:
            return
        stats = self.receiver.stats()
        yield CounterMetricFamily(
            "xsp_otlp_accepted_payloads",
            "OTLP export requests accepted (HTTP 200)",
            value=stats.accepted,
        )
        yield CounterMetricFamily(
            "xsp_otlp_accepted_spans",
            "Spans in the accepted OTLP export requests",
            value=stats.spans,
        )
        rejected = CounterMetricFamily(
            "xsp_otlp_rejected",
            "OTLP requests answered with an error (4xx/503), by reason",
            labels=["reason"],
        )
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], stats.rejected_by_reason.get(reason, 0))
        yield rejected
        yield CounterMetricFamily(
            "xsp_otlp_callback_errors",
            "Accepted OTLP payloads whose spans the sidecar failed to process",
            value=stats.callback_errors,
        )
        yield GaugeMetricFamily(
            "xsp_otlp_connections_active",
            "Open connections to the OTLP receiver (at most 16; more are answered 503)",
            value=stats.active_connections,
        )

    def _collector_metrics(self) -> Iterable[Metric]:
        stats = self.spans.stats()
        yield GaugeMetricFamily(
            "xsp_otlp_pending_traces",
            "Backend traces waiting for their InferRequest span",
            value=stats.pending_traces,
        )
        yield GaugeMetricFamily(
            "xsp_otlp_pending_spans",
            "Spans held for pending backend traces",
            value=stats.pending_spans,
        )
        yield GaugeMetricFamily(
            "xsp_otlp_pending_bytes",
            "Approximate memory held by pending backend spans",
            value=stats.pending_bytes,
        )
        dropped = CounterMetricFamily(
            "xsp_otlp_spans_dropped",
            "Backend spans not kept because a pending-span bound was reached, by bound",
            labels=["reason"],
        )
        for reason in DROP_REASONS:
            dropped.add_metric([reason], stats.dropped_by_reason.get(reason, 0))
        yield dropped
        traces = CounterMetricFamily(
            "xsp_otlp_traces",
            "Backend traces emitted, by how they left the collector",
            labels=["outcome"],
        )
        for outcome in TRACE_OUTCOMES:
            traces.add_metric([outcome], stats.traces_by_outcome.get(outcome, 0))
        yield traces
        yield CounterMetricFamily(
            "xsp_otlp_trace_callback_errors",
            "Backend traces the sidecar failed to store or measure",
            value=stats.callback_errors,
        )
