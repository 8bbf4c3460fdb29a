"""Reading a Prometheus text exposition (a `/metrics` scrape), for the demo, tests and benches.

Parsing is `prometheus_client.parser`'s. It names a counter's family without `_total` while its
samples keep it, so everything here looks samples up by sample name (`xsp_requests_total`,
`xsp_request_duration_seconds_count`), as they appear in the text.
"""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(url: str, timeout: float = 5.0) -> str:
    """The text at `url` (e.g. `http://127.0.0.1:9090/metrics`)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def scrape_registry(registry: CollectorRegistry, timeout: float = 5.0) -> str:
    """Serve `registry` on a real HTTP port (0: any free one), scrape it once, stop serving."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        return scrape(f"http://127.0.0.1:{server.server_port}/metrics", timeout)
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


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels are exactly `labels`; None when absent."""
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
