"""The fidelity analysis and its findings over real SQLite stores: the store computes each
trace's `fidelity` attribute from the spans written to it (as the sidecar writes them), the
report reads it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from analysis.trace_analysis import TraceAnalysis
from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore

T0 = 1_790_000_000_000_000_000
PY = {"backend": "python", "replay_device": "cpu"}


def write(
    store: TraceStore,
    *,
    model: str = "m",
    batch: int = 1,
    live_ns: int | None = 1_000_000,
    replay_ns: int = 1_000_000,
    reason: str = "rate",
    attrs: dict[str, Any] | None = None,
    window: dict[str, Any] | None = None,
) -> str:
    """One sampled trace: the proxy's request span, Triton's compute_infer, the replay's M."""
    tid = new_trace_id()
    req_attrs: dict[str, Any] = {"model": model}
    if window is not None:
        req_attrs["server_batch_window"] = window
    spans = [Span(tid, new_span_id(), None, Level.REQUEST, "/x/ModelInfer", "ModelInfer", T0,
                  T0 + 5_000_000, Source.PROXY, attributes=req_attrs)]  # fmt: skip
    if live_ns is not None:
        infer = "compute_infer"
        spans.append(Span(tid, new_span_id(), None, Level.SERVER, infer, infer, T0 + 100,
                          T0 + 100 + live_ns, Source.BACKEND))  # fmt: skip
    store.append_spans(tid, spans)
    trace = Trace(tid, model, T0, batch_size=batch, sample_reason=reason,
                  attributes={"replay_device": "cpu", **(attrs or {})})  # fmt: skip
    model_span = Span(tid, new_span_id(), None, Level.MODEL, model, "model", T0, T0 + replay_ns,
                      Source.REPLAY, run_level=Level.MODEL)  # fmt: skip
    stats = [LevelStats(tid, Level.MODEL, 5, 1, replay_ns, replay_ns, replay_ns, replay_ns, 1.0)]
    store.write_trace(trace, [model_span], stats)
    return tid


def analysis(db: Path) -> TraceAnalysis:
    return TraceAnalysis.from_paths([db])


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "traces.db"


def test_a_faithful_replay_represents_the_server(db: Path) -> None:
    with TraceStore(db) as store:
        for replay in (900_000, 1_000_000, 1_100_000):
            write(store, replay_ns=replay)
    ta = analysis(db)
    row = ta.get_fidelity().iloc[0]
    assert row["requests"] == 3 and row["ratio_p50"] == pytest.approx(1.0)
    assert row["verdict"] == "the replay represents the server"
    assert not [f for f in ta.findings() if f.rule == "replay_fidelity"]


def test_a_python_backend_model_is_named_and_its_finding_comes_first(db: Path) -> None:
    with TraceStore(db) as store:
        for live in (400_000, 500_000, 600_000):
            write(store, live_ns=live, replay_ns=50_000, attrs=PY)
    ta = analysis(db)
    row = ta.get_fidelity().iloc[0]
    assert row["ratio_p50"] == pytest.approx(0.1)
    assert row["ratio_p90"] == pytest.approx(50_000 / 400_000 * 0.8 + 50_000 / 500_000 * 0.2)
    assert row["verdict"] == "the replay does not represent the server"
    assert "Python-backend model" in row["differences"]
    first = ta.findings()[0]
    assert first.rule == "replay_fidelity" and first.subject == "m"
    assert "0.1x the server's own compute time" in first.finding
    assert "shares of layer and kernel time" in first.action and "may still hold" in first.action


