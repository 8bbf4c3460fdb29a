"""Model-level analyses: throughput/latency per batch size (A1), model aggregate (A15)."""

from __future__ import annotations

import math

import pandas as pd

from analysis.common import GROUP, AnalysisResult, Frames, across_traces, empty_result
from analysis.roofline import classify, layer_metrics

A1_TITLE = "Model throughput and latency per batch size"
A15_TITLE = "Model aggregate and compute/memory-bound verdict"
DOUBLING_GAIN = 0.05  # A1: doubling the batch must raise throughput by more than this


def optimal_batch(batch_throughput: dict[int, float]) -> int | None:
    """Smallest batch size b where throughput(2b) <= 1.05 * throughput(b); None if no
    measured doubling stops paying."""
    for b in sorted(batch_throughput):
        if (
            2 * b in batch_throughput
            and batch_throughput[2 * b] <= (1 + DOUBLING_GAIN) * batch_throughput[b]
        ):
            return b
    return None


def model_throughput(fr: Frames) -> AnalysisResult:
    """A1: trimmed-mean model latency and throughput (inputs/s) per model and batch size."""
    if fr.data.empty:
        return empty_result("A1", A1_TITLE)
    ml = fr.model_latency
    if ml.empty:
        return AnalysisResult(
            "A1",
            A1_TITLE,
            status="not_captured",
            reason="no model-level latency: traces have neither a model level_stats row nor "
            "model spans",
        )
    agg = across_traces(ml, GROUP, ["latency_ns"])
    agg["latency_ms"] = agg["latency_ns"] / 1e6
    bs = agg["batch_size"].astype("float64")
    agg["throughput_per_s"] = bs / (agg["latency_ns"] / 1e9)
    agg["optimal"] = False
    notes: list[str] = []
    optimal: dict[str, int | None] = {}
    for model, grp in agg.groupby("model", sort=True):
        thr = {
            int(b): float(t)
            for b, t in zip(grp["batch_size"], grp["throughput_per_s"], strict=True)
            if not pd.isna(b)
        }
        best = optimal_batch(thr)
        optimal[str(model)] = best
        if best is None:
            notes.append(
                f"{model}: no optimal batch size among {sorted(thr)}: every measured doubling "
                "raised throughput by more than 5% (or no batch size was measured together "
                "with its double); profile larger batch sizes"
            )
        else:
            agg.loc[(agg["model"] == model) & (agg["batch_size"] == best), "optimal"] = True
    if agg["batch_size"].isna().any():
        notes.append("traces without a batch size have no throughput")
    table = agg[[*GROUP, "latency_ms", "throughput_per_s", "optimal", "n_traces"]]
    res = AnalysisResult("A1", A1_TITLE, table.reset_index(drop=True), notes=notes)
    res.extra["optimal_batch"] = optimal
    return res


def model_aggregate(fr: Frames) -> AnalysisResult:
    """A15: total FLOPs and DRAM bytes of one model run, its intensity, throughput and
    whether it is compute- or memory-bound, per model and batch size."""
    if fr.data.empty:
        return empty_result("A15", A15_TITLE)
    metrics, source = layer_metrics(fr)
    if metrics.empty:
        return AnalysisResult(
            "A15",
            A15_TITLE,
            status="not_captured",
            reason="no FLOPs/bytes recorded: kernel counters were not captured and layer spans "
            "carry no flops/dram_*_bytes estimates",
        )
    per_trace = metrics.groupby("tkey", as_index=False).agg(
        flops=("flops", "sum"), dram_bytes=("dram_bytes", "sum"), estimated=("estimated", "max")
    )
    df = fr.model_latency.merge(per_trace, on="tkey", how="inner")
    df["estimated"] = df["estimated"].astype(float)
    agg = across_traces(df, GROUP, ["latency_ns", "flops", "dram_bytes", "estimated"])
    agg = agg.merge(fr.peaks(), on=GROUP, how="left")
    agg = classify(agg, "flops", "dram_bytes", "latency_ns")
    agg["estimated"] = agg["estimated"] > 0
    agg["latency_ms"] = agg["latency_ns"] / 1e6
    agg["utilization"] = agg["arithmetic_throughput_gflops"] / agg["attainable_gflops"]
    agg["verdict"] = [
        f"{b}-bound" + (" (estimated)" if e else "") if b != "unknown" else "unknown (no peaks)"
        for b, e in zip(agg["bound"], agg["estimated"], strict=True)
    ]
    cols = [
        *GROUP,
        "latency_ms",
        "flops",
        "dram_bytes",
        "arithmetic_intensity",
        "arithmetic_throughput_gflops",
        "attainable_gflops",
        "ridge_point",
        "utilization",
        "bound",
        "verdict",
        "estimated",
        "peak_source",
        "n_traces",
    ]
    table = agg[cols].reset_index(drop=True)
    res = AnalysisResult("A15", A15_TITLE, table, estimated=bool(table["estimated"].any()))
    res.notes = [f"FLOPs and bytes summed from {source}"]
    if res.estimated:
        res.notes.append("estimated: FLOPs/bytes are estimates from layer shapes, not counters")
    if not math.isfinite(float(agg["ridge_point"].max(skipna=True) or math.nan)):
        res.notes.append("no roofline peaks recorded with these traces")
    return res
