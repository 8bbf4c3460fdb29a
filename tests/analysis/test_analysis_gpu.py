"""A1-A15 on the GPU-shaped trace store.

tests/data/gpu/traces.sqlite is built from SYNTHETIC CUPTI-like activity records (no GPU can run
here; the traces say so in their `synthetic` attribute): kernel / memcpy / memset activities
with correlation ids, cudaLaunchKernel runtime records, flops, DRAM bytes and occupancy.
Expected values come from plain SQL and arithmetic in this file.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from analysis.trace_analysis import TraceAnalysis
from sidecar.profiling.stats import decide_batch, trimmed_mean_rse
from tests.analysis.helpers import (
    GPU_DB,
    close,
    kernel_rows,
    layer_rows,
    model_latency,
    peaks,
    tmean,
    trace_attr,
)

WORK = ("kernel", "memcpy", "memset", "cpu_op")
DEVICE = ("kernel", "memcpy", "memset")


@pytest.fixture(scope="module")
def ta() -> TraceAnalysis:
    return TraceAnalysis.from_paths([GPU_DB])


def test_data_is_labelled_synthetic() -> None:
    (label,) = trace_attr(GPU_DB, "synthetic")
    assert "synthetic" in label and "no GPU" in label
    assert trace_attr(GPU_DB, "kernel_level") == {"captured"}


def test_a1_optimal_batch(ta: TraceAnalysis) -> None:
    per_trace = {b: v for (_, b), v in model_latency(GPU_DB).items()}
    lat = {b: tmean(v) for b, v in per_trace.items()}
    thr = {b: b / (ns / 1e9) for b, ns in lat.items()}
    decision = decide_batch(lat, {b: trimmed_mean_rse(v) for b, v in per_trace.items()})
    df = ta.get_model_throughput()
    assert ta.get_batch_decision() == {"tiny_resnet": decision.to_dict()}
    best = decision.optimal if decision.status == "decided" else None
    assert ta.get_optimal_batch() == {"tiny_resnet": best}
    assert list(df.loc[df["optimal"], "batch_size"]) == ([] if best is None else [best])
    for row in df.itertuples():
        assert close(row.throughput_per_s, thr[row.batch_size])
        if 2 * row.batch_size in thr:
            assert close(row.doubling_gain, thr[2 * row.batch_size] / thr[row.batch_size] - 1)


def test_a2_uses_the_layer_run_not_the_kernel_run(ta: TraceAnalysis) -> None:
    df = ta.get_layer_table()
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for r in layer_rows(GPU_DB, "layer"):
        groups[(r["batch"], r["name"])].append(r["duration"])
    k_run = defaultdict(list)
    for r in layer_rows(GPU_DB, "kernel"):
        k_run[(r["batch"], r["name"])].append(r["duration"])
    assert len(df) == len(groups)
    for row in df.itertuples():
        assert close(row.latency_ms, tmean(groups[(row.batch_size, row.name)]) / 1e6)
        assert not close(row.latency_ms, tmean(k_run[(row.batch_size, row.name)]) / 1e6)


def _group(rows: list[dict[str, Any]], key: Any) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def test_a8_kernel_table(ta: TraceAnalysis) -> None:
    pf, bw = peaks(GPU_DB)
    rows = [r for r in kernel_rows(GPU_DB) if r["kind"] in WORK]
    groups = _group(rows, lambda r: (r["batch"], r["layer"], r["idx"], r["name"]))
    df = ta.get_kernel_table()
    assert len(df) == len(groups)
    assert set(df["kind"]) == {"kernel", "memcpy", "memset"}  # no runtime API calls
    for row in df.itertuples():
        g = groups[(row.batch_size, row.layer, row.idx, row.name)]
        assert close(row.latency_ms, tmean([r["duration"] for r in g]) / 1e6)
        if row.kind != "kernel":
            assert row.memory_bound is None
            continue
        flops = tmean([r["flops"] for r in g])
        rd = tmean([r["dram_read_bytes"] for r in g])
        wr = tmean([r["dram_write_bytes"] for r in g])
        occ = tmean([r["achieved_occupancy"] for r in g])
        assert close(row.flops, flops) and close(row.dram_read_bytes, rd)
        assert close(row.achieved_occupancy, occ)
        assert close(row.arithmetic_intensity, flops / (rd + wr))
        lat_s = tmean([r["duration"] for r in g]) / 1e9
        assert close(row.arithmetic_throughput_gflops, flops / lat_s / 1e9)
        assert row.memory_bound == (flops / (rd + wr) < pf / bw)
    # kernels launched through a cudaLaunchKernel record are attributed to the launch's layer
    assert df["layer"].notna().all()


def test_a9_kernel_roofline(ta: TraceAnalysis) -> None:
    pf, bw = peaks(GPU_DB)
    rows = [r for r in kernel_rows(GPU_DB) if r["kind"] == "kernel"]
    groups = _group(rows, lambda r: (r["batch"], r["layer"], r["idx"], r["name"]))
    res = ta.result("A9")
    assert res.ok and not res.estimated
    df = res.table
    assert len(df) == len(groups)
    for row in df.itertuples():
        g = groups[(row.batch_size, row.layer, row.idx, row.name)]
        ai = tmean([r["flops"] for r in g]) / tmean(
            [r["dram_read_bytes"] + r["dram_write_bytes"] for r in g]
        )
        assert close(row.arithmetic_intensity, ai)
        assert close(row.attainable_gflops, min(pf, ai * bw) / 1e9)
        assert row.bound == ("memory" if ai < pf / bw else "compute")
    assert set(df["bound"]) == {"memory", "compute"}


def _per_trace(rows: list[dict[str, Any]], key: Any) -> dict[Any, dict[str, float]]:
    out: dict[Any, dict[str, float]] = defaultdict(
        lambda: {"count": 0, "lat": 0.0, "flops": 0.0, "occ_lat": 0.0, "lat_occ": 0.0}
    )
    for r in rows:
        d = out[(r["trace"], r["batch"], key(r))]
        d["count"] += 1
        d["lat"] += r["duration"]
        d["flops"] += r.get("flops", 0.0)
        if "achieved_occupancy" in r:
            d["occ_lat"] += r["achieved_occupancy"] * r["duration"]
            d["lat_occ"] += r["duration"]
    return out


def test_a10_kernels_by_name(ta: TraceAnalysis) -> None:
    rows = [r for r in kernel_rows(GPU_DB) if r["kind"] in WORK]
    per = _per_trace(rows, lambda r: r["name"])
    by: dict[tuple[int, str], list[dict[str, float]]] = defaultdict(list)
    for (_, batch, name), d in per.items():
        by[(batch, name)].append(d)
    df = ta.get_kernels_by_name()
    assert len(df) == len(by)
    for row in df.itertuples():
        ds = by[(row.batch_size, row.name)]
        assert close(row.count, tmean([d["count"] for d in ds]))
        assert close(row.latency_ms, tmean([d["lat"] for d in ds]) / 1e6)
        if row.kind == "kernel":
            occ = tmean([d["occ_lat"] / d["lat_occ"] for d in ds])
            assert close(row.achieved_occupancy, occ)  # latency-weighted
    for _batch, g in df.groupby("batch_size"):
        assert list(g["latency_ms"]) == sorted(g["latency_ms"], reverse=True)
        assert close(g["share"].sum(), 1.0)


def test_a11_a12_by_layer(ta: TraceAnalysis) -> None:
    rows = [r for r in kernel_rows(GPU_DB) if r["kind"] in WORK]
    per = _per_trace(rows, lambda r: r["layer"])
    by: dict[tuple[int, str], list[dict[str, float]]] = defaultdict(list)
    for (_, batch, layer), d in per.items():
        by[(batch, layer)].append(d)
    a11, a12 = ta.get_kernels_by_layer(), ta.get_gpu_metrics_by_layer()
    assert len(a11) == len(a12) == len(by)
    for row in a11.itertuples():
        ds = by[(row.batch_size, row.layer)]
        assert close(row.count, tmean([d["count"] for d in ds]))
        assert close(row.latency_ms, tmean([d["lat"] for d in ds]) / 1e6)
    for row in a12.itertuples():
        ds = by[(row.batch_size, row.layer)]
        assert close(row.flops, tmean([d["flops"] for d in ds]))
        assert close(row.achieved_occupancy, tmean([d["occ_lat"] / d["lat_occ"] for d in ds]))
    assert list(a11[a11["batch_size"] == 1]["idx"]) == sorted(a11[a11["batch_size"] == 1]["idx"])


def test_a13_never_compares_host_intervals_with_gpu_time(ta: TraceAnalysis) -> None:
    """The synthetic traces' layer times are host intervals written without
    `layer_time_base`: A13 declines to subtract kernel times from them instead of printing
    negative times, and says their layer times were not taken on the GPU timeline."""
    assert trace_attr(GPU_DB, "layer_time_base") == {None}
    res = ta.result("A13")
    assert res.status == "not_captured"
    assert "no layer run timed on the GPU timeline" in res.reason


def test_a14_layer_roofline_from_counters(ta: TraceAnalysis) -> None:
    pf, bw = peaks(GPU_DB)
    flops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in kernel_rows(GPU_DB):
        if r["kind"] == "kernel":
            flops[(r["trace"], r["layer"])][0] += r["flops"]
            flops[(r["trace"], r["layer"])][1] += r["dram_read_bytes"] + r["dram_write_bytes"]
    per: dict[tuple[int, str], list[tuple[float, float, float]]] = defaultdict(list)
    for r in layer_rows(GPU_DB, "layer"):
        f, b = flops[(r["trace"], r["name"])]
        per[(r["batch"], r["name"])].append((f, b, r["duration"]))
    res = ta.result("A14")
    assert res.ok and not res.estimated  # counters, not estimates
    assert "kernel counters" in res.notes[0]
    for row in res.table.itertuples():
        vals = per[(row.batch_size, row.name)]
        f, b, lat = (tmean([v[i] for v in vals]) for i in range(3))
        assert close(row.arithmetic_intensity, f / b)
        assert close(row.arithmetic_throughput_gflops, f / (lat / 1e9) / 1e9)
        assert row.bound == ("memory" if f / b < pf / bw else "compute")


def test_a15_model_aggregate(ta: TraceAnalysis) -> None:
    pf, bw = peaks(GPU_DB)
    tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    batch_of = {}
    for r in kernel_rows(GPU_DB):
        if r["kind"] == "kernel" and r["layer"] is not None:
            tot[r["trace"]][0] += r["flops"]
            tot[r["trace"]][1] += r["dram_read_bytes"] + r["dram_write_bytes"]
            batch_of[r["trace"]] = r["batch"]
    lat = model_latency(GPU_DB)
    df = ta.get_model_aggregate()
    assert len(df) == 4 and not df["estimated"].any()
    for row in df.itertuples():
        tids = [t for t, b in batch_of.items() if b == row.batch_size]
        f = tmean([tot[t][0] for t in tids])
        b = tmean([tot[t][1] for t in tids])
        latency = tmean(lat[("tiny_resnet", row.batch_size)])
        assert close(row.flops, f) and close(row.dram_bytes, b)
        assert close(row.latency_ms, latency / 1e6)
        bound = "memory" if f / b < pf / bw else "compute"
        assert row.verdict == f"{bound}-bound"
        assert close(row.utilization, (f / (latency / 1e9)) / min(pf, f / b * bw))


def _union(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of intervals: a plain sweep over merged runs."""
    total = 0
    runs: list[list[int]] = []
    for s, e in sorted(intervals):
        if runs and s <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    for s, e in runs:
        total += e - s
    return total


