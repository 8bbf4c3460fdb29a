"""Prometheus view of the trace writer (a custom collector over its plain counters).

The writer counts on its own threads in plain ints; this reads them at scrape time, so
nothing on the write path touches prometheus_client. Every `outcome` is exported (zeros
included), so the label set is fixed. Names are fixed in docs/contracts.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.trace.writer import TraceWriter

# How a submitted item (a trace, or a batch of late spans) left the writer: the label set of
# `xsp_trace_writer_items_total{outcome}`.
WRITE_OUTCOMES = (
    "written",  # committed
    "failed",  # its write failed (logged, passed to on_error)
    "dropped",  # refused at submit: the queue was full or the writer closed
)


class TraceWriterCollector(Collector):
    """Exports `xsp_trace_writer_*` and `xsp_trace_retention_*` from a writer (None: the
    store could not be opened, nothing is exported)."""

    def __init__(
        self, writer: TraceWriter | None, registry: CollectorRegistry | None = None
    ) -> None:
        self.writer = writer
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterable[Metric]:
        writer = self.writer
        if writer is None:
            return
        items = CounterMetricFamily(
            "xsp_trace_writer_items",
            "Items handed to the trace writer (a trace or a batch of late spans), by outcome",
            labels=["outcome"],
        )
        for outcome, value in zip(
            WRITE_OUTCOMES, (writer.written, writer.failed, writer.dropped), strict=True
        ):
            items.add_metric([outcome], value)
        yield items
        for name, documentation, value in (
            (
                "xsp_trace_writer_callback_errors",
                "Calls of the trace writer's on_error / on_written callbacks that raised",
                writer.callback_errors,
            ),
            (
                "xsp_trace_retention_deleted",
                "Traces deleted by retention passes",
                writer.retention_deleted,
            ),
            (
                "xsp_trace_retention_errors",
                "Retention passes that failed",
                writer.retention_errors,
            ),
        ):
            yield CounterMetricFamily(name, documentation, value=value)
