"""Live request breakdown, overhead and comparisons on tests/data/live/traces.sqlite (sampled
live requests: proxy request span, backend server spans, M/L replay; synthetic timings)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.common import across_traces
from analysis.load.tracedb import parse_since
from analysis.trace_analysis import TraceAnalysis
from sidecar.profiling.stats import trimmed_mean
from sidecar.trace.spans import Level, Source, Span, Trace, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.analysis.helpers import (
    LIVE_DB,
    MS,
    T0,
    close,
    layer_rows,
    q,
    relay_request,
    server_spans,
    tmean,
    write_live,
)

PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
TRITON_SUM = ("network_proxy", *PHASES, "server_other")


@pytest.fixture(scope="module")
def ta() -> TraceAnalysis:
    return TraceAnalysis.from_paths([LIVE_DB])


def _expected_phases() -> dict[str, dict[str, list[float]]]:
    client = {
        tid: (model, ns)
        for tid, model, ns in q(
            LIVE_DB,
            "SELECT s.trace_id, t.model, s.duration_ns FROM spans s JOIN traces t "
            "USING (trace_id) WHERE s.level='request'",
        )
    }
    server: dict[str, dict[str, int]] = defaultdict(dict)
    for tid, kind, ns in q(
        LIVE_DB, "SELECT trace_id, kind, duration_ns FROM spans WHERE level='server'"
    ):
        server[tid][kind] = ns
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for tid, (model, ns) in client.items():
        out[model]["client_total"].append(ns / 1e6)
        if tid not in server:
            continue
        s = server[tid]
        out[model]["network_proxy"].append((ns - s["request"]) / 1e6)
        for p in PHASES:
            out[model][p].append(s[p] / 1e6)
        out[model]["server_other"].append((s["request"] - sum(s[p] for p in PHASES)) / 1e6)
        out[model]["server_after_response"].append(0.0)  # every span ends inside the window
    return out


def _expected_clients() -> dict[str, dict[str, list[float]]]:
    """Per model and phase: the client latency of each request that has the phase."""
    server = {tid for (tid,) in q(LIVE_DB, "SELECT trace_id FROM spans WHERE level='server'")}
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for tid, model, ns in q(
        LIVE_DB,
        "SELECT s.trace_id, t.model, s.duration_ns FROM spans s JOIN traces t "
        "USING (trace_id) WHERE s.level='request'",
    ):
        for phase in (
            "client_total",
            *((*TRITON_SUM, "server_after_response") if tid in server else ()),
        ):
            out[model][phase].append(ns / 1e6)
    return out


def test_live_breakdown_percentiles(ta: TraceAnalysis) -> None:
    exp, shares = _expected_phases(), _expected_clients()
    res = ta.result("live_breakdown")
    df = res.table
    assert set(df["model"]) == set(exp)
    for row in df.itertuples():
        vals = exp[row.model][row.phase]
        assert row.requests == len(vals)
        assert close(row.mean_ms, float(np.mean(vals)))
        assert close(row.p50_ms, float(np.percentile(vals, 50)))
        assert close(row.p90_ms, float(np.percentile(vals, 90)))
        assert close(row.p99_ms, float(np.percentile(vals, 99)))
        # over the client latency of the requests that have the phase (not of every request)
        clients = shares[row.model][row.phase]
        assert close(row.share_of_client, float(np.sum(vals)) / float(np.sum(clients)))
    for _model, grp in df.set_index("phase").groupby("model"):
        assert close(grp.loc[list(TRITON_SUM), "share_of_client"].sum(), 1.0)
    # phases in order, client total first
    first = df[df["model"] == "small_cnn"]["phase"].tolist()
    assert first[:2] == ["client_total", "network_proxy"]
    assert first[-2:] == ["server_other", "server_after_response"]
    # the store predates the relay's marks: said, and the spans are cut at the response's end
    (n_traces,) = q(LIVE_DB, "SELECT COUNT(*) FROM traces")[0]
    assert any(
        n.startswith(f"{n_traces} sampled requests were stored without the relay's timestamps")
        for n in res.notes
    )
    # requests without backend spans are counted and said
    (n_missing,) = q(
        LIVE_DB,
        "SELECT COUNT(*) FROM traces t WHERE NOT EXISTS (SELECT 1 FROM spans s "
        "WHERE s.trace_id = t.trace_id AND s.level = 'server')",
    )[0]
    assert n_missing > 0
    assert any(f"{n_missing} sampled requests have no backend spans" in n for n in res.notes)


def test_compare_two_models_by_type_and_layer(ta: TraceAnalysis) -> None:
    res = ta.compare("model=small_cnn", "model=big_cnn", labels=("small", "big"))
    assert res.ok
    per: dict[tuple[str, str], list[float]] = defaultdict(list)
    types = {}
    for r in layer_rows(LIVE_DB):
        per[(r["model"], r["name"])].append(r["duration"])
        types[r["name"]] = r["op_type"]
    by_type: dict[tuple[str, str], float] = defaultdict(float)
    for (model, name), vals in per.items():
        by_type[(model, types[name])] += tmean(vals) / 1e6
    for row in res.table.itertuples():
        assert close(row.small_ms, by_type[("small_cnn", row.type)])
        assert close(row.big_ms, by_type[("big_cnn", row.type)])
        assert close(row.diff_ms, row.big_ms - row.small_ms)
    top = res.tables["top_layers"]
    diffs = [
        tmean(per[("big_cnn", n)]) / 1e6 - tmean(per[("small_cnn", n)]) / 1e6 for n in top.name
    ]
    assert np.allclose(top["diff_ms"], diffs)
    assert list(top["diff_ms"].abs()) == sorted(top["diff_ms"].abs(), reverse=True)
    summary = res.tables["summary"]
    assert list(summary["set"]) == ["small", "big"] and list(summary["traces"]) == [8, 8]


def test_compare_with_empty_side_is_not_applicable(ta: TraceAnalysis) -> None:
    res = ta.compare("model=small_cnn", "model=nope")
    assert res.status == "not_applicable" and "model=nope" in res.reason


def test_bad_selector_is_explained(ta: TraceAnalysis) -> None:
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ta.compare("colour=red", "model=big_cnn")


def test_trimmed_mean_rule() -> None:
    assert trimmed_mean([1, 2, 3, 4, 100]) == 3.0  # floor(0.2*5)=1 dropped at each end
    assert trimmed_mean([1, 2, 3]) == 2.0  # floor(0.6)=0: plain mean


def test_across_traces_follows_the_trimmed_mean_rule() -> None:
    """The analyses' vectorised per-group means are the profiler's `trimmed_mean` of each
    group (NaN values, i.e. traces without the value, left out)."""
    groups = {
        "a": [1.0, 2.0, 3.0, 4.0, 100.0, math.nan],
        "b": [1.0, 2.0, 3.0],
        "c": [5.0, 1.0, 9.0, 2.0, 8.0, 7.0, 3.0, 6.0, 4.0, 10.0, 50.0],
    }
    rows = [(m, i, v) for m, vs in groups.items() for i, v in enumerate(vs)]
    out = across_traces(pd.DataFrame(rows, columns=["model", "tkey", "v"]), ["model"], ["v"])
    got = dict(zip(out["model"], out["v"], strict=True))
    expected = {m: trimmed_mean([v for v in vs if not math.isnan(v)]) for m, vs in groups.items()}
    assert got == pytest.approx(expected)


def test_live_batch_one_only_asks_for_batch_two(ta: TraceAnalysis) -> None:
    decisions = ta.get_batch_decision()
    assert set(decisions) == {"big_cnn", "small_cnn"}
    for d in decisions.values():
        assert d["status"] == "not_yet_known" and d["measure_next"] == [2]
    assert ta.get_optimal_batch() == {"big_cnn": None, "small_cnn": None}


def test_parse_since() -> None:
    now = 1_800_000_000_000_000_000
    assert parse_since("2h", now) == now - 2 * 3600 * 10**9
    assert parse_since("2026-01-01") == 1_767_225_600 * 10**9
    assert parse_since("2026-01-01T01:00:00+01:00") == 1_767_225_600 * 10**9
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday-ish")


def test_tf_serving_op_spans_split_client_latency(tmp_path: Path) -> None:
    """A TF-Serving trace has no server request span: its backend's op events (kind `tf_op`)
    give `tf_ops` (their envelope) and `outside_tf_ops` (the rest of the client's latency)."""
    db = tmp_path / "tf.db"
    store = TraceStore(db)
    ms = 1_000_000
    for n, (client_ms, ops) in enumerate([(10, [(2, 5), (4, 8)]), (20, [(3, 9)]), (30, [])]):
        trace_id, request_id, model_id = new_trace_id(), new_span_id(), new_span_id()
        spans = [
            Span(trace_id, request_id, None, Level.REQUEST, "Predict", "Predict", 0,
                 client_ms * ms, Source.PROXY),
            Span(trace_id, model_id, request_id, Level.MODEL, "model", "model", ms, 2 * ms,
                 Source.REPLAY),
            *(Span(trace_id, new_span_id(), request_id, Level.SERVER, f"op{i}", "tf_op",
                   start * ms, end * ms, Source.BACKEND) for i, (start, end) in enumerate(ops)),
        ]  # fmt: skip
        trace = Trace(trace_id, "keras_cnn", created_ns=n + 1, batch_size=1)
        store.write_trace(trace, spans)
    store.close()
    res = TraceAnalysis.from_paths([db]).result("live_breakdown")
    table = res.table.set_index("phase")
    assert list(table.index) == [
        "client_total", "tf_ops", "outside_tf_ops", "server_after_response"
    ]  # fmt: skip
    assert list(table["requests"]) == [3, 2, 2, 2]
    assert close(table.loc["client_total", "mean_ms"], 20.0)
    assert close(table.loc["tf_ops", "mean_ms"], (6 + 6) / 2)  # 2..8 and 3..9
    assert close(table.loc["outside_tf_ops", "mean_ms"], (4 + 14) / 2)
    assert any(n.startswith("tf_ops: ") for n in res.notes)
    assert any("1 sampled requests have no backend spans" in n for n in res.notes)
    # shares over the two requests with op events: 12 of 30 ms and 18 of 30 ms, adding up
    assert close(table.loc["tf_ops", "share_of_client"], 12 / 30)
    assert close(table.loc["outside_tf_ops", "share_of_client"], 18 / 30)
    assert close(table.loc["client_total", "share_of_client"], 1.0)


def _live(db: Path) -> tuple[pd.DataFrame, list[str]]:
    res = TraceAnalysis.from_paths([db]).result("live_breakdown")
    return res.table.set_index("phase"), res.notes


def test_server_work_after_the_response_is_placed_apart(tmp_path: Path) -> None:
    """Triton stamps its ends after the response left: the phases are clipped to the response's
    first byte at the relay, add up to the client's latency, none is negative, and what ran
    after is `server_after_response`."""
    db = tmp_path / "live.db"
    tid, rid = new_trace_id(), new_span_id()
    # client 0..5 ms; request forwarded at 0.2; response's first byte at 4.0
    spans = [
        relay_request(tid, rid, (0, 200_000, 4 * MS, 5 * MS)),
        *server_spans(tid, rid, {
            "request": (0.5, 6.0), "queue": (0.6, 1.0), "compute_input": (1.1, 1.5),
            "compute_infer": (1.5, 3.8), "compute_output": (3.8, 5.5),
        }),
    ]  # fmt: skip
    write_live(db, [("add_sub", spans)])
    table, notes = _live(db)
    mean = table["mean_ms"]
    assert mean["client_total"] == pytest.approx(5.0)
    assert mean["backend_response"] == pytest.approx(3.8)
    assert mean["network_proxy"] == pytest.approx(0.5 + 1.0)  # 0..0.5 and 4.0..5.0
    assert mean["compute_infer"] == pytest.approx(2.3)
    assert mean["compute_output"] == pytest.approx(0.2)  # 3.8..4.0, the rest after
    assert mean["server_after_response"] == pytest.approx(2.0)  # 4.0..6.0
    summed = ("network_proxy", "queue", "compute_input", "compute_infer", "compute_output",
              "server_other")  # fmt: skip
    assert sum(mean[p] for p in summed) == pytest.approx(mean["client_total"], rel=1e-9)
    assert (table["mean_ms"] >= 0).all()
    assert not any("left out" in n or "without the relay's timestamps" in n for n in notes)


def test_a_trace_whose_spans_start_before_the_request_is_left_out(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    good, bad, late = new_trace_id(), new_trace_id(), new_trace_id()
    traces = []
    for tid, server in (
        (good, {"request": (0.5, 3.5), "queue": (0.6, 1.0)}),
        (bad, {"request": (-2.0, 3.5), "queue": (0.6, 1.0)}),  # before the relay saw it
        (late, {"request": (4.5, 4.9), "queue": (4.6, 4.7)}),  # after the response came back
    ):
        rid = new_span_id()
        marks = (0, 100_000, 4 * MS, 5 * MS)
        spans = [relay_request(tid, rid, marks), *server_spans(tid, rid, server)]
        traces.append(("add_sub", spans))
    write_live(db, traces)
    table, notes = _live(db)
    assert (table["requests"] == 1).all()  # client_total too: never averaged in
    assert table.loc["network_proxy", "mean_ms"] == pytest.approx(5.0 - 3.0)
    (early,) = [n for n in notes if "starts before the request reached the relay" in n]
    assert early.startswith("1 sampled requests left out of the breakdown (add_sub)")
    assert bad[:16] in early and good[:16] not in early
    (after,) = [n for n in notes if "start after its response reached the relay" in n]
    assert late[:16] in after


def test_tf_ops_follow_the_same_rule(tmp_path: Path) -> None:
    db = tmp_path / "tf.db"
    tid, rid = new_trace_id(), new_span_id()
    spans = [
        relay_request(tid, rid, (0, 100_000, 6 * MS, 7 * MS)),
        *(Span(tid, new_span_id(), rid, Level.SERVER, f"op{i}", "tf_op", T0 + a * MS,
               T0 + b * MS, Source.BACKEND) for i, (a, b) in enumerate([(1, 3), (2, 8)])),
    ]  # fmt: skip
    write_live(db, [("keras_cnn", spans)])
    table, _ = _live(db)
    mean = table["mean_ms"]
    assert mean["tf_ops"] == pytest.approx(5.0)  # 1..6: clipped at the response's first byte
    assert mean["outside_tf_ops"] == pytest.approx(2.0)
    assert mean["server_after_response"] == pytest.approx(2.0)  # 6..8
    assert mean["backend_response"] == pytest.approx(5.9)