def test_time_breakdown(ta: TraceAnalysis) -> None:
    from tests.analysis.helpers import q

    windows = {
        tid: (s, e, b)
        for tid, s, e, b in q(
            GPU_DB,
            "SELECT s.trace_id, s.start_ns, s.end_ns, t.batch_size FROM spans s JOIN traces t "
            "USING (trace_id) WHERE s.level='model' AND s.run_level='kernel'",
        )
    }
    acts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in kernel_rows(GPU_DB):
        if r["kind"] in DEVICE:
            acts[r["trace"]].append(r)
    per: dict[int, list[tuple[float, float, float, float]]] = defaultdict(list)
    for tid, (ws, we, batch) in windows.items():
        clip = [(max(r["start"], ws), min(r["end"], we), r["kind"]) for r in acts[tid]]
        busy = _union([(s, e) for s, e, _ in clip if e > s])
        kern = _union([(s, e) for s, e, k in clip if e > s and k == "kernel"])
        per[batch].append((we - ws, kern, busy - kern, we - ws - busy))
    df = ta.get_time_breakdown()
    assert len(df) == len(per)
    for row in df.itertuples():
        vals = per[row.batch_size]
        w, k, nk, idle = (tmean([v[i] for v in vals]) for i in range(4))
        assert close(row.window_ms, w / 1e6) and close(row.kernel_ms, k / 1e6)
        assert close(row.non_kernel_ms, nk / 1e6) and close(row.idle_ms, idle / 1e6)
        assert nk > 0  # memcpy/memset time outside kernels exists in this data


