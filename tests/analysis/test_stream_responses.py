"""The `stream_responses` analysis and its findings, over a real trace store holding the
request spans of sampled stream messages as the relay writes them (docs/contracts.md), with
random timings; the expected numbers are recomputed from what was written."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from analysis.report import main as report_main
from analysis.trace_analysis import TraceAnalysis
from sidecar.trace.spans import Level, Source, Span, new_span_id, new_trace_id
from tests.analysis.helpers import MS, T0, relay_request, write_live

PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


def stream_span(trace_id: str, first_ns: int, gaps: list[int], tail_ns: int = 0) -> Span:
    """A sampled stream message's request span: first response `first_ns` after its message,
    then one response after each gap, and its final (empty) response `tail_ns` later."""
    last = first_ns + sum(gaps)
    return Span(
        trace_id, new_span_id(), None, Level.REQUEST, PATH, "ModelStreamInfer", T0,
        T0 + last + tail_ns, Source.PROXY,
        attributes={
            "grpc_code": "OK", "stream_message": True, "responses": len(gaps) + 1,
            "relay_request_start_ns": T0, "relay_request_end_ns": T0,
            "relay_response_start_ns": T0 + first_ns, "first_response_ns": T0 + first_ns,
            "last_response_ns": T0 + last, "response_gaps_ns": gaps,
            "relay_response_end_ns": T0 + last + tail_ns,
        },
    )  # fmt: skip


def store(tmp_path: Path, seed: int = 7) -> tuple[Path, dict[str, list[Span]]]:
    """Two models: `tok` answers late then streams evenly; `chat` answers early, with
    gaps that now and then stall; and one unary live request (not a stream message)."""
    rng = random.Random(seed)
    written: dict[str, list[Span]] = {"tok": [], "chat": []}
    traces = []
    for _ in range(12):
        tid = new_trace_id()
        gaps = [int(rng.uniform(0.9, 1.1) * MS) for _ in range(rng.randint(3, 6))]
        span = stream_span(tid, int(rng.uniform(80, 120) * MS), gaps)
        written["tok"].append(span)
        traces.append(("tok", [span]))
        tid = new_trace_id()
        gaps = [int((30 if rng.random() < 0.2 else 1) * rng.uniform(1, 2) * MS) for _ in range(8)]
        span = stream_span(tid, int(rng.uniform(1, 2) * MS), gaps, tail_ns=MS)
        written["chat"].append(span)
        traces.append(("chat", [span]))
    unary = new_trace_id()
    traces.append(("tok", [relay_request(unary, new_span_id(), (0, MS, 5 * MS, 6 * MS))]))
    db = tmp_path / "traces.sqlite"
    write_live(db, traces)
    return db, written


def test_per_model_percentiles_of_first_response_gaps_and_responses(tmp_path: Path) -> None:
    db, written = store(tmp_path)
    res = TraceAnalysis.from_paths([db]).result("stream_responses")
    assert res.ok
    table = res.table.set_index("model")
    assert sorted(table.index) == ["chat", "tok"]
    for model, spans in written.items():
        row = table.loc[model]
        firsts = [(s.attributes["first_response_ns"] - T0) / MS for s in spans]
        gaps = [g / MS for s in spans for g in s.attributes["response_gaps_ns"]]
        counts = [s.attributes["responses"] for s in spans]
        latency = [(s.end_ns - s.start_ns) / MS for s in spans]
        assert row["requests"] == len(spans)  # the unary request is no stream message
        assert row["gaps"] == len(gaps)
        for q in (50, 90, 99):
            assert row[f"first_response_ms_p{q}"] == pytest.approx(np.quantile(firsts, q / 100))
            assert row[f"gap_ms_p{q}"] == pytest.approx(np.quantile(gaps, q / 100))
            assert row[f"responses_p{q}"] == pytest.approx(np.quantile(counts, q / 100))
            assert row[f"latency_ms_p{q}"] == pytest.approx(np.quantile(latency, q / 100))
        shares = [f / t for f, t in zip(firsts, latency, strict=True)]
        assert row["first_response_share"] == pytest.approx(np.median(shares))


def test_findings_name_a_late_first_response_and_stalling_gaps(tmp_path: Path) -> None:
    db, _ = store(tmp_path)
    findings = {(f.rule, f.subject) for f in TraceAnalysis.from_paths([db]).findings()}
    table = TraceAnalysis.from_paths([db]).result("stream_responses").table.set_index("model")
    late = {m for m in table.index if table.loc[m, "first_response_share"] >= 0.8}
    spread = {m for m in table.index if table.loc[m, "gap_ms_p90"] > 3 * table.loc[m, "gap_ms_p50"]}
    assert late == {"tok"} and spread == {"chat"}  # the scenario's two shapes
    assert {m for r, m in findings if r == "stream_first_response"} == late
    assert {m for r, m in findings if r == "stream_gap_spread"} == spread


def test_without_stream_messages_it_says_so(tmp_path: Path) -> None:
    db = tmp_path / "unary.sqlite"
    write_live(db, [("m", [relay_request(new_trace_id(), new_span_id(), (0, MS, 2 * MS, 3 * MS))])])
    res = TraceAnalysis.from_paths([db]).result("stream_responses")
    assert res.status == "not_captured" and "ModelStreamInfer" in res.reason


def test_a_damaged_count_is_left_out_and_named(tmp_path: Path) -> None:
    good = stream_span(new_trace_id(), 5 * MS, [MS, MS])
    bad = stream_span(new_trace_id(), 5 * MS, [MS])
    bad.attributes["responses"] = "three"
    db = tmp_path / "damaged.sqlite"
    write_live(db, [("tok", [good]), ("tok", [bad])])
    res = TraceAnalysis.from_paths([db]).result("stream_responses")
    assert res.ok and int(res.table["requests"].iloc[0]) == 1
    assert any("1 stream span(s) left out" in n for n in res.notes)


@pytest.mark.parametrize("fmt", ["text", "json", "csv", "html"])
def test_every_format_shows_it(tmp_path: Path, fmt: str) -> None:
    db, _ = store(tmp_path)
    out = tmp_path / "out"
    assert report_main([str(db), "--format", fmt, "--only", "stream_responses",
                        "--out", str(out)]) == 0  # fmt: skip
    text = "".join(f.read_text() for f in sorted(out.iterdir())).replace("<wbr>", "")
    assert "first_response_ms_p50" in text and "gap_ms_p90" in text
    assert "chat" in text and "tok" in text
