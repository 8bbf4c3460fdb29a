"""A1-A15 on the CPU trace store: real `xsp-sidecar profile` runs of the small CNN on ONNX
Runtime CPU (M and L runs; the kernel level is not captured on CPU).

Expected values come from plain SQL over tests/data/cpu/traces.sqlite and arithmetic here.
"""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from analysis.analyses.common import NotCapturedError
from analysis.load.tracedb import TraceFilter
from analysis.trace_analysis import TraceAnalysis
from sidecar.profiling.stats import decide_batch, trimmed_mean_rse
from sidecar.trace.spans import Level, Source, Span, Trace
from sidecar.trace.store import TraceStore
from tests.analysis.helpers import (
    CPU_DB,
    close,
    layer_rows,
    model_latency,
    peaks,
    q,
    tmean,
    trace_attr,
)


@pytest.fixture(scope="module")
def ta() -> TraceAnalysis:
    return TraceAnalysis.from_paths([CPU_DB])


def test_failed_profiles_are_left_out(tmp_path: Path) -> None:
    db = tmp_path / "with-error.sqlite"
    shutil.copy(CPU_DB, db)
    store = TraceStore(db)  # the real store records a failed profile
    store.write_trace(
        Trace(
            "f" * 32, "small_cnn", created_ns=1, batch_size=1, status="error", error="replay failed"
        ),
        [
            Span(
                "f" * 32,
                "1" * 16,
                None,
                Level.MODEL,
                "small_cnn",
                "model",
                0,
                10**9,
                Source.REPLAY,
                run_level=Level.MODEL,
            )
        ],
    )
    store.close()
    ta = TraceAnalysis.from_paths([db])
    (n_ok,) = q(CPU_DB, "SELECT COUNT(*) FROM traces WHERE status = 'ok'")[0]
    assert ta.data.skipped_errors == 1
    assert len(ta.data.traces) == n_ok and "f" * 32 not in set(ta.data.traces["trace_id"])
    a1 = ta.get_model_throughput()
    assert a1["latency_ms"].max() < 1000  # the failed trace's 1 s span is not counted
    assert TraceAnalysis.from_paths([db], TraceFilter(include_errors=True)).data.skipped_errors == 0


def test_a1_throughput_latency_and_optimal_batch(ta: TraceAnalysis) -> None:
    df = ta.get_model_throughput()
    expected = model_latency(CPU_DB)
    assert len(df) == len(expected)
    thr = {}
    for row in df.itertuples():
        lats = expected[(row.model, row.batch_size)]
        lat = tmean(lats)
        assert row.n_traces == len(lats)
        assert close(row.latency_ms, lat / 1e6)
        assert close(row.throughput_per_s, row.batch_size / (lat / 1e9))
        thr[row.batch_size] = row.batch_size / (lat / 1e9)
    # the report uses the one optimal-batch rule, fed with the per-trace spread
    decision = decide_batch(
        {b: tmean(v) for (_, b), v in expected.items()},
        {b: trimmed_mean_rse(v) for (_, b), v in expected.items()},
    )
    assert ta.get_batch_decision() == {"small_cnn": decision.to_dict()}
    best = decision.optimal if decision.status == "decided" else None
    assert ta.get_optimal_batch() == {"small_cnn": best}
    assert list(df.loc[df["optimal"], "batch_size"]) == ([] if best is None else [best])
    assert decision.reason in " ".join(ta.result("A1").notes)
    # five profiles per batch size: the trimmed mean drops the fastest and the slowest
    assert set(df["n_traces"]) == {5}


def _expected_layers() -> dict[tuple[int, str], dict]:
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in layer_rows(CPU_DB):
        groups[(r["batch"], r["name"])].append(r)
    out = {}
    for key, rows in groups.items():
        out[key] = {
            "latency_ns": tmean([r["duration"] for r in rows]),
            "allocated": tmean([r["allocated_bytes"] for r in rows]),
            "type": rows[0]["op_type"],
            "idx": rows[0]["idx"],
            "flops": tmean([r["flops"] for r in rows]),
            "bytes": tmean([r["dram_read_bytes"] + r["dram_write_bytes"] for r in rows]),
            "n": len(rows),
            "output_shapes": rows[0]["output_shapes"],
        }
    return out