def test_mixed_cpu_and_gpu_selection() -> None:
    """A GPU-shaped store and a CPU store in one report: each model keeps its own source of
    FLOPs (counters vs estimates), and the kernel tables say which traces lack kernels."""
    from tests.analysis.helpers import CPU_DB

    ta = TraceAnalysis.from_paths([GPU_DB, CPU_DB])
    a15 = ta.get_model_aggregate()
    est = dict(zip(a15["model"], a15["estimated"], strict=False))
    assert est == {"tiny_resnet": False, "small_cnn": True}
    assert ta.result("A15").estimated
    a8 = ta.result("A8")
    assert set(a8.table["model"]) == {"tiny_resnet"}
    (reason,) = trace_attr(CPU_DB, "kernel_level")
    assert any("kernel level not captured in" in n and reason in n for n in a8.notes)
    assert set(ta.get_layer_table()["model"]) == {"tiny_resnet", "small_cnn"}


# -- A GPU trace of ResNet-50 built from the real H100 recordings ----------------------------


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> TraceAnalysis:
    """ResNet-50 b8 (with Nsight Compute metrics) and b1, as `profile` would store them."""
    from sidecar.profiling.gpu.recording import profile_recording
    from sidecar.trace.store import TraceStore
    from tests.gpu.conftest import NCU_B8, RESNET_B1, RESNET_B8

    db = tmp_path_factory.mktemp("h100") / "traces.sqlite"
    with TraceStore(db) as store:
        for path, batch, ncu in ((RESNET_B8, 8, NCU_B8), (RESNET_B1, 1, None)):
            r = profile_recording(path, model="resnet50", batch_size=batch, ncu_csv=ncu)
            store.write_trace(r.trace, r.spans, r.level_stats)
    return TraceAnalysis.from_paths([db])


