"""Model-level analyses: throughput/latency per batch size (A1), model aggregate (A15)."""

from __future__ import annotations

import math

import pandas as pd

from analysis.analyses import ensemble_steps
from analysis.analyses.common import GROUP, AnalysisResult, Frames, across_traces, empty_result
from analysis.analyses.memory_roof import ROOFS
from analysis.analyses.roofline import (
    ROOFLINE_MEASURES,
    above_roof_note,
    classify,
    gpu_run_metrics,
    layer_metrics,
)
from analysis.relations.kernel_rows import kernel_rows
from sidecar.profiling.stats import decide_batch, trimmed_mean_rse
from sidecar.trace import schema

A1_TITLE = "Model throughput and latency per batch size"
A15_TITLE = "Model aggregate and compute/memory-bound verdict"
_GPU_RUNS = "a15_gpu_runs"  # the traces with GPU kernel counters, beside `kernels`


def _with_cache_roofs(fr: Frames, agg: pd.DataFrame) -> pd.Series:
    """Per row of `agg`: whether its traces recorded cache roofs (`peak_cache_bytes_per_s`)."""
    tr = fr.data.traces
    has = [isinstance(a, dict) and isinstance(a.get(ROOFS), dict) for a in tr["attributes"]]
    groups = {tuple(g) for g in tr.loc[has, GROUP].itertuples(index=False)}
    return pd.Series(
        [tuple(g) in groups for g in agg[GROUP].itertuples(index=False)], index=agg.index
    )


def _relative_errors(fr: Frames, agg: pd.DataFrame) -> dict[tuple[str, int], float | None]:
    """Per model and batch: the relative standard error of A1's latency, from the spread of
    the per-trace latencies (3 or more traces) or else of the M run's iterations."""
    ml = fr.model_latency.dropna(subset=["batch_size", "latency_ns"])
    samples = fr.model_samples()
    out: dict[tuple[str, int], float | None] = {}
    for (model, batch), grp in ml.groupby(GROUP, sort=False, observed=True):
        values = list(grp["latency_ns"])
        if len(values) < 3:
            values = [v for k in grp["tkey"] for v in samples.get(int(k), [])]
        out[(str(model), int(batch))] = trimmed_mean_rse(values)
    return out


def model_throughput(fr: Frames) -> AnalysisResult:
    """A1: trimmed-mean model latency and throughput (inputs/s) per model and batch size,
    and the optimal batch size by XSP's rule (`sidecar.profiling.stats.decide_batch`)."""
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
    agg["doubling_gain"] = float("nan")
    rse = _relative_errors(fr, agg)
    notes: list[str] = []
    optimal: dict[str, int | None] = {}
    decisions: dict[str, dict[str, object]] = {}
    for model, grp in agg.dropna(subset=["batch_size"]).groupby("model", sort=True, observed=True):
        lat = {int(b): float(v) for b, v in zip(grp["batch_size"], grp["latency_ns"], strict=True)}
        decision = decide_batch(lat, {b: rse.get((str(model), b)) for b in lat})
        decisions[str(model)] = decision.to_dict()
        optimal[str(model)] = decision.optimal if decision.status == "decided" else None
        for d in decision.doublings:
            agg.loc[(agg["model"] == model) & (agg["batch_size"] == d.small), "doubling_gain"] = (
                d.gain
            )
        if decision.status == "decided":
            best = (agg["model"] == model) & (agg["batch_size"] == decision.optimal)
            agg.loc[best, "optimal"] = True
            notes.append(f"{model}: optimal batch size {decision.optimal}: {decision.reason}")
        else:
            word = "not yet known" if decision.status == "not_yet_known" else "uncertain"
            notes.append(f"{model}: optimal batch size {word}: {decision.reason}")
    if agg["batch_size"].isna().any():
        notes.append("traces without a batch size have no throughput")
    cols = [*GROUP, "latency_ms", "throughput_per_s", "doubling_gain", "optimal", "n_traces"]
    table = agg[cols].reset_index(drop=True)
    per_step = _step_rows(fr)
    if not per_step.empty:  # an ensemble's replayed steps, each as its own row
        table = pd.concat([table.assign(step=""), per_step], ignore_index=True)
        table = table.sort_values(["model", "step"], kind="stable").reset_index(drop=True)
        table = table[["model", "step", *cols[1:]]]
        notes.append(
            "ensembles: a row per replayed step (column step, the step's model): its replay's "
            "model-level latency at the ensemble request's batch size"
        )
    res = AnalysisResult("A1", A1_TITLE, table, notes=notes)
    res.extra["optimal_batch"] = optimal
    res.extra["batch_decision"] = decisions
    return res


