"""Kernel-level analyses A8 and A10-A13.

Kernel spans (level `kernel`) are GPU kernels, memcpys/memsets, CUDA API calls (`runtime`,
`driver`) or, on a CPU runtime, library ops (`cpu_op`). The tables here list the work itself
(kernel, memcpy, memset, cpu_op), not the API calls that launched it. Each kernel is attached
to the layer it ran under (its parent span, or its launch's parent). Occupancy aggregates are
weighted by kernel latency, as in XSP.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.analyses.common import (
    DEVICE_KINDS,
    GROUP,
    KERNEL_TABLE_KINDS,
    AnalysisResult,
    Frames,
    empty_result,
    kind_in,
    not_captured,
)
from analysis.analyses.layer_level import layer_frame
from analysis.analyses.roofline import classify
from analysis.relations.kernel_rows import kernel_rows
from analysis.relations.trimmed_sql import across_traces_sql
from sidecar.trace import schema

TITLES = {
    "A8": "Kernel table",
    "A10": "Kernels aggregated by name",
    "A11": "Kernels aggregated by layer",
    "A12": "GPU metrics by layer",
    "A13": "GPU vs non-GPU latency per layer",
}
METRICS = ("flops", schema.DRAM_READ_BYTES, schema.DRAM_WRITE_BYTES)


WORK = kind_in(KERNEL_TABLE_KINDS)  # SQL: a span is work
_DEVICE = kind_in(DEVICE_KINDS)  # SQL: work on the device
_LAYERED = f"{_DEVICE} AND layer IS NOT NULL"  # SQL: GPU work in a layer
_A13_TRACES = "a13_traces"  # the traces A13 compares, beside `kernels`
_GPU_PER_CALL = """
    WITH own AS (
        SELECT tkey, layer, SUM(duration_ns) AS ns FROM kernels
        WHERE {layered} AND tkey IN (SELECT tkey FROM {traces}) GROUP BY tkey, layer
    ), paths AS (
        SELECT tkey, ns, string_split(split_part(layer, '#', 1), '.') AS parts FROM own
    ), cut AS (
        SELECT tkey, ns, parts, unnest(range(1, len(parts))) AS k FROM paths
    ), inside AS (
        SELECT tkey, array_to_string(parts[1:k], '.') AS path, SUM(ns) AS ns FROM cut
        GROUP BY ALL
    ), calls AS (
        SELECT l.row, l.tkey, l.model, l.batch_size, l.idx, l.name, l.type, l.container,
            l.duration_ns, CAST(COALESCE(o.ns, 0) + COALESCE(i.ns, 0) AS DOUBLE) AS gpu_ns
        FROM layers AS l
        LEFT JOIN own AS o ON o.tkey = l.tkey AND o.layer = l.name
        LEFT JOIN inside AS i ON i.tkey = l.tkey AND i.path = split_part(l.name, '#', 1)
        WHERE l.tkey IN (SELECT tkey FROM {traces})
    )
    SELECT *, CAST(duration_ns AS DOUBLE) - gpu_ns AS non_gpu_ns FROM calls
