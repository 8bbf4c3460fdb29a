"""Reading a /metrics scrape: an exposition that prometheus_client wrote, served over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tests.harness.metrics_text import families, sample_sum, sample_value, samples, scrape, sums_by


@pytest.fixture
def text() -> Iterator[str]:
    registry = CollectorRegistry()
    requests = Counter("xsp_requests", "calls", ["model", "grpc_code"], registry=registry)
    requests.labels("a", "OK").inc(3)
    requests.labels("a", "NOT_FOUND").inc()
    requests.labels("b", "OK").inc(2)
    Gauge("xsp_up", "up", registry=registry).set(1)
    Histogram("xsp_latency_seconds", "lat", ["model"], registry=registry).labels("a").observe(0.2)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield scrape(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_sample_value_needs_the_exact_label_set(text: str) -> None:
    assert sample_value(text, "xsp_requests_total", model="a", grpc_code="OK") == 3
    assert sample_value(text, "xsp_requests_total", model="a") is None
    assert sample_value(text, "xsp_up") == 1
    assert sample_value(text, "xsp_missing") is None


def test_sample_sum_adds_the_samples_that_include_the_labels(text: str) -> None:
    assert sample_sum(text, "xsp_requests_total") == 6
    assert sample_sum(text, "xsp_requests_total", model="a") == 4
    assert sample_sum(text, "xsp_requests_total", grpc_code="OK") == 5
    assert sample_sum(text, "xsp_requests_total", model="c") == 0
    assert sample_sum(text, "xsp_latency_seconds_count", model="a") == 1


def test_sums_by_a_label_and_families(text: str) -> None:
    assert sums_by(text, "xsp_requests_total", "grpc_code") == {"OK": 5, "NOT_FOUND": 1}
    types = {f.name: f.type for f in families(text)}
    assert types["xsp_requests"] == "counter" and types["xsp_latency_seconds"] == "histogram"
    assert {s.name for s in samples(text)} >= {"xsp_requests_total", "xsp_latency_seconds_sum"}