def test_another_device_or_accelerator_means_shares_do_not_hold(db: Path) -> None:
    gpu = {"server_config": {"backend": "onnxruntime", "instance_kind": "KIND_GPU"}}
    trt = {"replay_settings": [{"setting": "optimization.execution_accelerators.gpu.tensorrt",
                                "value": "", "applied": False,
                                "reason": "no TensorrtExecutionProvider here"}]}  # fmt: skip
    with TraceStore(db) as store:
        write(store, model="g", live_ns=100_000, replay_ns=900_000, attrs=gpu)
        write(store, model="t", live_ns=100_000, replay_ns=900_000, attrs=trt)
    ta = analysis(db)
    table = ta.get_fidelity().set_index("model")
    assert "on a GPU (KIND_GPU), the replay on the CPU" in table.loc["g", "differences"]
    assert (
        "tensorrt is not applied by the replay (no TensorrtExecutionProvider here)"
        in (table.loc["t", "differences"])
    )
    for f in ta.findings()[:2]:
        assert f.rule == "replay_fidelity" and "shares do not hold either" in f.action


def test_the_batch_the_server_ran_and_its_contention(db: Path) -> None:
    with TraceStore(db) as store:
        # batch 1 requests the server computed inside one execution of batch 4
        one = {"inferences": 4, "executions": 1, "batch_sizes": {"4": 1}}
        write(store, batch=1, live_ns=800_000, replay_ns=200_000, window=one)
        write(store, batch=4, live_ns=800_000, replay_ns=720_000)  # the replay at batch 4
        busy = {"inferences": 3, "executions": 3, "batch_sizes": {"2": 3}}
        write(store, batch=2, live_ns=800_000, replay_ns=300_000, window=busy)
        write(store, batch=2, live_ns=800_000, replay_ns=300_000,
              window={"unobserved": "the first read completed 1 ms after ..."})  # fmt: skip
    fd = analysis(db).result("fidelity")
    table = fd.table.set_index("batch_size")
    assert "inside batches of up to 4" in table.loc[1, "differences"]
    assert table.loc[1, "ratio_at_server_batch_p50"] == pytest.approx(720_000 / 800_000)
    assert (
        "up to 3 executions of the model ran in a request's window" in table.loc[2, "differences"]
    )
    assert any("1 requests' batch windows were not observed" in n for n in fd.notes)


def test_slow_requests_reproduced_or_not(db: Path) -> None:
    with TraceStore(db) as store:
        for _ in range(3):
            write(store, replay_ns=100_000)
        write(store, reason="slow", live_ns=None, replay_ns=400_000)  # its input is slow
        write(store, reason="slow", live_ns=None, replay_ns=110_000)  # the server was slow
    ta = analysis(db)
    row = ta.get_fidelity().iloc[0]
    assert (row["slow_requests"], row["slow_reproduced"]) == (2, 1)
    slow = [f for f in ta.findings() if f.rule == "slow_requests"]
    assert [f.finding.split(":", 1)[1].strip()[:40] for f in slow] == [
        "1 of 2 slow requests were slow in their ",
        "1 of 2 slow requests ran as fast as the ",
    ]


@pytest.mark.parametrize(
    ("reason", "live_ns", "expected"),
    [
        ("cli", 1_000, "no trace sampled from live traffic"),
        ("rate", None, "none of the 1 live samples has the backend's own compute time"),
    ],
)
def test_without_live_compute_it_says_why(
    db: Path, reason: str, live_ns: int | None, expected: str
) -> None:
    with TraceStore(db) as store:
        write(store, reason=reason, live_ns=live_ns if reason != "cli" else None)
    res = analysis(db).result("fidelity")
    assert res.status == "not_captured" and expected in res.reason


def test_threads_differ_where_the_config_sets_none(db: Path) -> None:
    ort = {"server_config": {"backend": "onnxruntime"}, "intra_op_threads": 1}
    pinned = {
        **ort,
        "replay_settings": [{"setting": "parameters.intra_op_thread_count", "value": "1",
                             "applied": True, "reason": ""}],
    }  # fmt: skip
    with TraceStore(db) as store:
        write(store, model="default", live_ns=100_000, replay_ns=300_000, attrs=ort)
        write(store, model="pinned", live_ns=100_000, replay_ns=300_000, attrs=pinned)
    table = analysis(db).get_fidelity().set_index("model")
    assert "default intra-op threads" in table.loc["default", "differences"]
    assert "one per core), the replay with 1" in table.loc["default", "differences"]
    assert table.loc["pinned", "differences"].startswith("none recorded")