"""


def gpu_per_call(traces: str) -> str:
    """SQL: the layer calls (`layers`) of the traces in the relation `traces` (a column
    tkey), each with its GPU time `gpu_ns`: the ns of the device work (`kernels`) run in the
    call itself and in the modules inside it, 0 where none, and `non_gpu_ns`, the rest of its
    `duration_ns`. `layer1.0` holds `layer1.0.conv1` (dotted module paths; a call suffix `#n`
    is not a path part): each layer call's own GPU ns are added to every proper prefix of its
    module path (`layer1`, `layer1.0`), and a call takes those of its own path. The ns are
    summed as whole numbers (exact) and made floats once."""
    return _GPU_PER_CALL.format(layered=_LAYERED, traces=traces)


def _missing(key: str, fr: Frames) -> AnalysisResult | None:
    if fr.data.empty:
        return empty_result(key, TITLES[key])
    if not kernel_rows(fr).scalar(f"SELECT EXISTS (SELECT 1 FROM kernels WHERE {WORK})"):
        return not_captured(key, TITLES[key], fr.kernel_reason())
    return None


def _metrics_missing(key: str, fr: Frames) -> AnalysisResult | None:
    recorded = " OR ".join(f"{c} IS NOT NULL" for c in (*METRICS, schema.ACHIEVED_OCCUPANCY))
    if not kernel_rows(fr).scalar(
        f"SELECT EXISTS (SELECT 1 FROM kernels WHERE {WORK} AND ({recorded}))"
    ):
        return not_captured(
            key,
            TITLES[key],
            "kernel hardware metrics were not captured: no kernel span carries flops, DRAM "
            "bytes or achieved_occupancy (profile with metric collection enabled)",
        )
    return None


def kernel_table(fr: Frames) -> AnalysisResult:
    """A8: every kernel with its layer, latency, counters, intensity and bound."""
    if (miss := _missing("A8", fr)) is not None:
        return miss
    agg = across_traces_sql(
        kernel_rows(fr),
        "SELECT *, CAST(metrics_estimated AS DOUBLE) AS estimated FROM kernels",
        [*GROUP, "layer", "idx", "name", "kind"],
        ["duration_ns", *METRICS, schema.ACHIEVED_OCCUPANCY, "estimated"],
        ["layer_type"],
        where=WORK,
    )
    agg["dram_bytes"] = agg[schema.DRAM_READ_BYTES] + agg[schema.DRAM_WRITE_BYTES]
    agg = agg.merge(fr.peaks(), on=GROUP, how="left")
    agg = classify(agg, "flops", "dram_bytes", "duration_ns")
    agg["latency_ms"] = agg["duration_ns"] / 1e6
    agg["estimated"] = agg["estimated"] > 0
    cols = [
        *GROUP,
        "layer",
        "layer_type",
        "idx",
        "name",
        "kind",
        "latency_ms",
        *METRICS,
        schema.ACHIEVED_OCCUPANCY,
        "arithmetic_intensity",
        "arithmetic_throughput_gflops",
        "memory_bound",
        "estimated",
        "n_traces",
    ]
    table = agg[cols].sort_values([*GROUP, "layer", "idx"], na_position="first")
    res = AnalysisResult("A8", TITLES["A8"], table.reset_index(drop=True))
    res.estimated = bool(table["estimated"].any())
    if table["flops"].isna().all():
        res.notes.append("kernel hardware metrics (flops, DRAM bytes, occupancy) not captured")
    return res


def _per_trace(keys: list[str], where: str = "TRUE") -> str:
    """SQL: per trace and `keys` (missing keys a group of their own) of the work spans
    `where` keeps: count, latency, summed counters (missing where none is recorded),
    latency-weighted occupancy and whether any counter was estimated (0.0/1.0), with the
    trace's group and `row` (for `across_traces_sql`)."""
    by = ", ".join(["tkey", *GROUP, *keys])
    sums = ", ".join(f"SUM({m}) AS {m}" for m in METRICS)
    return f"""
        SELECT {by}, min(row) AS row,
               CAST(SUM(duration_ns) AS DOUBLE) AS duration_ns,
               {sums},
               COUNT(*) AS "count",
               SUM(achieved_occupancy * CAST(duration_ns AS DOUBLE))
                 / NULLIF(CAST(SUM(duration_ns) FILTER (WHERE achieved_occupancy IS NOT NULL)
                               AS DOUBLE), 0) AS achieved_occupancy,
               CAST(MAX(CAST(metrics_estimated AS INTEGER)) AS DOUBLE) AS estimated
        FROM kernels
        WHERE {WORK} AND ({where})
        GROUP BY {by}
        """


