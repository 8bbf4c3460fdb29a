"""`xsp_otlp_*` metrics: the receiver and the span collector seen through a fresh registry."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.live.otlp_metrics import OtlpMetricsCollector
from sidecar.live.otlp_receiver import OtlpReceiver, parse_otlp_json
from sidecar.live.triton_spans import DROP_REASONS, TRACE_OUTCOMES, TritonSpanCollector

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "otlp" / "triton-2.51-two-requests.json"


def test_collector_metrics_without_a_receiver() -> None:
    registry = CollectorRegistry()
    spans = TritonSpanCollector(lambda trace: None, max_spans_per_trace=2)
    OtlpMetricsCollector(None, spans, registry)
    compute = next(s for s in parse_otlp_json(FIXTURE.read_bytes()) if s.name == "compute")
    spans.add([dataclasses.replace(compute, span_id=f"{i + 1:016x}") for i in range(5)])
    assert registry.get_sample_value("xsp_otlp_pending_traces") == 1
    assert registry.get_sample_value("xsp_otlp_pending_spans") == 2
    assert registry.get_sample_value("xsp_otlp_pending_bytes") == spans.stats().pending_bytes > 0
    dropped = {
        reason: registry.get_sample_value("xsp_otlp_spans_dropped_total", {"reason": reason})
        for reason in DROP_REASONS
    }
    assert dropped == {"trace_spans": 3, "trace_bytes": 0, "total_spans": 0, "total_bytes": 0}
    assert registry.get_sample_value("xsp_otlp_accepted_payloads_total") is None  # receiver off
    spans.close()
    outcomes = {
        outcome: registry.get_sample_value("xsp_otlp_traces_total", {"outcome": outcome})
        for outcome in TRACE_OUTCOMES
    }
    assert outcomes == {"complete": 0, "expired": 0, "evicted": 0, "flushed": 1}
    assert registry.get_sample_value("xsp_otlp_pending_spans") == 0


def test_receiver_into_collector_over_http() -> None:
    registry = CollectorRegistry()
    with TritonSpanCollector(lambda trace: None) as spans, OtlpReceiver(spans.add, port=0) as rec:
        OtlpMetricsCollector(rec, spans, registry)
        request = urllib.request.Request(
            rec.url, data=FIXTURE.read_bytes(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()) == {}
        # both traces of the captured payload end with their InferRequest span
        assert registry.get_sample_value("xsp_otlp_traces_total", {"outcome": "complete"}) == 2
        assert registry.get_sample_value("xsp_otlp_accepted_spans_total") == 6
        assert registry.get_sample_value("xsp_otlp_pending_spans") == 0
