"""An ensemble's live requests read as its steps: a real SQLite store written as the sidecar
writes a live-only ensemble trace (the relay's request span; Triton's request, the ensemble's
model span and, inside it, one model span per step with its queue and compute phases), read
by the real report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.analyses.common import Frames
from analysis.analyses.ensemble_steps import fidelity_notes, gaps, step_fidelity, step_key, steps
from analysis.analyses.model_level import model_throughput
from analysis.load.tracedb import TraceFilter, load_traces
from sidecar.trace.spans import Level, Source, Span, Trace, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.analysis.test_live_only import run_report

T0 = 1_790_000_000_000_000_000
US = 1_000
MS = 1_000_000
# per step: (model, queue µs, compute_input, compute_infer, compute_output), in order
STEPS = (("pre", 100, 50, 300, 50), ("simple_cnn", 200, 100, 2000, 100))
GAP_US = 400  # between the two steps
LEAD_US = 150  # the ensemble's span before its first step (and as long after its last)


def _server(tid: str, parent: str | None, kind: str, name: str, start: int, end: int) -> Span:
    sid = new_span_id()
    return Span(tid, sid, parent, Level.SERVER, name, kind, start, end, Source.BACKEND,
                attributes={"model": name} if kind == "model" else {})  # fmt: skip


Steps = tuple[tuple[str, int, int, int, int], ...]


def ensemble_spans(tid: str, start: int, gap_us: int = GAP_US, steps: Steps = STEPS) -> list[Span]:
    """The relay's request span around Triton's spans of one request to `ens_cnn` (`steps`:
    per step, its model and its phases in µs, as `STEPS`)."""
    at = start + MS + LEAD_US * US
    inner: list[Span] = []
    ens_start = start + MS
    for model, queue, c_in, c_inf, c_out in steps:
        step_len = (queue + c_in + c_inf + c_out) * US
        step = _server(tid, None, "model", model, at, at + step_len)
        inner.append(step)
        t = at
        inner.append(_server(tid, step.span_id, "queue", "queue", t, t + queue * US))
        t += queue * US
        compute = _server(tid, step.span_id, "compute", "compute", t, at + step_len)
        inner.append(compute)
        for phase, us in (("compute_input", c_in), ("compute_infer", c_inf),
                          ("compute_output", c_out)):  # fmt: skip
            inner.append(_server(tid, compute.span_id, phase, phase, t, t + us * US))
            t += us * US
        at += step_len + gap_us * US
    ens_end = at - gap_us * US + LEAD_US * US
    request = _server(tid, None, "request", "request", ens_start - 50 * US, ens_end + 50 * US)
    ens = _server(tid, request.span_id, "model", "ens_cnn", ens_start, ens_end)
    for span in inner:
        if span.kind == "model":
            span.parent_id = ens.span_id
    end = ens_end + MS
    relay = Span(tid, new_span_id(), None, Level.REQUEST, "/inference.GRPCInferenceService/"
                 "ModelInfer", "ModelInfer", start, end, Source.PROXY,
                 attributes={"model": "ens_cnn", "grpc_code": "OK",
                             "relay_request_start_ns": start,
                             "relay_request_end_ns": start + 100 * US,
                             "relay_response_start_ns": end - 200 * US,
                             "relay_response_end_ns": end})  # fmt: skip
    request.parent_id = relay.span_id
    return [relay, request, ens, *inner]


def write_ensemble(
    store: TraceStore, start: int, gap_us: int = GAP_US, steps: Steps = STEPS
) -> str:
    tid = new_trace_id()
    store.append_spans(tid, ensemble_spans(tid, start, gap_us, steps))
    trace = Trace(tid, "ens_cnn", start, sample_reason="forced", status="live_only",
                  attributes={"replay": "not_replayable: model 'ens_cnn' (platform ensemble)",
                              "method": "ModelInfer"})  # fmt: skip
    store.write_trace(trace, [])
    return tid


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ensemble") / "traces.db"
    with TraceStore(path) as store:
        for i in range(3):
            write_ensemble(store, T0 + i * 20 * MS)
    return path


def test_steps_and_the_time_between_them_come_from_tritons_spans(db: Path) -> None:
    fr = Frames(load_traces([db], TraceFilter()))
    st = steps(fr)
    assert list(st.groupby("tkey").size()) == [2, 2, 2]
    first = st[st["tkey"] == st["tkey"].iat[0]].sort_values("index")
    assert list(first["step"]) == ["pre", "simple_cnn"] and set(first["ensemble"]) == {"ens_cnn"}
    for row, (_, queue, c_in, c_inf, c_out) in zip(first.itertuples(), STEPS, strict=True):
        assert (row.queue, row.compute_input) == (queue * US, c_in * US)
        assert (row.compute_infer, row.compute_output) == (c_inf * US, c_out * US)
        assert row.step_other == 0
    gp = gaps(fr)
    assert list(gp["between_steps"]) == [GAP_US * US] * 3
    assert list(gp["ensemble_overhead"]) == [2 * LEAD_US * US] * 3
    assert list(gp["steps_overlap"]) == [0.0] * 3
    assert step_key("ens_cnn", "pre") == "ens_cnn/pre"


def test_the_live_breakdown_shows_each_step_and_the_findings_name_the_dominant_one(
    db: Path,
) -> None:
    rc, out, err = run_report(str(db), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    rows = {(r["model"], r["step"], r["phase"]): r for r in doc["live_breakdown"]["rows"]}
    assert rows[("ens_cnn", "", "client_total")]["requests"] == 3
    assert rows[("ens_cnn", "1. pre", "compute_infer")]["p50_ms"] == pytest.approx(0.3)
    assert rows[("ens_cnn", "2. simple_cnn", "queue")]["mean_ms"] == pytest.approx(0.2)
    assert rows[("ens_cnn", "", "between_steps")]["mean_ms"] == pytest.approx(GAP_US / 1000)
    assert rows[("ens_cnn", "", "ensemble_overhead")]["mean_ms"] == pytest.approx(0.3)
    assert any("read as their steps" in n for n in doc["live_breakdown"]["notes"])
    (dom,) = [f for f in doc["findings"] if f["rule"] == "dominant_step"]
    assert dom["subject"] == "ens_cnn"
    assert dom["finding"].startswith("ens_cnn: step simple_cnn takes 83% of the ensemble's")
    assert dom["finding"].endswith("of the client's median latency), by median")
    assert "most of it compute_infer (2 ms p50)" in dom["evidence"]
    # 0.4 ms between steps of a ~5.8 ms request: under the threshold
    assert not [f for f in doc["findings"] if f["rule"] == "between_steps"]
    assert doc["fidelity"]["reason"].endswith(
        "; ensembles (ens_cnn): no step has a replay, so no step's replay is compared with its "
        "live compute_infer (live_breakdown shows each step's live phases)"
    )
    rc, text, err = run_report(str(db), "--format", "text")
    assert rc == 0 and "2. simple_cnn" in text and "between_steps" in text, err


def test_one_cold_request_does_not_pick_the_dominant_step(tmp_path: Path) -> None:
    """The first request's `pre` takes 40 ms (a cold start): by the means `pre` would hold
    most of the step time (8.3 ms against 2.4 ms); by the medians `simple_cnn` does."""
    path = tmp_path / "cold.db"
    cold = (("pre", 100, 50, 40_000, 50), STEPS[1])
    with TraceStore(path) as store:
        for i in range(5):
            write_ensemble(store, T0 + i * 60 * MS, steps=cold if i == 0 else STEPS)
    rc, out, err = run_report(str(path), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    rows = {(r["step"], r["phase"]): r for r in doc["live_breakdown"]["rows"]}
    assert rows[("1. pre", "compute_infer")]["mean_ms"] > 2 * 2.4  # what the mean would say
    (dom,) = [f for f in doc["findings"] if f["rule"] == "dominant_step"]
    assert dom["finding"].startswith("ens_cnn: step simple_cnn takes 83% of the ensemble's")
    assert "other steps: pre 0.5 ms" in dom["evidence"]


def test_a_long_wait_between_steps_is_a_finding(tmp_path: Path) -> None:
    path = tmp_path / "gap.db"
    with TraceStore(path) as store:
        for i in range(2):
            write_ensemble(store, T0 + i * 30 * MS, gap_us=3000)
    rc, out, err = run_report(str(path), "--format", "json")
    assert rc == 0, err
    (gap,) = [f for f in json.loads(out)["findings"] if f["rule"] == "between_steps"]
    assert gap["finding"].startswith("ens_cnn: live requests spend 37% of their latency between")
    assert "threshold 20%" in gap["evidence"]


@pytest.mark.parametrize("run_level", [Level.MODEL, Level.LAYER])
def test_steps_that_overlap_add_no_gap_and_each_replayed_step_meets_its_live_compute(
    tmp_path: Path, run_level: Level
) -> None:
    """Triton stamps a step's ends after it sent its outputs on: the next step starts first.
    A replay of the steps (model spans named after each step's model) is set against each
    step's live compute_infer, keyed `<ensemble>/<step>`; the step spans may be the M run's
    own or the timeline's (a deeper run's, whose model spans carry the M statistic)."""
    path = tmp_path / "overlap.db"
    with TraceStore(path) as store:
        tid = new_trace_id()
        spans = ensemble_spans(tid, T0, gap_us=-100)
        for model, ms in (("pre", 0.6), ("simple_cnn", 3.0)):
            spans.append(Span(tid, new_span_id(), None, Level.MODEL, model, "model", T0,
                              T0 + int(ms * MS), Source.REPLAY, duration_ns=int(ms * MS),
                              run_level=run_level))  # fmt: skip
        store.append_spans(tid, spans)
        store.write_trace(Trace(tid, "ens_cnn", T0, batch_size=1, sample_reason="forced"), [])
    fr = Frames(load_traces([path], TraceFilter()))
    gp = gaps(fr)
    assert (gp["between_steps"].iat[0], gp["steps_overlap"].iat[0]) == (0.0, 100 * US)
    per_step = step_fidelity(fr).set_index("key")
    assert list(per_step.index) == ["ens_cnn/pre", "ens_cnn/simple_cnn"]
    assert per_step.at["ens_cnn/pre", "ratio_p50"] == pytest.approx(2.0)
    assert per_step.at["ens_cnn/simple_cnn", "ratio_p50"] == pytest.approx(1.5)
    (note,) = fidelity_notes(fr)[:1]
    assert note.startswith("ensemble step ens_cnn/pre: replay p50 0.6 ms vs its live")
    a1 = model_throughput(fr).table.set_index(["model", "step"])
    assert a1.at[("ens_cnn", "pre"), "latency_ms"] == pytest.approx(0.6)
    assert a1.at[("ens_cnn", "simple_cnn"), "throughput_per_s"] == pytest.approx(1 / 3e-3)
    assert a1.at[("ens_cnn", ""), "n_traces"] == 1  # the ensemble's own row stays first
    rc, out, err = run_report(str(path), "--format", "json")
    assert rc == 0, err
    (dom,) = [f for f in json.loads(out)["findings"] if f["rule"] == "dominant_step"]
    assert dom["evidence"].endswith("replayed (A1): pre 0.6 ms, simple_cnn 3 ms")


def test_an_ensemble_whose_steps_overlap_stays_in_the_breakdown(tmp_path: Path) -> None:
    """Its whole-request phases sum the steps' overlapping stamps to more than Triton's request
    span: not a clock to distrust, the overlap is the steps'."""
    path = tmp_path / "overlap.db"
    with TraceStore(path) as store:
        write_ensemble(store, T0, gap_us=-490)  # 0.49 ms of the two steps at once
    rc, out, err = run_report(str(path), "--format", "json")
    assert rc == 0, err
    lb = json.loads(out)["live_breakdown"]
    assert not [n for n in lb["notes"] if "left out" in n]
    rows = {(r["step"], r["phase"]): r for r in lb["rows"]}
    assert rows[("", "steps_overlap")]["mean_ms"] == pytest.approx(0.49)
    assert rows[("", "between_steps")]["mean_ms"] == 0
    assert rows[("2. simple_cnn", "compute_infer")]["requests"] == 1
