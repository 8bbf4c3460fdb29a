"""Live-only traces (a model no replay can run) and models without a batch dimension
(`max_batch_size: 0`) in the report: a real SQLite store written as the sidecar writes it
(the relay's request span, Triton's spans with the request's batch window, the replay's
trace row, spans and statistics, or the live-only trace row), read by the real report."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from analysis import report
from analysis.analyses.common import AnalysisResult, Frames
from analysis.keys import ANALYSIS_KEYS
from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore

T0 = 1_790_000_000_000_000_000
MS = 1_000_000
WINDOW = {"inferences": 1, "executions": 1, "batch_sizes": {"1": 1}}
PHASES = (("queue", 0.2), ("compute_input", 0.1), ("compute_infer", 1.5), ("compute_output", 0.1))


def live_spans(tid: str, model: str, start: int, window: dict[str, Any] | None) -> list[Span]:
    """The relay's request span (5 ms, with its marks) and Triton's request with its phases."""
    rid = new_span_id()
    attrs: dict[str, Any] = {
        "model": model, "grpc_code": "OK", "relay_request_start_ns": start,
        "relay_request_end_ns": start + 100_000, "relay_response_start_ns": start + 4 * MS,
        "relay_response_end_ns": start + 5 * MS,
    }  # fmt: skip
    if window is not None:
        attrs["server_batch_window"] = window
    spans = [Span(tid, rid, None, Level.REQUEST, "/inference.GRPCInferenceService/ModelInfer",
                  "ModelInfer", start, start + 5 * MS, Source.PROXY, attributes=attrs)]  # fmt: skip
    server = new_span_id()
    at = start + MS
    spans.append(Span(tid, server, rid, Level.SERVER, "request", "request", at, at + 2_500_000,
                      Source.BACKEND))  # fmt: skip
    compute = new_span_id()
    for phase, ms in PHASES:
        end = at + int(ms * MS)
        parent = server if phase == "queue" else compute
        if phase == "compute_input":
            spans.append(Span(tid, compute, server, Level.SERVER, "compute", "compute", at,
                              at + int(1.7 * MS), Source.BACKEND))  # fmt: skip
        spans.append(Span(tid, new_span_id(), parent, Level.SERVER, phase, phase, at, end,
                          Source.BACKEND))  # fmt: skip
        at = end
    return spans


def write_live_only(store: TraceStore, model: str, start: int, reason: str = "forced") -> str:
    """A sample no replay can run, as the sidecar stores it: live spans and the trace row."""
    tid = new_trace_id()
    store.append_spans(tid, live_spans(tid, model, start, WINDOW))
    trace = Trace(tid, model, start, sample_reason=reason, status="live_only",
                  attributes={"replay": f"not_replayable: model {model!r} (backend python): "
                              "no model.onnx", "method": "ModelInfer"})  # fmt: skip
    store.write_trace(trace, [])
    return tid


def write_unbatched(store: TraceStore, model: str, start: int, replay_ns: int) -> str:
    """A replayed sample of a `max_batch_size: 0` model: no batch size, the server's window
    (it ran the request alone, as a batch of 1), the replay's M and two layers."""
    tid = new_trace_id()
    store.append_spans(tid, live_spans(tid, model, start, WINDOW))
    mid = new_span_id()
    spans = [Span(tid, mid, None, Level.MODEL, model, "model", start, start + replay_ns,
                  Source.REPLAY, duration_ns=replay_ns, run_level=Level.MODEL)]  # fmt: skip
    lid = new_span_id()
    spans.append(Span(tid, lid, None, Level.MODEL, model, "model", start, start + replay_ns,
                      Source.REPLAY, duration_ns=replay_ns, run_level=Level.LAYER))  # fmt: skip
    half = replay_ns // 2
    for i, (name, kind) in enumerate((("MatMul_0", "MatMul"), ("Relu_1", "Relu"))):
        s0 = start + i * half
        spans.append(Span(tid, new_span_id(), lid, Level.LAYER, name, kind, s0, s0 + half,
                          Source.REPLAY, duration_ns=half, run_level=Level.LAYER, index=i,
                          attributes={"op_type": kind, "flops": 1e6,
                                      "output_shapes": [[4, 16]]}))  # fmt: skip
    stats = [
        LevelStats(tid, Level.MODEL, 5, 1, replay_ns, replay_ns, replay_ns, replay_ns, 1.0),
        LevelStats(tid, Level.LAYER, 5, 1, replay_ns, replay_ns, replay_ns, replay_ns, 1.1),
    ]
    server = {"backend": "onnxruntime", "max_batch_size": 0}
    trace = Trace(tid, model, start, batch_size=None, sample_reason="forced",
                  attributes={"replay_device": "cpu", "levels": ["model", "layer"],
                              "server_config": server})  # fmt: skip
    store.write_trace(trace, spans, stats)
    return tid