def test_a2_layer_table(ta: TraceAnalysis) -> None:
    df = ta.get_layer_table()
    exp = _expected_layers()
    assert len(df) == len(exp)
    for row in df.itertuples():
        e = exp[(row.batch_size, row.name)]
        assert row.type == e["type"] and row.idx == e["idx"] and row.n_traces == e["n"]
        assert close(row.latency_ms, e["latency_ns"] / 1e6)
        assert close(row.allocated_bytes, e["allocated"])
        assert str(e["output_shapes"]).replace(" ", "") == row.output_shapes.replace(" ", "")
    # the L run's layer spans, not another run's, and shares sum to one per batch size
    assert df.groupby("batch_size")["latency_share"].sum().round(9).eq(1.0).all()


def test_a3_a4_execution_order(ta: TraceAnalysis) -> None:
    exp = _expected_layers()
    lat = ta.get_layer_latency()
    mem = ta.get_layer_memory()
    for batch in (1, 2, 4):
        names = [
            n
            for (n,) in q(
                CPU_DB,
                "SELECT DISTINCT s.name FROM spans s JOIN traces t USING (trace_id) WHERE "
                "t.status='ok' AND t.batch_size=? AND s.level='layer' ORDER BY s.idx",
                (batch,),
            )
        ]
        assert list(lat[lat["batch_size"] == batch]["name"]) == names
        got = mem[mem["batch_size"] == batch]
        assert list(got["name"]) == names
        for row in got.itertuples():
            assert close(row.allocated_bytes, exp[(batch, row.name)]["allocated"])
            assert close(row.allocated_mib, exp[(batch, row.name)]["allocated"] / 2**20)


def test_a5_a6_a7_by_type(ta: TraceAnalysis) -> None:
    exp = _expected_layers()
    count: dict[tuple[int, str], int] = defaultdict(int)
    latency: dict[tuple[int, str], float] = defaultdict(float)
    memory: dict[tuple[int, str], float] = defaultdict(float)
    for (batch, _name), e in exp.items():
        count[(batch, e["type"])] += 1
        latency[(batch, e["type"])] += e["latency_ns"] / 1e6
        memory[(batch, e["type"])] += e["allocated"]
    a5, a6, a7 = (
        ta.get_layer_type_distribution(),
        ta.get_latency_by_layer_type(),
        ta.get_memory_by_layer_type(),
    )
    assert len(a5) == len(a6) == len(a7) == len(count)
    for row in a5.itertuples():
        assert row.layers == count[(row.batch_size, row.type)]
        total = sum(v for (b, _), v in count.items() if b == row.batch_size)
        assert close(row.share, row.layers / total)
    for row in a6.itertuples():
        assert close(row.latency_ms, latency[(row.batch_size, row.type)])
    conv = a6[(a6["batch_size"] == 1)].iloc[0]
    # sorted by latency, the convolutions dominate; ORT fused each with its Relu
    assert conv["type"] == "Conv+Relu"
    for row in a7.itertuples():
        assert close(row.allocated_bytes, memory[(row.batch_size, row.type)])


@pytest.mark.parametrize("key", ["A8", "A9", "A10", "A11", "A12", "A13", "time_breakdown"])
def test_kernel_analyses_say_not_captured_and_why(ta: TraceAnalysis, key: str) -> None:
    (reason,) = trace_attr(CPU_DB, "kernel_level")
    assert reason != "captured"
    res = ta.result(key)
    assert res.status == "not_captured"
    assert reason in res.reason
    assert res.table.empty


def test_get_kernel_table_raises_with_reason(ta: TraceAnalysis) -> None:
    with pytest.raises(NotCapturedError, match="A8 Kernel table: no kernel-level spans"):
        ta.get_kernel_table()


