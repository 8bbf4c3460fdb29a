"""Prometheus view of the OTLP receiver and the backend-span collector (a custom collector).

Both keep their own counters under their own locks; this reads a snapshot at scrape time, so
nothing on the receiving path touches prometheus_client. Every label value of `reason` and
`outcome` is exported (zeros included), so the label sets are fixed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.live.otlp_receiver import REJECT_REASONS, OtlpReceiver
from sidecar.live.triton_spans import DROP_REASONS, TRACE_OUTCOMES, TritonSpanCollector


def _labelled(
    name: str, documentation: str, label: str, values: Sequence[str], counts: Mapping[str, int]
) -> CounterMetricFamily:
    """A counter with one sample per label value of the fixed set `values`."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value in values:
        family.add_metric([value], counts.get(value, 0))
    return family


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
        for name, documentation, value in (
            (
                "xsp_otlp_accepted_payloads",
                "OTLP export requests accepted (HTTP 200)",
                stats.accepted,
            ),
            ("xsp_otlp_accepted_spans", "Spans in the accepted OTLP export requests", stats.spans),
            (
                "xsp_otlp_callback_errors",
                "Accepted OTLP payloads whose spans the sidecar failed to process",
                stats.callback_errors,
            ),
        ):
            yield CounterMetricFamily(name, documentation, value=value)
        yield _labelled(
            "xsp_otlp_rejected",
            "OTLP requests answered with an error (4xx/503), by reason",
            "reason",
            REJECT_REASONS,
            stats.rejected_by_reason,
        )
        yield GaugeMetricFamily(
            "xsp_otlp_connections_active",
            "Open connections to the OTLP receiver (at most 16; more are answered 503)",
            value=stats.active_connections,
        )

    def _collector_metrics(self) -> Iterable[Metric]:
        stats = self.spans.stats()
        for name, documentation, value in (
            (
                "xsp_otlp_pending_traces",
                "Backend traces waiting for their InferRequest span",
                stats.pending_traces,
            ),
            (
                "xsp_otlp_pending_spans",
                "Spans held for pending backend traces",
                stats.pending_spans,
            ),
            (
                "xsp_otlp_pending_bytes",
                "Approximate memory held by pending backend spans",
                stats.pending_bytes,
            ),
        ):
            yield GaugeMetricFamily(name, documentation, value=value)
        yield _labelled(
            "xsp_otlp_spans_dropped",
            "Backend spans not kept because a pending-span bound was reached, by bound",
            "reason",
            DROP_REASONS,
            stats.dropped_by_reason,
        )
        yield _labelled(
            "xsp_otlp_traces",
            "Backend traces emitted, by how they left the collector",
            "outcome",
            TRACE_OUTCOMES,
            stats.traces_by_outcome,
        )
        yield CounterMetricFamily(
            "xsp_otlp_trace_callback_errors",
            "Backend traces the sidecar failed to store or measure",
            value=stats.callback_errors,
        )
