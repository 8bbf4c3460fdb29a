"""Prometheus metrics of the data plane (names fixed in docs/contracts.md).

Registered on an injected `CollectorRegistry`. Label values stay bounded: an absent model name
or one no model could have (over `MAX_MODEL_NAME` characters, or with a control character) is
`_unknown`, models past `max_models` distinct names count under `_other`, and so do methods
past `max_methods` distinct names outside the known gRPC tables. Per-call numbers are plain
counters turned into metric families at scrape time, so the per-request cost is a few
dictionary look-ups and integer additions.

Both relays count here: the gRPC relay's calls in `codes`/`stats` (read and written by its C
walk too), the HTTP relay's in `http` (a `CallPlane` of the same shape); the per-call families
carry a `protocol` label (`grpc` | `http`) added at scrape time. The HTTP relay's refusals of
bad input are counted in `xsp_http_refused_total{reason}`.

A sampled call (one the sampling hook traced) also leaves an exemplar `{trace_id="..."}` on
the duration bucket it fell in (`record_exemplar`): the latest one per bucket per (method,
model), shown only in the OpenMetrics exposition, so a latency panel links to the trace.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Mapping
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from sidecar.backends import TRITON, MethodInfo
from sidecar.proxy.model_name import UNKNOWN_MODEL
from sidecar.proxy.stream_metrics import StreamMetrics

OTHER = "_other"
MAX_MODEL_NAME = 256  # longer names are not taken as label values

# 50 µs .. 10 s, dense below a millisecond (the relay adds ~0.1 ms; Triton answers in ~1 ms)
DURATION_BUCKETS = (
    50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6,
    1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3, 20e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

PROTOCOLS = ("grpc", "http")  # values of the per-call families' `protocol` label
# Reasons the HTTP relay refuses a request (`proxy/http/refusals.py`): `xsp_http_refused_total`
HTTP_REFUSALS = (
    "malformed", "header_too_large", "body_too_large", "header_timeout", "smuggling", "upgrade",
    "backend_unavailable",
)  # fmt: skip

# Observer hooks whose failures are counted: the label set of `xsp_observer_errors_total{hook}`.
OBSERVER_HOOKS = ("connection", "request_headers", "request_body", "stream_end", "stream_message")

_LE = [floatToGoString(b) for b in DURATION_BUCKETS] + ["+Inf"]


class CallStats:
    """Duration histogram and byte counts of one (method, model) label pair."""

    __slots__ = ("buckets", "count", "exemplars", "request_bytes", "response_bytes", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)  # last one: +Inf
        self.count = 0
        self.sum = 0.0
        self.request_bytes = 0
        self.response_bytes = 0
        # the latest sampled call's exemplar per bucket; None until a sampled call ends
        self.exemplars: list[Exemplar | None] | None = None


class _CallCollector(Collector):
    """Exposes the per-call families from plain counters (see `ProxyMetrics.record`)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return self._families([], [], {})

    def collect(self) -> list[Metric]:
        m = self.metrics
        planes = [
            ("grpc", list(m.codes.items()), list(m.stats.items())),
            ("http", list(m.http.codes.items()), list(m.http.stats.items())),
        ]
        return self._families(
            [(p, codes) for p, codes, _ in planes],
            [(p, stats) for p, _, stats in planes],
            dict(m.observer_errors),
        )

    @staticmethod
    def _families(
        codes: list[tuple[str, list[tuple[tuple[str, str, str], int]]]],
        stats: list[tuple[str, list[tuple[tuple[str, str], CallStats]]]],
        observer_errors: dict[str, int],
    ) -> list[Metric]:
        requests = CounterMetricFamily(
            "xsp_requests",
            "Calls relayed (gRPC and HTTP), by method, model, gRPC status code (an HTTP call's "
            "error class) and protocol.",
            labels=["method", "model", "grpc_code", "protocol"],
        )
        for protocol, plane_codes in codes:
            for labels, value in plane_codes:
                requests.add_metric([*labels, protocol], value)
        duration = HistogramMetricFamily(
            "xsp_request_duration_seconds",
            "Time from a call's request headers to the end of its response, seen by the relay.",
            labels=["method", "model", "protocol"],
        )
        request_bytes = CounterMetricFamily(
            "xsp_request_bytes",
            "Request body bytes sent by clients (gRPC: HTTP/2 DATA, gRPC-framed messages; "
            "HTTP: the body, de-chunked).",
            labels=["method", "model", "protocol"],
        )
        response_bytes = CounterMetricFamily(
            "xsp_response_bytes",
            "Response body bytes sent by the backend (gRPC: HTTP/2 DATA, gRPC-framed "
            "messages; HTTP: the body, de-chunked).",
            labels=["method", "model", "protocol"],
        )
        for protocol, plane_stats in stats:
            for pair, st in plane_stats:
                pair_labels = [*pair, protocol]
                duration.add_metric(pair_labels, _buckets(st), sum_value=st.sum)
                request_bytes.add_metric(pair_labels, st.request_bytes)
                response_bytes.add_metric(pair_labels, st.response_bytes)
        observer = CounterMetricFamily(
            "xsp_observer_errors",
            "Calls of the sampling observer's hooks that failed (the call itself is still "
            "relayed), by hook.",
            labels=["hook"],
        )
        for hook in OBSERVER_HOOKS:
            observer.add_metric([hook], observer_errors.get(hook, 0))
        return [requests, duration, request_bytes, response_bytes, observer]