def write_store(db: Path) -> None:
    """Three live-only traces of `add_sub` and three replayed ones of `seq` (no batch)."""
    with TraceStore(db) as store:
        for i in range(3):
            write_live_only(store, "add_sub", T0 + i * 10 * MS)
            write_unbatched(store, "seq", T0 + (50 + i * 10) * MS, (1400 + 100 * i) * 1000)


def run_report(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = report.main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("live-only") / "traces.db"
    write_store(path)
    return path


def test_a_report_over_a_model_without_a_batch_dimension_renders_every_section(
    db: Path,
) -> None:
    """`max_batch_size: 0`: no batch size on the traces, a batch window of one execution."""
    rc, out, err = run_report(str(db), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert set(ANALYSIS_KEYS) <= set(doc)
    assert not [k for k in ANALYSIS_KEYS if doc[k]["status"] == "error"]
    (fid,) = doc["fidelity"]["rows"]
    assert (fid["model"], fid["batch_size"], fid["requests"]) == ("seq", None, 3)
    assert fid["ratio_p50"] == pytest.approx(1.5 / 1.5)
    assert fid["ratio_at_server_batch_p50"] is None  # no batch to compare it at
    assert {r["model"] for r in doc["A1"]["rows"]} == {"seq"}
    for fmt in ("text", "markdown", "html"):
        rc, out, err = run_report(str(db), "--format", fmt)
        assert rc == 0 and "ERROR" not in out, (fmt, err)


def test_live_only_traces_are_in_the_live_breakdown_not_skipped_as_failed(db: Path) -> None:
    rc, out, err = run_report(str(db), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["meta"]["traces"] == 6 and "failed_profiles_skipped" not in doc["meta"]
    assert doc["meta"]["live_only_traces"].startswith("3 (models: add_sub)")
    rows = {(r["model"], r["phase"]): r for r in doc["live_breakdown"]["rows"]}
    assert rows[("add_sub", "client_total")]["requests"] == 3
    assert rows[("add_sub", "compute_infer")]["p50_ms"] == pytest.approx(1.5)
    assert rows[("add_sub", "queue")]["p50_ms"] == pytest.approx(0.2)
    assert not [f for f in doc["findings"] if f["rule"] == "failed_profiles"]
    # the replay's analyses name them apart from traces that lack a level
    (a2,) = [n for n in doc["A2"]["notes"] if "live-only" in n]
    assert a2.startswith("3 live-only traces (models: add_sub) have no replay")
    assert any(n.startswith("3 sampled requests are live-only") for n in doc["fidelity"]["notes"])


def test_a_store_of_live_only_traces_alone_is_a_report(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    with TraceStore(path) as store:
        for i in range(2):
            write_live_only(store, "ens", T0 + i * 10 * MS)
    rc, out, err = run_report(str(path), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert {r["model"] for r in doc["live_breakdown"]["rows"]} == {"ens"}
    assert doc["fidelity"]["status"] == "not_captured"
    assert "they are live-only" in doc["fidelity"]["reason"]
    assert doc["A1"]["status"] == "not_captured"


def test_one_analysis_that_raises_fails_its_section_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault injected into A5 over the checked-in CPU store: its section says so in one
    line (JSON status `error`), and every other section is the golden report's."""
    from analysis import trace_analysis
    from tests.analysis import golden

    def broken(fr: Frames) -> AnalysisResult:
        raise ZeroDivisionError("injected\nacross lines")

    monkeypatch.setitem(trace_analysis.ANALYSES, "A5", broken)
    with golden.stores() as paths:
        doc = golden.report_doc("cpu", paths)
    assert doc["A5"]["status"] == "error"
    assert doc["A5"]["reason"] == "the analysis failed: ZeroDivisionError: injected across lines"
    assert doc["A5"]["rows"] == []
    problems = []
    for section, value in doc.items():
        if section == "A5":
            continue
        want = json.loads((golden.GOLDEN / "report" / "cpu" / f"{section}.json").read_text())
        problems += golden.differences(want, json.loads(golden.dump(value)), section)
    assert not problems, problems[:10]
    rc, out, err = run_report(str(golden.CPU_DB), "--format", "text")
    assert rc == 0, err
    section = out.split("A5: ")[1].split("\n\n")[0].splitlines()
    assert section[2] == f"  ERROR: {doc['A5']['reason']}" and len(section) == 3
    assert "A6: Latency by layer type" in out and "live breakdown" in out


def test_the_fleet_report_reads_live_only_traces_too(db: Path, tmp_path: Path) -> None:
    from analysis.fleet import analyses as fleet

    fleet.export_parquet([db], tmp_path / "fleet")
    tables = fleet.fleet_tables(tmp_path / "fleet")
    live = tables["live_breakdown"]
    rows = live[(live["model"] == "add_sub") & (live["phase"] == "client_total")]
    assert rows["requests"].tolist() == [3]
    assert set(tables["traces"]["model"]) == {"add_sub", "seq"}