def test_h100_trace_reports_a1_to_a15(h100: TraceAnalysis) -> None:
    from analysis.trace_analysis import XSP_IDS

    missing = {k: h100.result(k) for k in XSP_IDS if not h100.result(k).ok}
    # the recordings carry no allocation data: layer memory (A4, A7) is truly not there
    assert set(missing) == {"A4", "A7"}
    assert all("allocated_bytes" in r.reason for r in missing.values())
    for key in ("A9", "A12", "A14", "A15"):
        # Nsight Compute counters; the tensor-pipe FLOPs among them are converted from
        # instruction counts at an assumed MMA shape, so the results say "estimated"
        assert h100.result(key).ok and h100.result(key).estimated
    idle = [f for f in h100.findings() if f.rule == "launch_bound"]
    assert any("GPU is idle 87%-93%" in f.finding and "(batch 1, 8)" in f.finding for f in idle)


def test_h100_every_call_and_every_kernel_is_listed(h100: TraceAnalysis) -> None:
    a2 = h100.get_layer_table()
    b8 = a2[a2["batch_size"] == 8]
    relus = sorted(n for n in b8["name"] if n.startswith("layer1.0.relu"))
    assert relus == ["layer1.0.relu", "layer1.0.relu#1", "layer1.0.relu#2"]
    a11 = h100.result("A11")
    assert not any("outside any layer" in n for n in a11.notes)
    k8 = a11.table[a11.table["batch_size"] == 8]
    assert k8["count"].sum() == 232
    assert k8["latency_ms"].sum() == pytest.approx(1.77, abs=0.01)