def _buckets(
    st: CallStats,
) -> list[tuple[str, float] | tuple[str, float, Exemplar]]:
    """Cumulative buckets of one label pair, each with its exemplar where it has one."""
    counts = accumulate(st.buckets)
    exemplars = st.exemplars
    if exemplars is None:
        return list(zip(_LE, counts, strict=True))
    return [
        (le, count) if ex is None else (le, count, ex)
        for le, count, ex in zip(_LE, counts, list(exemplars), strict=True)
    ]


class CallPlane:
    """Per-call counters of one protocol's relay: `codes` (method, model, code) -> calls and
    `stats` (method, model) -> `CallStats`, labels already bounded (`ProxyMetrics.
    model_label`/`method_label`). Written by the event-loop thread only."""

    __slots__ = ("codes", "stats")

    def __init__(self) -> None:
        self.codes: dict[tuple[str, str, str], int] = {}
        self.stats: dict[tuple[str, str], CallStats] = {}

    def record(
        self,
        method: str,
        model: str,
        code: str,
        duration_s: float,
        request_bytes: int,
        response_bytes: int,
    ) -> None:
        """Count one ended call (labels already bounded). Call from one thread only."""
        self.record_in(
            self.call_stats(method, model), (method, model, code),
            duration_s, request_bytes, response_bytes,
        )  # fmt: skip

    def call_stats(self, method: str, model: str) -> CallStats:
        """The counters of one label pair, created on first use (a pair is on /metrics from
        its first ended call): a caller that ends many calls of one pair keeps it."""
        st = self.stats.get((method, model))
        if st is None:
            st = self.stats[(method, model)] = CallStats()
        return st

    def record_in(
        self,
        st: CallStats,
        key: tuple[str, str, str],
        duration_s: float,
        request_bytes: int,
        response_bytes: int,
    ) -> None:
        """`record` into counters `call_stats` gave, `key` their (method, model, code)."""
        codes = self.codes
        codes[key] = codes.get(key, 0) + 1
        st.buckets[bisect_left(DURATION_BUCKETS, duration_s)] += 1
        st.count += 1
        st.sum += duration_s
        st.request_bytes += request_bytes
        st.response_bytes += response_bytes

    def count(self, method: str, model: str, code: str) -> None:
        """Count one ended call whose duration is unknown (labels already bounded)."""
        key = (method, model, code)
        self.codes[key] = self.codes.get(key, 0) + 1


