"""Prometheus metrics of inference streams (names fixed in docs/contracts.md).

Each request message of a `ModelStreamInfer` stream is one inference, counted under
`xsp_requests_total` / `xsp_request_duration_seconds` (`ProxyMetrics.record`). This module
holds what only streamed inferences have: time to first response, gaps between responses,
responses per request, requests whose final response could not be seen, the anomalies of
reading a stream, and the streams themselves (open, ended, lifetime, messages). Like
`ProxyMetrics`, numbers are plain counters written by the relay's event-loop thread and turned
into families at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# a stream lives from a second to hours (a client keeps it open)
STREAM_BUCKETS = (0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 4 * 3600.0)
# Reasons of `xsp_stream_anomalies_total` (see docs/contracts.md).
ANOMALIES = ("unreadable", "unmatched", "cut", "cancelled", "overflow")


class Histogram:
    """Bucket counts, count and sum of one label set."""

    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family_buckets(self) -> list[tuple[str, float]]:
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        return list(zip(les, accumulate(self.buckets), strict=True))


Pair = tuple[str, str]  # (method, model) label values, already bounded


class StreamMetrics:
    """Per-inference extras and per-stream numbers of inference streams."""

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets  # of the per-inference histograms
        self.first_response: dict[Pair, Histogram] = {}
        self.gaps: dict[Pair, Histogram] = {}
        self.responses: dict[Pair, int] = {}
        self.final_unseen: dict[Pair, int] = {}
        self.streams: dict[tuple[str, str], int] = {}  # (method, grpc_code) -> ended streams
        self.lifetime: dict[str, Histogram] = {}
        self.messages: dict[tuple[str, str], int] = {}  # (method, direction)
        self.open: dict[str, int] = {}
        self.anomalies = Counter(
            "xsp_stream_anomalies",
            "What could not be read on inference streams (forwarding went on), by reason: "
            "unreadable message, response matching no pending request, stream cut inside a "
            "message, client cancelled with requests pending, pending table full.",
            ["reason"],
            registry=registry,
        )
        # the children counted per message, looked up once
        self.unreadable, self.unmatched, self.cut, self.cancelled, self.overflow = (
            self.anomalies.labels(reason) for reason in ANOMALIES
        )
        registry.register(_StreamCollector(self))

    def histogram(self, table: dict[Pair, Histogram], pair: Pair) -> Histogram:
        hist = table.get(pair)
        if hist is None:
            hist = table[pair] = Histogram(self.buckets)
        return hist

    def stream_opened(self, method: str) -> None:
        self.open[method] = self.open.get(method, 0) + 1

    def stream_ended(
        self, method: str, code: str, lifetime_s: float, requests: int, responses: int
    ) -> None:
        self.open[method] = self.open.get(method, 0) - 1
        key = (method, code)
        self.streams[key] = self.streams.get(key, 0) + 1
        hist = self.lifetime.get(method)
        if hist is None:
            hist = self.lifetime[method] = Histogram(STREAM_BUCKETS)
        hist.observe(lifetime_s)
        for direction, n in (("request", requests), ("response", responses)):
            mkey = (method, direction)
            self.messages[mkey] = self.messages.get(mkey, 0) + n


Kind = type[CounterMetricFamily] | type[GaugeMetricFamily] | type[HistogramMetricFamily]
PAIR = ("method", "model")
# name, kind, help, labels, the `StreamMetrics` table it is read from (in scrape order)
FAMILIES: tuple[tuple[str, Kind, str, tuple[str, ...], str], ...] = (
    ("xsp_first_response_seconds", HistogramMetricFamily,
     "Streamed inferences: from the request message to its first response.", PAIR,
     "first_response"),
    ("xsp_response_gap_seconds", HistogramMetricFamily,
     "Streamed inferences: time between two responses to one request (per token).", PAIR,
     "gaps"),
    ("xsp_responses", CounterMetricFamily,
     "Streamed inferences: responses with data or an error (an empty final response is not "
     "counted).", PAIR, "responses"),
    ("xsp_final_response_unseen", CounterMetricFamily,
     "Streamed inferences ended at their last response seen: the client did not ask for "
     "empty final responses, so the final one could not be observed.", PAIR, "final_unseen"),
    ("xsp_streams", CounterMetricFamily,
     "Inference streams ended, by method and the stream's gRPC status.",
     ("method", "grpc_code"), "streams"),
    ("xsp_stream_duration_seconds", HistogramMetricFamily,
     "Inference streams: from the stream's request headers to its end.", ("method",),
     "lifetime"),
    ("xsp_stream_messages", CounterMetricFamily,
     "Messages on ended inference streams, by direction (request, response).",
     ("method", "direction"), "messages"),
    ("xsp_streams_open", GaugeMetricFamily, "Inference streams open now.", ("method",), "open"),
)  # fmt: skip


def _family(
    kind: Kind, name: str, doc: str, labels: tuple[str, ...], table: dict[Any, Any]
) -> Metric:
    """One family holding a table's entries (keyed by a label value or a tuple of them)."""
    family = kind(name, doc, labels=list(labels))
    for key, value in list(table.items()):
        values = list(key) if isinstance(key, tuple) else [key]
        if isinstance(family, HistogramMetricFamily):
            family.add_metric(values, value.family_buckets(), sum_value=value.sum)
        else:
            family.add_metric(values, value)
    return family


class _StreamCollector(Collector):
    def __init__(self, metrics: StreamMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return self.collect()

    def collect(self) -> list[Metric]:
        return [
            _family(kind, name, doc, labels, getattr(self.metrics, table))
            for name, kind, doc, labels, table in FAMILIES
        ]