def test_h100_a13_compares_gpu_timeline_times(h100: TraceAnalysis) -> None:
    res = h100.result("A13")
    t = res.table
    assert set(t["batch_size"]) == {8}  # the b1 recording has host hook times only
    assert any("host hook intervals" in n for n in res.notes)
    assert (t["non_gpu_latency_ms"] >= 0).all()
    layer1 = t[t["name"] == "layer1"].iloc[0]
    inner = t[t["name"].str.startswith("layer1.") & ~t["name"].str.contains(r"layer1\.\d+$")]
    # a container's GPU time includes its children's kernels and its own residual adds
    assert layer1["gpu_latency_ms"] > inner["gpu_latency_ms"].sum()


def test_h100_small_batch_gpu_is_idle_most_of_the_forward(h100: TraceAnalysis) -> None:
    tb = h100.get_time_breakdown()
    for row in tb.itertuples():
        assert row.idle_ms > 0.5 * row.window_ms
    b8 = tb[tb["batch_size"] == 8].iloc[0]
    assert b8["kernel_ms"] == pytest.approx(1.77, abs=0.01)


def test_h100_roofline_uses_measured_counters(h100: TraceAnalysis) -> None:
    a15 = h100.get_model_aggregate()
    row = a15[a15["batch_size"] == 8].iloc[0]
    from sidecar.profiling.gpu.ncu import kernel_attributes, read_ncu_csv
    from tests.gpu.conftest import NCU_B8

    attrs = [kernel_attributes(k) for k in read_ncu_csv(NCU_B8)]
    assert row["flops"] == pytest.approx(sum(a["flops"] for a in attrs), rel=1e-6)
    dram = sum(a["dram_read_bytes"] + a["dram_write_bytes"] for a in attrs)
    assert row["dram_bytes"] == pytest.approx(dram, rel=1e-6)


def test_h100_container_layers_are_never_counted_twice(h100: TraceAnalysis) -> None:
    """Layer spans nest (layer1 > layer1.0 > layer1.0.conv1): A2 lists every call and marks
    the 24 containers; shares, A3, A5, A6 and A14 use the 158 leaf calls only."""
    a2 = h100.get_layer_table()
    b8 = a2[a2["batch_size"] == 8]
    assert len(b8) == 158 + 24 and int(b8["container"].sum()) == 24
    assert b8.loc[b8["container"], "latency_share"].isna().all()
    assert b8["latency_share"].sum() == pytest.approx(1.0)
    order = list(b8.sort_values("idx")["name"])  # an enclosing call before its children
    assert order.index("layer1") < order.index("layer1.0") < order.index("layer1.0.conv1")
    a3 = h100.result("A3")
    leaves = a3.table[a3.table["batch_size"] == 8]
    assert len(leaves) == 158 and "layer1" not in set(leaves["name"])
    assert any("24 container layers" in n for n in a3.notes)
    model_ms = h100.result("A1").table.set_index("batch_size").loc[8, "latency_ms"]
    assert leaves["latency_ms"].sum() < model_ms  # nesting no longer adds layer1 to its leaves
    a5 = h100.result("A5").table
    assert a5[a5["batch_size"] == 8]["layers"].sum() == 158
    assert "container" not in set(a5["type"])
    a6 = h100.result("A6").table
    assert a6[a6["batch_size"] == 8]["latency_ms"].sum() == pytest.approx(
        leaves["latency_ms"].sum()
    )
    a14 = h100.result("A14").table
    assert set(a14[a14["batch_size"] == 8]["name"]) == set(leaves["name"])
    mem = [f for f in h100.findings() if "memory-bound layers" in f.finding and "8" in f.finding]
    assert mem and all("container" not in f.evidence for f in mem)
    assert any("of 158 layers" in f.evidence for f in mem)


