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
        for reason in ANOMALIES:
            self.anomalies.labels(reason)
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


class _StreamCollector(Collector):
    def __init__(self, metrics: StreamMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return self.collect()

    def collect(self) -> list[Metric]:
        m = self.metrics
        pair = ["method", "model"]
        first = HistogramMetricFamily(
            "xsp_first_response_seconds",
            "Streamed inferences: from the request message to its first response.",
            labels=pair,
        )
        for labels, hist in list(m.first_response.items()):
            first.add_metric(list(labels), hist.family_buckets(), sum_value=hist.sum)
        gaps = HistogramMetricFamily(
            "xsp_response_gap_seconds",
            "Streamed inferences: time between two responses to one request (per token).",
            labels=pair,
        )
        for labels, hist in list(m.gaps.items()):
            gaps.add_metric(list(labels), hist.family_buckets(), sum_value=hist.sum)
        responses = CounterMetricFamily(
            "xsp_responses",
            "Streamed inferences: responses with data or an error (an empty final response "
            "is not counted).",
            labels=pair,
        )
        for labels, n in list(m.responses.items()):
            responses.add_metric(list(labels), n)
        unseen = CounterMetricFamily(
            "xsp_final_response_unseen",
            "Streamed inferences ended at their last response seen: the client did not ask "
            "for empty final responses, so the final one could not be observed.",
            labels=pair,
        )
        for labels, n in list(m.final_unseen.items()):
            unseen.add_metric(list(labels), n)
        streams = CounterMetricFamily(
            "xsp_streams",
            "Inference streams ended, by method and the stream's gRPC status.",
            labels=["method", "grpc_code"],
        )
        for labels2, n in list(m.streams.items()):
            streams.add_metric(list(labels2), n)
        lifetime = HistogramMetricFamily(
            "xsp_stream_duration_seconds",
            "Inference streams: from the stream's request headers to its end.",
            labels=["method"],
        )
        for method, hist in list(m.lifetime.items()):
            lifetime.add_metric([method], hist.family_buckets(), sum_value=hist.sum)
        messages = CounterMetricFamily(
            "xsp_stream_messages",
            "Messages on ended inference streams, by direction (request, response).",
            labels=["method", "direction"],
        )
        for labels2, n in list(m.messages.items()):
            messages.add_metric(list(labels2), n)
        open_ = GaugeMetricFamily(
            "xsp_streams_open", "Inference streams open now.", labels=["method"]
        )
        for method, n in list(m.open.items()):
            open_.add_metric([method], n)
        return [first, gaps, responses, unseen, streams, lifetime, messages, open_]
