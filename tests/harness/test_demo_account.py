"""The demo's account of its profiles: a live-only profile is said to be stored (it is: its
trace holds the live side), one that timed out is not; its REST calls are set beside the gRPC
ones, each protocol against its own count; over a real store and a /metrics text that
prometheus_client wrote."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest

from sidecar.trace.schema import PROTOCOL
from sidecar.trace.spans import Level, Source, Span, Trace, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.demo.rest import RestTraffic
from tests.harness.demo.triton import DemoOptions, ForcedResult, account

REASON = "not_replayable: model 'ens' is served by 'tensorrt_plan'"


def _metrics(rest: int = 0, rest_other: int = 0) -> str:
    registry = CollectorRegistry()
    requests = Counter("xsp_requests", "calls", ["method", "protocol"], registry=registry)
    requests.labels("ModelInfer", "grpc").inc(4)
    if rest:
        requests.labels("ModelInfer", "http").inc(rest)
    if rest_other:
        requests.labels("ServerReady", "http").inc(rest_other)
    decisions = Counter("xsp_sampling_decisions", "decisions", ["decision"], registry=registry)
    decisions.labels("sampled").inc(4)
    profiles = Counter("xsp_profiles", "profiles", ["model", "outcome"], registry=registry)
    profiles.labels("cnn", "ok").inc()
    profiles.labels("ens", "live_only").inc(2)
    profiles.labels("cnn", "timeout").inc()
    return generate_latest(registry).decode()


def test_live_only_profiles_are_accounted_as_stored_traces(tmp_path: Path) -> None:
    db = tmp_path / "traces.db"
    with TraceStore(db) as store:
        store.write_trace(Trace(new_trace_id(), "cnn", 1, status="ok"), [])
        for _ in range(2):
            attrs = {"replay": REASON}
            store.write_trace(Trace(new_trace_id(), "ens", 1, status="live_only",
                                    attributes=attrs), [])  # fmt: skip
    log = tmp_path / "sidecar.log"
    log.write_text(f"WARNING profile of 'ens': live_only ({REASON})\n")
    options = DemoOptions(out=tmp_path, requests=4, forced=0)
    lines = account(options, {"error": 0}, ForcedResult(), _metrics(), db, log)
    live_only = next(i for i, line in enumerate(lines) if line.startswith("  live_only 2: "))
    assert lines[live_only] == (
        "  live_only 2: stored with their live side only (no replay can run the model: status "
        "live_only, the reason in the trace's `replay`); from sidecar.log:"
    )
    assert lines[live_only + 1] == f"    WARNING profile of 'ens': live_only ({REASON})"
    assert "  timeout 1: not stored; from sidecar.log:" in lines
    assert not [line for line in lines if "live_only" in line and "not stored" in line]
    assert lines[-1] == "traces stored: 3 (1 ok, 0 failed, 2 live-only)"


def test_rest_calls_are_shown_beside_the_grpc_ones_each_against_its_own_count(
    tmp_path: Path,
) -> None:
    db = tmp_path / "traces.db"
    with TraceStore(db) as store:
        for protocol in ("grpc", "http", "http"):
            trace = Trace(new_trace_id(), "cnn", 1, status="ok")
            request = Span(
                trace.trace_id,
                new_span_id(),
                None,
                Level.REQUEST,
                "ModelInfer",
                "ModelInfer",
                0,
                10,
                Source.PROXY,
                attributes={PROTOCOL: protocol},
            )
            store.write_trace(trace, [request])  # fmt: skip
    options = DemoOptions(out=tmp_path, requests=4, forced=0)
    rest = RestTraffic()
    for i in range(5):
        rest.add("tritonclient.http (binary tensors)" if i % 5 else "curl (JSON)", ok=i != 3)
    log = tmp_path / "sidecar.log"

    def lines_of(metrics: str, rest: RestTraffic | None) -> list[str]:
        return account(options, {"error": 0}, ForcedResult(), metrics, db, log, rest=rest)

    lines = lines_of(_metrics(5, 2), rest)
    assert lines[0] == (
        "gRPC requests: 4 traffic + 0 forced + 0 forced sent again = 4 sent; the sidecar "
        "counted 4 (xsp_requests_total)"
    )
    at = lines.index(
        "REST requests: 1 curl (JSON) + 4 tritonclient.http (binary tensors) = 5 sent; the "
        'sidecar counted 5 (xsp_requests_total{protocol="http"})'
    )
    assert lines[at + 1 : at + 3] == [
        "  and 2 REST call(s) of other methods the demo did not send",
        "REST traffic errors (the client saw them): 1",
    ]
    assert lines[at + 3].startswith("sampling decisions: ")
    # the stored traces by the protocol their request span says
    assert lines[-2:] == ["traces stored: 3 (3 ok, 0 failed)", "  of them 1 gRPC and 2 REST calls"]
    # a count that differs says so; without REST traffic there is no REST line
    short = lines_of(_metrics(4), rest)
    assert any(line.endswith('{protocol="http"}) (they differ!)') for line in short)
    assert not [line for line in lines_of(_metrics(), None) if "REST" in line]