def test_h100_kernel_names_short_in_text_and_html_full_in_json_and_csv(
    h100: TraceAnalysis, tmp_path: Path
) -> None:
    from analysis.render.html import render_html
    from analysis.render.text import SHORT_NAMES_NOTE, render_json, render_text, write_csv

    results = {k: h100.result(k) for k in ("A8", "A9", "A10")}
    short = "at::native::vectorized_elementwise_kernel<…>"
    full = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>"
    for text in (
        render_text(results, {}),
        render_text(results, {}, markdown=True),
        html.unescape(render_html(results, {}, plots=False)),
    ):
        assert short in text and full not in text and "std::array<char*" not in text
        assert SHORT_NAMES_NOTE in text
    doc = json.loads(render_json(results, {}))
    assert any(r["name"].startswith(full) for r in doc["A8"]["rows"])
    assert not any(r["name"] == short for r in doc["A10"]["rows"])
    write_csv(results, tmp_path)
    assert full in (tmp_path / "A9.csv").read_text()
    assert results["A8"].table["name"].str.startswith("void ").any()  # the result keeps them


def test_h100_metrics_analyses_say_where_metrics_came_from(h100: TraceAnalysis) -> None:
    for key in ("A9", "A12", "A14", "A15"):
        notes = h100.result(key).notes
        assert any(
            n.startswith("metrics_level: captured: Nsight Compute") and "resnet50 b8" in n
            for n in notes
        )
        assert any(n.startswith("metrics_level: not captured") and "b1" in n for n in notes)
        assert any(n.startswith("pm_sampling: not captured") for n in notes)


def test_a_gpu_trace_without_layers_says_so_and_still_sums_the_run(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """What a TorchScript model on CUDA stores (M and K, no layer spans): built from the
    ResNet-50 b8 recording with its layer spans taken out. A15 sums every kernel's counters;
    A13 and A14 say why they have nothing, not "CPU ops only" or "not captured"."""
    from dataclasses import replace

    from sidecar.profiling.gpu.ncu import kernel_attributes, read_ncu_csv
    from sidecar.profiling.gpu.recording import profile_recording
    from sidecar.trace.spans import Level
    from sidecar.trace.store import TraceStore
    from tests.gpu.conftest import NCU_B8, RESNET_B8

    r = profile_recording(RESNET_B8, model="resnet50", batch_size=8, ncu_csv=NCU_B8)
    spans = [
        replace(s, parent_id=None) if s.level is Level.KERNEL else s
        for s in r.spans
        if s.level is not Level.LAYER
    ]
    db = tmp_path / "traces.sqlite"  # type: ignore[operator]
    with TraceStore(db) as store:
        store.write_trace(r.trace, spans, r.level_stats)
    ta = TraceAnalysis.from_paths([db])
    assert "no kernel belongs to a layer" in ta.result("A13").reason
    assert "no kernel belongs to a layer" in ta.result("A14").reason
    a15 = ta.result("A15")
    assert a15.ok
    total = sum(kernel_attributes(k)["flops"] for k in read_ncu_csv(NCU_B8))
    assert a15.table.iloc[0]["flops"] == pytest.approx(total, rel=1e-6)
