"""ProxyMetrics labels stay bounded; values land on the injected registry."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from sidecar.backends import TF_SERVING
from sidecar.proxy.metrics import OTHER, ProxyMetrics
from tests.harness.metrics_text import exemplars, sample_value, scrape_registry


def test_model_labels_are_capped() -> None:
    reg = CollectorRegistry()
    metrics = ProxyMetrics(reg, max_models=2)
    assert metrics.model_label(None) == "_unknown"
    assert metrics.model_label("") == "_unknown"
    assert [metrics.model_label(m) for m in ("a", "b", "c", "a", "d")] == [
        "a",
        "b",
        OTHER,
        "a",
        OTHER,
    ]


def test_names_no_model_could_have_take_no_label_slot() -> None:
    metrics = ProxyMetrics(CollectorRegistry(), max_models=2)
    assert metrics.model_label("x" * 10_000) == "_unknown"
    assert metrics.model_label("nul\x00byte") == "_unknown"
    assert metrics.model_label("new\nline") == "_unknown"
    assert [metrics.model_label(m) for m in ("a", "b")] == ["a", "b"]  # both slots still free


def test_method_labels_are_capped_but_the_backends_methods_always_pass() -> None:
    metrics = ProxyMetrics(CollectorRegistry(), max_methods=1)  # Triton's methods
    assert metrics.method_label("Custom1") == "Custom1"
    assert metrics.method_label("Custom2") == OTHER
    assert metrics.method_label("ModelInfer") == "ModelInfer"
    assert metrics.method_label("Predict") == OTHER  # TF-Serving's: not this backend's
    tf = ProxyMetrics(CollectorRegistry(), max_methods=1, methods=TF_SERVING.by_path)
    assert tf.method_label("Custom1") == "Custom1"
    assert tf.method_label("Predict") == "Predict"
    assert tf.method_label("ModelInfer") == OTHER


def test_record_counts_and_histogram() -> None:
    reg = CollectorRegistry()
    metrics = ProxyMetrics(reg)
    for duration in (60e-6, 150e-6, 0.002):
        metrics.record("ModelInfer", "m", "OK", duration, 100, 50)
    metrics.record("ModelInfer", "m", "NOT_FOUND", 0.01, 10, 0)
    get = reg.get_sample_value
    assert (
        get(
            "xsp_requests_total",
            {"method": "ModelInfer", "model": "m", "grpc_code": "OK", "protocol": "grpc"},
        )
        == 3
    )
    labels = {"method": "ModelInfer", "model": "m", "protocol": "grpc"}
    assert get("xsp_request_duration_seconds_bucket", {**labels, "le": "0.0001"}) == 1
    assert get("xsp_request_duration_seconds_bucket", {**labels, "le": "0.0002"}) == 2
    assert get("xsp_request_duration_seconds_count", labels) == 4
    assert get("xsp_request_bytes_total", labels) == 310
    assert get("xsp_response_bytes_total", labels) == 150


def test_a_sampled_call_leaves_its_trace_id_on_its_bucket_in_openmetrics_only() -> None:
    reg = CollectorRegistry()
    metrics = ProxyMetrics(reg)
    metrics.record_exemplar("ModelInfer", "m", 0.002, "00" * 16)  # never counted: ignored
    for duration, trace_id in ((0.0015, "ab" * 16), (0.0018, "cd" * 16), (0.04, "ef" * 16)):
        metrics.record("ModelInfer", "m", "OK", duration, 100, 50)
        metrics.record_exemplar("ModelInfer", "m", duration, trace_id)
    metrics.record("ModelInfer", "m", "OK", 0.0001, 100, 50)  # not sampled: no exemplar
    metrics.record("Predict", "n", "OK", 0.003, 1, 1)

    found = exemplars(scrape_registry(reg, openmetrics=True), "xsp_request_duration_seconds_bucket")
    by_le = {labels["le"]: ex for labels, ex in found}
    assert {labels["model"] for labels, _ in found} == {"m"}
    assert sorted(by_le) == ["0.002", "0.05"]  # the buckets the sampled calls fell in
    assert by_le["0.002"].labels == {"trace_id": "cd" * 16}  # the latest one per bucket
    assert by_le["0.002"].value == 0.0018
    assert by_le["0.05"].labels == {"trace_id": "ef" * 16}
    assert by_le["0.05"].timestamp is not None
    assert abs(float(by_le["0.05"].timestamp) - time.time()) < 60

    plain = scrape_registry(reg)
    assert "trace_id" not in plain and " # {" not in plain
    labels = {"method": "ModelInfer", "model": "m", "protocol": "grpc"}
    assert sample_value(plain, "xsp_request_duration_seconds_count", **labels) == 4
    assert sample_value(plain, "xsp_request_duration_seconds_bucket", le="0.002", **labels) == 3