def test_a14_layer_roofline_uses_estimates(ta: TraceAnalysis) -> None:
    pf, bw = peaks(CPU_DB)
    exp = _expected_layers()
    res = ta.result("A14")
    assert res.ok and res.estimated
    df = res.table
    assert df["estimated"].all()
    assert len(df) == len(exp)
    for row in df.itertuples():
        e = exp[(row.batch_size, row.name)]
        assert close(row.arithmetic_throughput_gflops, e["flops"] / (e["latency_ns"] / 1e9) / 1e9)
        if e["bytes"] == 0:  # e.g. a Flatten that moves no data: no intensity, no verdict
            assert math.isnan(row.arithmetic_intensity) and row.bound == "unknown"
            continue
        ai = e["flops"] / e["bytes"]
        assert close(row.arithmetic_intensity, ai)
        assert row.bound == ("memory" if ai < pf / bw else "compute")
    assert "Conv+Relu" in set(df.loc[df["bound"] != "unknown", "type"])


def test_a15_model_aggregate_estimated(ta: TraceAnalysis) -> None:
    pf, bw = peaks(CPU_DB)
    lat = model_latency(CPU_DB)
    per_trace: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    batch_of = {}
    for r in layer_rows(CPU_DB):
        per_trace[r["trace"]][0] += r["flops"]
        per_trace[r["trace"]][1] += r["dram_read_bytes"] + r["dram_write_bytes"]
        batch_of[r["trace"]] = r["batch"]
    df = ta.get_model_aggregate()
    assert len(df) == 3
    for row in df.itertuples():
        tids = [t for t, b in batch_of.items() if b == row.batch_size]
        flops = tmean([per_trace[t][0] for t in tids])
        nbytes = tmean([per_trace[t][1] for t in tids])
        latency = tmean(lat[("small_cnn", row.batch_size)])
        assert close(row.flops, flops) and close(row.dram_bytes, nbytes)
        assert close(row.arithmetic_throughput_gflops, flops / (latency / 1e9) / 1e9)
        bound = "memory" if flops / nbytes < pf / bw else "compute"
        assert row.bound == bound
        assert row.verdict == f"{bound}-bound (estimated)"
        assert row.estimated
    assert ta.result("A15").estimated


def test_overhead_per_level(ta: TraceAnalysis) -> None:
    df = ta.get_overhead()
    rows = q(
        CPU_DB,
        "SELECT t.batch_size, l.level, l.overhead_ratio, l.trimmed_mean_ns FROM level_stats l "
        "JOIN traces t USING (trace_id) WHERE t.status='ok'",
    )
    groups: dict[tuple[int, str], list[tuple[float, int]]] = defaultdict(list)
    for b, level, ratio, ns in rows:
        groups[(b, level)].append((ratio, ns))
    assert len(df) == len(groups)
    for row in df.itertuples():
        g = groups[(row.batch_size, row.level)]
        assert close(row.overhead_ratio, tmean([r for r, _ in g]))
        assert close(row.latency_ms, tmean([n for _, n in g]) / 1e6)
        assert close(row.added_pct, (row.overhead_ratio - 1) * 100)
    assert list(df[df["batch_size"] == 1]["level"]) == ["model", "layer"]


def test_live_breakdown_not_captured_on_profile_traces(ta: TraceAnalysis) -> None:
    res = ta.result("live_breakdown")
    assert res.status == "not_captured" and "no live spans" in res.reason


def test_fused_layers_name_their_original_nodes(ta: TraceAnalysis) -> None:
    df = ta.get_layer_table()
    for r in layer_rows(CPU_DB):
        row = df[(df["batch_size"] == r["batch"]) & (df["name"] == r["name"])].iloc[0]
        nodes = r.get("original_nodes") or []
        if nodes and nodes != [r["name"]]:  # fused (ORT's Conv+Relu) or renamed
            assert row["original_nodes"] == ", ".join(nodes)
        else:  # the node of its name, or a reorder ORT inserted
            assert row["original_nodes"] == ""
    assert (df["original_nodes"] == "Conv_0, Relu_0").any()
    assert "GlobalAveragePool_0" in set(df["original_nodes"])  # renamed ..._out_nchwc