def kernels_by_name(fr: Frames) -> AnalysisResult:
    """A10: kernels grouped by name: calls, total latency, counters, weighted occupancy."""
    if (miss := _missing("A10", fr)) is not None:
        return miss
    agg = across_traces_sql(
        kernel_rows(fr),
        _per_trace(["name", "kind"]),
        [*GROUP, "name", "kind"],
        ["count", "duration_ns", *METRICS, schema.ACHIEVED_OCCUPANCY],
    )
    agg["latency_ms"] = agg["duration_ns"] / 1e6
    agg["mean_latency_ms"] = agg["latency_ms"] / agg["count"]
    agg["share"] = agg["duration_ns"] / agg.groupby(GROUP, dropna=False, observed=True)[
        "duration_ns"
    ].transform("sum")
    cols = [
        *GROUP,
        "name",
        "kind",
        "count",
        "latency_ms",
        "mean_latency_ms",
        "share",
        *METRICS,
        schema.ACHIEVED_OCCUPANCY,
        "n_traces",
    ]
    table = agg[cols].sort_values([*GROUP, "latency_ms"], ascending=[True, True, False])
    return AnalysisResult("A10", TITLES["A10"], table.reset_index(drop=True))


def _by_layer(fr: Frames) -> pd.DataFrame:
    def build() -> pd.DataFrame:
        agg = across_traces_sql(
            kernel_rows(fr),
            _per_trace(["layer"], "layer IS NOT NULL"),
            [*GROUP, "layer"],
            ["count", "duration_ns", *METRICS, schema.ACHIEVED_OCCUPANCY, "estimated"],
        )
        order = layer_frame(fr)[[*GROUP, "name", "idx", "type"]].rename(columns={"name": "layer"})
        order = order.drop_duplicates([*GROUP, "layer"])  # a name in two ensemble steps: once
        agg = agg.merge(order, on=[*GROUP, "layer"], how="left")
        agg["latency_ms"] = agg["duration_ns"] / 1e6
        return agg.sort_values([*GROUP, "idx"]).reset_index(drop=True)

    return fr.memo("kernels_by_layer", build).copy()


def kernels_by_layer(fr: Frames) -> AnalysisResult:
    """A11: per layer: how many kernels ran and their summed latency and counters."""
    if (miss := _missing("A11", fr)) is not None:
        return miss
    agg = _by_layer(fr)
    cols = [
        *GROUP,
        "idx",
        "layer",
        "type",
        "count",
        "latency_ms",
        *METRICS,
        schema.ACHIEVED_OCCUPANCY,
        "n_traces",
    ]
    res = AnalysisResult("A11", TITLES["A11"], agg[cols])
    n_orphans = int(
        kernel_rows(fr).scalar(f"SELECT COUNT(*) FROM kernels WHERE {WORK} AND layer IS NULL")
    )
    if n_orphans:
        res.notes.append(f"{n_orphans} kernel spans ran outside any layer and are not listed")
    return res


def gpu_metrics_by_layer(fr: Frames) -> AnalysisResult:
    """A12: per layer: FLOPs, DRAM reads/writes, occupancy, intensity and throughput."""
    if (miss := _missing("A12", fr)) is not None:
        return miss
    if (miss := _metrics_missing("A12", fr)) is not None:
        return miss
    agg = _by_layer(fr)
    agg["dram_bytes"] = agg[schema.DRAM_READ_BYTES] + agg[schema.DRAM_WRITE_BYTES]
    agg = agg.merge(fr.peaks(), on=GROUP, how="left")
    agg = classify(agg, "flops", "dram_bytes", "duration_ns")
    cols = [
        *GROUP,
        "idx",
        "layer",
        "type",
        *METRICS,
        schema.ACHIEVED_OCCUPANCY,
        "arithmetic_intensity",
        "arithmetic_throughput_gflops",
        "bound",
        "estimated",
    ]
    estimated = bool((agg["estimated"] > 0).any())
    return AnalysisResult("A12", TITLES["A12"], agg[cols], estimated=estimated)


def _layer_time_base(fr: Frames) -> pd.Series:
    """Per trace (tkey): what its layer durations measure: `gpu_events` (CUDA events in the
    hooks: the layer's interval on the GPU timeline), `host` (hook intervals on the host
    clock: launch time) or `unknown` (traces written before this attribute existed)."""
    tr = fr.data.traces
    base = [
        (a or {}).get(schema.LAYER_TIME_BASE, "unknown") if isinstance(a, dict) else "unknown"
        for a in tr["attributes"]
    ]
    return pd.Series(base, index=tr["tkey"].to_numpy())