def _step_rows(fr: Frames) -> pd.DataFrame:
    """A1's rows of an ensemble's replayed steps: per ensemble, step and batch size."""
    rep = ensemble_steps.replayed_steps(fr)
    if rep.empty:
        return rep
    rep = fr.with_meta(rep.rename(columns={"replay": "latency_ns"}), ["batch_size"])
    rep = rep.assign(model=rep["ensemble"])
    agg = across_traces(rep, [*GROUP, "step"], ["latency_ns"])
    agg["latency_ms"] = agg["latency_ns"] / 1e6
    agg["throughput_per_s"] = agg["batch_size"].astype("float64") / (agg["latency_ns"] / 1e9)
    return agg.assign(doubling_gain=float("nan"), optimal=False).drop(columns="latency_ns")


def model_aggregate(fr: Frames) -> AnalysisResult:
    """A15: total FLOPs and DRAM bytes of one model run, its intensity, throughput and
    whether it is compute- or memory-bound, per model and batch size."""
    if fr.data.empty:
        return empty_result("A15", A15_TITLE)
    metrics, source = layer_metrics(fr)
    per_gpu_run = gpu_run_metrics(fr)
    # per trace without GPU counters: its layers' FLOPs and bytes summed (as pandas' groupby
    # sums: compensated, 0 over no recorded value)
    kr = kernel_rows(fr)
    kr.register(_GPU_RUNS, per_gpu_run[["tkey"]])
    per_trace = kr.query(
        "SELECT tkey, COALESCE(FSUM(flops), 0.0) AS flops, "
        "COALESCE(FSUM(dram_bytes), 0.0) AS dram_bytes, BOOL_OR(estimated) AS estimated "
        f"FROM {metrics} WHERE tkey NOT IN (SELECT tkey FROM {_GPU_RUNS}) "
        "GROUP BY tkey ORDER BY tkey"
    )
    if not per_gpu_run.empty:
        source = "kernel counters (every kernel of the run)" + (
            f" and {source}" if not per_trace.empty else ""
        )
    if per_trace.empty and per_gpu_run.empty:
        return AnalysisResult(
            "A15",
            A15_TITLE,
            status="not_captured",
            reason="no FLOPs/bytes recorded: kernel counters were not captured and layer spans "
            "carry no flops/dram_*_bytes estimates",
        )
    per_trace = pd.concat(  # GPU runs with counters: all their kernels, layered or not
        [per_gpu_run, per_trace], ignore_index=True
    )
    df = fr.model_latency.merge(per_trace, on="tkey", how="inner")
    df["estimated"] = df["estimated"].astype(float)
    agg = across_traces(df, GROUP, ["latency_ns", "flops", "dram_bytes", "estimated"])
    agg = agg.merge(fr.peaks(), on=GROUP, how="left")
    agg = classify(agg, "flops", "dram_bytes", "latency_ns")
    agg["estimated"] = agg["estimated"] > 0
    agg["latency_ms"] = agg["latency_ns"] / 1e6
    # Never a utilization above 1 as a fact: there the recorded peak is too low.
    agg["utilization"] = (agg["arithmetic_throughput_gflops"] / agg["attainable_gflops"]).where(
        ~agg["above_roof"]
    )
    agg["verdict"] = [
        f"{b}-bound" + (" (estimated)" if e else "") if b != "unknown" else "unknown (no peaks)"
        for b, e in zip(agg["bound"], agg["estimated"], strict=True)
    ]
    cols = [
        *GROUP,
        *ROOFLINE_MEASURES,
        "utilization",
        "bound",
        "verdict",
        "above_roof",
        "estimated",
        schema.PEAK_SOURCE,
        "n_traces",
    ]
    table = agg[cols].reset_index(drop=True)
    res = AnalysisResult("A15", A15_TITLE, table, estimated=bool(table["estimated"].any()))
    res.notes = [f"FLOPs and bytes summed from {source}"]
    if res.estimated:
        res.notes.append("estimated: FLOPs/bytes are estimates from layer shapes, not counters")
    cached = _with_cache_roofs(fr, agg)
    memory_side = cached & (agg["bound"] == "memory")
    res.notes += above_roof_note(agg[~memory_side], "model runs")
    if (agg["above_roof"] & memory_side).any():
        res.notes.append(
            f"{int((agg['above_roof'] & memory_side).sum())} model runs ran above the DRAM "
            "roof on its memory side: their layers' working sets sit in the caches (A14's "
            "memory_roof), which the DRAM roof does not bound; the peak is not what is wrong"
        )
    if not math.isfinite(float(agg["ridge_point"].max(skipna=True) or math.nan)):
        res.notes.append("no roofline peaks recorded with these traces")
    return res
