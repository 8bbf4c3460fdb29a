"""The demo's account of its profiles: a live-only profile is said to be stored (it is: its
trace holds the live side), one that timed out is not; over a real store and a /metrics text
that prometheus_client wrote."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest

from sidecar.trace.spans import Trace, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.demo.triton import DemoOptions, ForcedResult, account

REASON = "not_replayable: model 'ens' is served by 'tensorrt_plan'"


def _metrics() -> str:
    registry = CollectorRegistry()
    requests = Counter("xsp_requests", "calls", ["method"], registry=registry)
    requests.labels("ModelInfer").inc(4)
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
