"""Reading a Prometheus text exposition (a `/metrics` scrape), for the demo, tests and benches.

Parsing is `prometheus_client.parser`'s. It names a counter's family without `_total` while its
samples keep it, so everything here looks samples up by sample name (`xsp_requests_total`,
`xsp_request_duration_seconds_count`), as they appear in the text.
"""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Exemplar, Sample

# what Prometheus asks for when its exemplar storage is on; the answer carries exemplars
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def scrape(url: str, timeout: float = 5.0, *, openmetrics: bool = False) -> str:
    """The text at `url` (e.g. `http://127.0.0.1:9090/metrics`), in the OpenMetrics format
    (with exemplars) when `openmetrics` is set, else in Prometheus' plain text format."""
    request = urllib.request.Request(url, headers={"Accept": OPENMETRICS} if openmetrics else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return str(response.read().decode())


def scrape_registry(
    registry: CollectorRegistry, timeout: float = 5.0, *, openmetrics: bool = False
) -> str:
    """Serve `registry` on a real HTTP port (0: any free one), scrape it once, stop serving."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        return scrape(url, timeout, openmetrics=openmetrics)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def sample_map(text: str) -> dict[SampleKey, float]:
    """Every sample as `{(name, sorted label pairs): value}`."""
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value) for s in samples(text)}


def families(text: str) -> list[Metric]:
    """The metric families of an exposition, with their types and samples."""
    return list(text_string_to_metric_families(text))


def samples(text: str) -> list[Sample]:
    """Every sample of an exposition, in order."""
    return [sample for family in families(text) for sample in family.samples]


def exemplars(openmetrics_text: str, name: str) -> list[tuple[dict[str, str], Exemplar]]:
    """The exemplars on the samples `name` of an OpenMetrics exposition (which the parser
    validates as a whole), each with its sample's labels."""
    return [
        (sample.labels, sample.exemplar)
        for family in openmetrics_parser.text_string_to_metric_families(openmetrics_text)
        for sample in family.samples
        if sample.name == name and sample.exemplar is not None
    ]


PER_CALL = (
    "xsp_requests",
    "xsp_request_duration_seconds",
    "xsp_request_bytes",
    "xsp_response_bytes",
)


def with_protocol(name: str, labels: dict[str, str], protocol: str = "grpc") -> dict[str, str]:
    """`labels` of a sample `name` with `protocol` added where `name` is one of the per-call
    families' samples (which carry it) and `labels` name a method but no protocol."""
    if "method" in labels and "protocol" not in labels and name.startswith(PER_CALL):
        return {**labels, "protocol": protocol}
    return labels


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels are exactly `labels`; None when absent.
    A per-call family's `protocol` label may be left out for `protocol="grpc"` (the series
    every gRPC test asks for; an HTTP call's are asked for with `protocol="http"`)."""
    if "protocol" not in labels:
        grpc = {**labels, "protocol": "grpc"}
        for sample in samples(text):
            if sample.name == name and sample.labels in (labels, grpc):
                return float(sample.value)
        return None
    for sample in samples(text):
        if sample.name == name and sample.labels == labels:
            return float(sample.value)
    return None


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (0 when there are none)."""
    return sum(
        float(s.value)
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def sums_by(text: str, name: str, label: str) -> dict[str, float]:
    """The samples `name` summed by the value of `label` ("" where a sample lacks it)."""
    totals: dict[str, float] = {}
    for s in samples(text):
        if s.name == name:
            key = s.labels.get(label, "")
            totals[key] = totals.get(key, 0.0) + float(s.value)
    return totals