class ProxyMetrics(CallPlane):
    """The relay's counters, gauges and histogram on one registry; as a `CallPlane`, the gRPC
    relay's per-call counters (`http` holds the HTTP relay's).

    Per-call numbers are kept in plain Python counters written only by the relay's event-loop
    thread and turned into metric families when the registry is scraped: recording a call is
    a couple of dictionary look-ups and integer additions, with no locks.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        max_models: int = 100,
        max_methods: int = 50,
        methods: Mapping[bytes, MethodInfo] = TRITON.by_path,
    ) -> None:
        if max_models < 1:
            raise ValueError("max_models must be at least 1")
        self.max_models = max_models
        self.max_methods = max_methods
        # the configured backend's methods (`Backend.by_path`: Triton's, the default
        # --backend-protocol, unless given): the calls labelled by method and model name
        self.by_path = methods
        self.open_streams = 0  # calls started and not yet ended (the in-flight gauge)
        # failures of the observer's hooks, by hook (written by the event-loop thread only)
        self.observer_errors = dict.fromkeys(OBSERVER_HOOKS, 0)
        # per-call counters, also read and written by the C walk (native.INTERFACE)
        super().__init__()
        self.http = CallPlane()  # the HTTP relay's (`proxy/http`)
        self.http_open = 0  # HTTP requests forwarded and not yet answered in full
        registry.register(_CallCollector(self))
        self.in_flight = Gauge(
            "xsp_requests_in_flight",
            "Calls (gRPC and HTTP) started and not yet ended.",
            registry=registry,
        )
        self.in_flight.set_function(lambda: self.open_streams + self.http_open)
        self.http_refused = Counter(
            "xsp_http_refused",
            "HTTP requests the relay answered itself and never forwarded (then closed the "
            "connection), by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in HTTP_REFUSALS:
            self.http_refused.labels(reason)
        self.connections_active = Gauge(
            "xsp_connections_active", "Client connections open now.", registry=registry
        )
        self.connections = Counter(
            "xsp_connections", "Client connections accepted.", registry=registry
        )
        self.backend_connect_failures = Counter(
            "xsp_backend_connect_failures",
            "Connections to the backend that could not be opened.",
            registry=registry,
        )
        self.observation_failures = Counter(
            "xsp_observation_failures",
            "Connections whose observation failed (bytes kept flowing): not HTTP/2 or framing "
            "lost (observation stopped), or a header block could not be decoded (calls counted "
            "by stream from then on, see xsp_unobserved_streams_total); http_response: an "
            "HTTP backend's response could not be parsed, http_internal: reading an HTTP "
            "client's requests raised (either: that connection relayed unobserved).",
            ["reason"],
            registry=registry,
        )
        self.unobserved_streams = Counter(
            "xsp_unobserved_streams",
            "gRPC calls counted by stream id only: their request headers could not be decoded "
            "(method and model _unknown, not offered for sampling).",
            registry=registry,
        )
        self.refused_streams = Counter(
            "xsp_refused_streams",
            "Streams a draining relay refused (RST_STREAM REFUSED_STREAM, never forwarded): the "
            "client opened them after the final GOAWAY and may retry them elsewhere.",
            registry=registry,
        )
        self.backend_up = Gauge(
            "xsp_backend_up",
            "1 while the backend accepts connections and answers its readiness check.",
            registry=registry,
        )
        # label values taken so far (the C walk reads them: native.INTERFACE)
        self.models: set[str] = set()
        self.methods: set[str] = {info.name for info in methods.values()}  # the backend's
        self._known_methods = len(self.methods)
        # inference streams: their histogram holds inferences, not the sampled stream's life
        self._per_message = {info.name for info in methods.values() if info.per_message}
        self._lock = threading.Lock()
        self.streams = StreamMetrics(registry, DURATION_BUCKETS)  # inference streams' own

    def model_label(self, name: str | None) -> str:
        """Bounded `model` label value for a model name read from a request."""
        if not name:
            return UNKNOWN_MODEL
        if name in self.models:
            return name
        if len(name) > MAX_MODEL_NAME or not name.isprintable():
            return UNKNOWN_MODEL
        with self._lock:
            if len(self.models) < self.max_models:
                self.models.add(name)
                return name
        return OTHER

    def method_label(self, name: str) -> str:
        """Bounded `method` label value."""
        if name in self.methods:
            return name
        with self._lock:
            if len(self.methods) < self._known_methods + self.max_methods:
                self.methods.add(name)
                return name
        return OTHER

    def record_exemplar(
        self, method: str, model: str, duration_s: float, trace_id: str, protocol: str = "grpc"
    ) -> None:
        """Link a sampled call to its trace: after `record` counted the call (same labels and
        duration), keep `{trace_id}` as the exemplar of the bucket it fell in, replacing the
        one before. Call from the thread that calls `record`. `protocol`: "http" for a call
        of the HTTP relay (`http.stats`)."""
        stats = self.http.stats if protocol == "http" else self.stats
        st = stats.get((method, model))
        if st is None or method in self._per_message:  # no bucket for this call's duration
            return
        exemplars = st.exemplars
        if exemplars is None:
            exemplars = st.exemplars = [None] * len(st.buckets)
        exemplars[bisect_left(DURATION_BUCKETS, duration_s)] = Exemplar(
            {"trace_id": trace_id}, duration_s, time.time()
        )
