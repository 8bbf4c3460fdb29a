"""The trace's `fidelity` attribute: kept up to date by the store (real SQLite) whichever part
of a sampled trace arrives last."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.trace import fidelity
from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore

T0 = 1_790_000_000_000_000_000


def _server(trace_id: str, kind: str, start: int, end: int) -> Span:
    return Span(trace_id, new_span_id(), None, Level.SERVER, kind, kind, T0 + start, T0 + end,
                Source.BACKEND)  # fmt: skip


def _request(trace_id: str, window: dict[str, object] | None) -> Span:
    attrs: dict[str, object] = {"model": "m"}
    if window is not None:
        attrs["server_batch_window"] = window
    return Span(trace_id, new_span_id(), None, Level.REQUEST, "/x/ModelInfer", "ModelInfer", T0,
                T0 + 2_000_000, Source.PROXY, attributes=attrs)  # fmt: skip


def _replay(trace_id: str, model_ns: int) -> tuple[Trace, list[LevelStats]]:
    trace = Trace(trace_id, "m", T0, batch_size=2, sample_reason="rate", attributes={"a": 1})
    stats = [LevelStats(trace_id, Level.MODEL, 10, 2, model_ns, model_ns, model_ns, model_ns, 1.0)]
    return trace, stats


def _attribute(store: TraceStore, trace_id: str) -> object:
    got = store.get_trace(trace_id)
    assert got is not None
    return got.attributes.get("fidelity")


@pytest.mark.parametrize("replay_first", [True, False])
def test_ratio_whichever_part_comes_last(tmp_path: Path, replay_first: bool) -> None:
    tid = new_trace_id()
    window = {"inferences": 3, "executions": 1, "batch_sizes": {"4": 1}}
    live = [_request(tid, window), _server(tid, "compute_infer", 100_000, 600_000)]
    trace, stats = _replay(tid, 50_000)
    with TraceStore(tmp_path / "t.db") as store:
        if replay_first:
            store.write_trace(trace, [], stats)
            assert _attribute(store, tid) is None  # no live part yet: nothing to compare
            store.append_spans(tid, live)
        else:
            store.append_spans(tid, live)
            store.write_trace(trace, [], stats)
        got = store.get_trace(tid)
    assert got is not None and got.attributes["a"] == 1  # the replay's attributes are kept
    assert got.attributes["fidelity"] == {
        "live_compute_ns": 500_000,
        "live_source": "compute_infer",
        "replay_model_ns": 50_000,
        "ratio": 0.1,
        "server_batch_window": window,
    }


def test_tf_ops_envelope_and_no_replay(tmp_path: Path) -> None:
    tid = new_trace_id()
    trace = Trace(tid, "m", T0, sample_reason="rate", status="error", error="no model file")
    with TraceStore(tmp_path / "t.db") as store:
        store.write_trace(trace, [])
        store.append_spans(
            tid, [_server(tid, "tf_op", 200, 900), _server(tid, "tf_op", 500, 1_700)]
        )
        assert _attribute(store, tid) == {
            "live_compute_ns": 1_500,
            "live_source": "tf_ops",
            "replay_model_ns": None,
            "ratio": None,
        }


def test_a_profile_trace_gets_no_attribute(tmp_path: Path) -> None:
    tid = new_trace_id()
    trace, stats = _replay(tid, 50_000)
    with TraceStore(tmp_path / "t.db") as store:
        store.write_trace(trace, [], stats)
        assert _attribute(store, tid) is None


def test_record_without_live_compute_keeps_the_window() -> None:
    window = {"unobserved": "why"}
    assert fidelity.record(None, None, 10.0, window) == {
        "live_compute_ns": None,
        "live_source": None,
        "replay_model_ns": 10.0,
        "ratio": None,
        "server_batch_window": window,
    }
    assert fidelity.record(None, None, 10.0) is None
    assert fidelity.record(0, None, 10.0)["ratio"] is None  # type: ignore[index]