def gpu_vs_non_gpu(fr: Frames) -> AnalysisResult:
    """A13: layer latency split into GPU work (kernel/memcpy/memset latency of the layer and
    the modules inside it) and the rest (framework, launch and CPU time).

    Both sides must be GPU-timeline times: the layer latency comes from CUDA events in the
    layer run (`layer_time_base` = `gpu_events`). A host hook interval measures launch time,
    not the layer's GPU interval, so traces whose layers were timed on the host are left out
    with a note instead of printing negative non-GPU times."""
    if (miss := _missing("A13", fr)) is not None:
        return miss
    kr = kernel_rows(fr)
    gpu_traces = set(kr.query(f"SELECT DISTINCT tkey FROM kernels WHERE {_LAYERED}")["tkey"])
    if not gpu_traces and kr.scalar(f"SELECT EXISTS (SELECT 1 FROM kernels WHERE {_DEVICE})"):
        return not_captured(
            "A13",
            TITLES["A13"],
            "GPU work was recorded, but no kernel belongs to a layer: the traces have no layer "
            "spans (a TorchScript model on CUDA is profiled at M and K only)",
        )
    if not gpu_traces:
        return not_captured(
            "A13",
            TITLES["A13"],
            "no GPU work recorded: the kernel level holds CPU ops only, so layer time cannot "
            "be split into GPU and non-GPU time",
        )
    base = _layer_time_base(fr)
    comparable = {t for t in gpu_traces if base.get(t) == "gpu_events"}
    skipped = fr.meta[fr.meta["tkey"].isin(gpu_traces - comparable)]
    if not comparable:
        if any(base.get(t) == "host" for t in gpu_traces):
            reason = (
                "layer times of these GPU traces are host hook intervals (launch time), not "
                "intervals on the GPU timeline, so they cannot be compared with kernel times; "
                "profile the layer level with CUDA events (PyTorch on CUDA does)"
            )
        else:
            reason = (
                "these GPU traces have no layer run timed on the GPU timeline (the layer level "
                "was not run, a CUDA-graph replay, or a trace written before `layer_time_base` "
                "was recorded), so there is no layer time to compare with kernel times"
            )
        return not_captured("A13", TITLES["A13"], reason)
    # GPU time per layer call: its own kernels/memcpys/memsets and those of the modules in it
    kr.register(_A13_TRACES, pd.DataFrame({"tkey": sorted(comparable)}, dtype="int64"))
    agg = across_traces_sql(
        kr,
        gpu_per_call(_A13_TRACES),
        [*GROUP, "name"],
        ["duration_ns", "gpu_ns", "non_gpu_ns"],
        ["idx", "type", "container"],
    )
    agg["layer_latency_ms"] = agg["duration_ns"] / 1e6
    agg["gpu_latency_ms"] = agg["gpu_ns"] / 1e6
    agg["non_gpu_latency_ms"] = agg["non_gpu_ns"] / 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["gpu_share"] = agg["gpu_ns"] / agg["duration_ns"]
    cols = [
        *GROUP,
        "idx",
        "name",
        "type",
        "container",
        "layer_latency_ms",
        "gpu_latency_ms",
        "non_gpu_latency_ms",
        "gpu_share",
        "n_traces",
    ]
    table = agg[cols].sort_values([*GROUP, "idx"]).reset_index(drop=True)
    res = AnalysisResult("A13", TITLES["A13"], table)
    res.notes.append(
        "layer latency: CUDA-event interval of each call (layer run); GPU latency: its "
        "kernels and those of the modules inside it (kernel run); a container row "
        "(a call enclosing others) covers its children and is not to be added to them"
    )
    if not skipped.empty:
        models = ", ".join(sorted(skipped["model"].astype(str).unique()))
        res.notes.append(
            f"{len(skipped)} GPU traces left out (models: {models}): their layer times are "
            "host hook intervals, which cannot be compared with kernel times"
        )
    if (table["non_gpu_latency_ms"] < 0).any():
        res.notes.append(
            "negative non-GPU latency: kernels of these layers took longer in the kernel run "
            "than the layer's CUDA-event interval in the layer run (run-to-run variation)"
        )
    return res
