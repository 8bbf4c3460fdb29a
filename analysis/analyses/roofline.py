"""Roofline: arithmetic intensity and throughput against the device's peaks (A9, A14).

Arithmetic intensity = FLOPs / (DRAM bytes read + written); arithmetic throughput = FLOPs /
latency. Something is memory-bound when its intensity is left of the ridge point
(peak FLOP/s / peak DRAM bytes/s). Peaks come from the trace attributes `peak_flops_per_s`
and `peak_dram_bytes_per_s` (a GPU spec sheet, or the CPU microbenchmark on CPU).

A14 judges each layer against the roof of the memory level that holds its working set where
its traces recorded cache roofs (`analysis.analyses.memory_roof`): a cache-resident layer above the
DRAM roof is within its own. "Re-measure the peak" is said only of a layer that beat the
compute roof with a working set larger than the last-level cache (or, for traces without
cache roofs, of any layer above the roof, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.analyses.common import (
    GROUP,
    AnalysisResult,
    Frames,
    container_note,
    empty_result,
    kind_in,
    not_captured,
)
from analysis.analyses.memory_roof import DRAM, WORKING_SET, cache_roofs, with_memory_roofs
from analysis.relations.kernel_rows import kernel_rows
from analysis.relations.trimmed_sql import across_traces_sql
from sidecar.trace import schema

A9_TITLE = "Kernel roofline"
A14_TITLE = "Layer roofline"


def classify(df: pd.DataFrame, flops: str, nbytes: str, latency_ns: str) -> pd.DataFrame:
    """Add arithmetic_intensity, arithmetic_throughput_gflops, ridge point and bound columns.

    `df` must carry peak_flops_per_s and peak_dram_bytes_per_s (NaN where unknown); a row's
    `memory_roof_bytes_per_s`, where the column is there and the value known, replaces the
    DRAM roof (the cache level holding a layer's working set).
    """
    out = df.copy()
    bandwidth = out[schema.PEAK_DRAM_BYTES_PER_S]
    if "memory_roof_bytes_per_s" in out.columns:
        bandwidth = out["memory_roof_bytes_per_s"].astype("float64").fillna(bandwidth)
    f = out[flops].astype("float64")
    b = out[nbytes].astype("float64")
    lat_s = out[latency_ns].astype("float64") / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        ai = np.where(b > 0, f / b, np.nan)
        thr = np.where(lat_s > 0, f / lat_s, np.nan)
    out["arithmetic_intensity"] = ai
    out["arithmetic_throughput_gflops"] = thr / 1e9
    ridge = out[schema.PEAK_FLOPS_PER_S] / bandwidth
    out["ridge_point"] = ridge
    attainable = np.minimum(out[schema.PEAK_FLOPS_PER_S], out["arithmetic_intensity"] * bandwidth)
    out["attainable_gflops"] = attainable / 1e9
    known = out["arithmetic_intensity"].notna() & ridge.notna()
    below = (out["arithmetic_intensity"] < ridge).astype(object)
    out["memory_bound"] = below.where(known, None)
    out["bound"] = np.where(
        known, np.where(out["arithmetic_intensity"] < ridge, "memory", "compute"), "unknown"
    )
    # Above the roof: the recorded peak is lower than what was achieved (measured under
    # load, or estimated FLOPs too high). Such a point is flagged, never shown as > 100%.
    out["above_roof"] = out["arithmetic_throughput_gflops"] > out["attainable_gflops"] * 1.001
    return out


def above_roof_note(df: pd.DataFrame, what: str) -> list[str]:
    """A note naming the rows whose throughput exceeds the recorded roof."""
    above = df[df["above_roof"]]
    if above.empty:
        return []
    top = above.sort_values("arithmetic_throughput_gflops").iloc[-1]
    return [
        f"{len(above)} {what} ran above the recorded roof (e.g. "
        f"{top['arithmetic_throughput_gflops']:.4g} GFLOP/s against an attainable "
        f"{top['attainable_gflops']:.4g}): the peak ({top.get(schema.PEAK_SOURCE, '?')}) was "
        "measured "
        "too low, so their bound verdicts are doubtful; re-measure it "
        "(`xsp-sidecar profile --refresh-peak`)"
    ]


def peak_doubtful(df: pd.DataFrame) -> pd.Series:
    """Rows above the roof that say the peak was measured too low: a layer that beat the
    compute roof with a working set larger than the last-level cache, or any row above the
    roof where no cache roofs were recorded (no `memory_roof`). A layer above the roof of
    the cache that holds it says nothing about the peak."""
    above = df["above_roof"].fillna(False).astype(bool)
    if "memory_roof" not in df.columns:
        return above
    level = df["memory_roof"]
    return above & (level.isna() | ((level == DRAM) & (df["bound"] == "compute")))


def cache_roof_note(df: pd.DataFrame) -> list[str]:
    """Notes on the layers above the roof their working set picks where that says nothing
    about the peak (see `peak_doubtful`): above their cache's roof, or, beyond the caches
    (or of unknown working set), above the DRAM roof on its memory side."""
    if "memory_roof" not in df.columns:
        return []
    rows = df[df["above_roof"].fillna(False).astype(bool) & ~peak_doubtful(df)]
    notes = []
    cached = rows[rows["memory_roof"] != DRAM]
    if not cached.empty:
        top = cached.sort_values("arithmetic_throughput_gflops").iloc[-1]
        notes.append(
            f"{len(cached)} layers ran above the roof of the cache that holds their working "
            f"set (e.g. {top['name']}, {top['working_set_bytes'] / 2**10:.4g} KiB in "
            f"{top['memory_roof']}: {_beat(top)}): their FLOPs and bytes are estimates from "
            f"shapes and the cache roofs {_sources(cached)}, so these points are approximate; "
            "the peak is not what is wrong, and measuring it again would not move them"
        )
    dram = rows[rows["memory_roof"] == DRAM]
    if not dram.empty:
        top = dram.sort_values("arithmetic_throughput_gflops").iloc[-1]
        notes.append(
            f"{len(dram)} layers with working sets beyond the caches (or unknown) ran above "
            f"the DRAM roof on its memory side (e.g. {top['name']}: {_beat(top)}): their bytes "
            "are estimates from shapes, which count every tensor as read from DRAM although "
            "the layer before may have left it in cache, so their memory-bound verdicts are "
            "approximate"
        )
    return notes


def _beat(row: pd.Series) -> str:
    return (
        f"{row['arithmetic_throughput_gflops']:.4g} GFLOP/s against an attainable "
        f"{row['attainable_gflops']:.4g}"
    )


def _sources(df: pd.DataFrame) -> str:
    return (
        "; ".join(sorted(df[schema.PEAK_CACHE_SOURCE].dropna().astype(str).unique())) or "unknown"
    )


def _cache_roofs_note(agg: pd.DataFrame) -> list[str]:
    """Which memory level each layer was judged against, and where the working set comes
    from; nothing for traces without cache roofs."""
    if "memory_roof" not in agg.columns or agg["memory_roof"].isna().all():
        return []
    counts = agg["memory_roof"].value_counts()
    levels = ", ".join(f"{counts[k]} in {k}" for k in sorted(counts.index))
    return [
        "memory roof by working set (inputs + weights + outputs, the estimated "
        "dram_read_bytes + dram_write_bytes of the layer span): the smallest cache level "
        f"that holds it, else DRAM ({levels}); cache roofs (peak_cache_bytes_per_s): "
        + _sources(agg)
    ]


def _peak_notes(df: pd.DataFrame) -> list[str]:
    notes = []
    if df["ridge_point"].isna().any():
        notes.append(
            "some traces carry no peak_flops_per_s / peak_dram_bytes_per_s, so their bound "
            "is 'unknown'"
        )
    return notes


# What places a row on the roofline, as A9, A14 and A15 show it
ROOFLINE_MEASURES = [
    "latency_ms",
    "flops",
    "dram_bytes",
    "arithmetic_intensity",
    "arithmetic_throughput_gflops",
    "attainable_gflops",
    "ridge_point",
]
ROOFLINE_COLUMNS = [*ROOFLINE_MEASURES, "bound", "above_roof", "estimated", "n_traces"]


def _on_roofline(
    fr: Frames,
    agg: pd.DataFrame,
    id_columns: list[str],
    sort_columns: list[str],
    extra: Sequence[str] = (),
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Place aggregated rows (flops, dram_bytes, duration_ns, estimated share) on their
    machine's roofline; returns the classified rows and the table shown (A9, A14), with the
    `extra` columns after the ridge point."""
    agg = agg.merge(fr.peaks(), on=GROUP, how="left")
    agg = classify(agg, "flops", "dram_bytes", "duration_ns")
    agg["estimated"] = agg["estimated"] > 0
    agg["latency_ms"] = agg["duration_ns"] / 1e6
    if "memory_roof_bytes_per_s" in agg.columns:
        agg["memory_roof_gbps"] = agg["memory_roof_bytes_per_s"] / 1e9
    columns = [*ROOFLINE_MEASURES, *extra, *ROOFLINE_COLUMNS[len(ROOFLINE_MEASURES) :]]
    table = agg[[*GROUP, *id_columns, *columns]]
    return agg, table.sort_values([*GROUP, *sort_columns]).reset_index(drop=True)


_ROOFLINE_WORK = kind_in(("kernel", "cpu_op"))  # SQL: the spans with counters (A9, A14)


def kernel_roofline(fr: Frames) -> AnalysisResult:
    """A9: every kernel with FLOPs or DRAM bytes placed on the roofline."""
    if fr.data.empty:
        return empty_result("A9", A9_TITLE)
    kr = kernel_rows(fr)
    work = _ROOFLINE_WORK
    if not kr.scalar(f"SELECT EXISTS (SELECT 1 FROM kernels WHERE {work})"):
        return not_captured(
            "A9", A9_TITLE, fr.kernel_reason() + " (A14 places layers on the roofline instead)"
        )
    # spans with flops and DRAM bytes (NULL, or NaN, where not recorded)
    keep = f"{work} AND NOT isnan(flops) AND NOT isnan(dram_read_bytes + dram_write_bytes)"
    if not kr.scalar(f"SELECT EXISTS (SELECT 1 FROM kernels WHERE {keep})"):
        return not_captured(
            "A9",
            A9_TITLE,
            "kernel hardware metrics were not captured: no kernel span carries flops and "
            "dram_read_bytes/dram_write_bytes (profile with metric collection enabled)",
        )
    agg = across_traces_sql(
        kr,
        "SELECT *, dram_read_bytes + dram_write_bytes AS dram_bytes, "
        "CAST(metrics_estimated AS DOUBLE) AS estimated FROM kernels",
        [*GROUP, "layer", "idx", "name"],
        ["duration_ns", "flops", "dram_bytes", "estimated"],
        where=keep,
    )
    agg, table = _on_roofline(fr, agg, ["layer", "idx", "name"], ["layer", "idx"])
    res = AnalysisResult("A9", A9_TITLE, table, estimated=bool(table["estimated"].any()))
    res.notes = _peak_notes(agg) + above_roof_note(agg, "kernels")
    res.extra["peaks"] = fr.peaks().to_dict(orient="records")
    return res


# SQL: per group of kernel spans with counters, as pandas' groupby-agg sums them: a sum
# over no recorded value is 0, not NULL; a span's missing DRAM read or write counts 0;
# compensated sums (FSUM), as pandas' are, so the totals do not hang on the rows' order
_COUNTER_SUMS = (
    "COALESCE(FSUM(flops), 0.0) AS flops, "
    "FSUM(COALESCE(dram_read_bytes, 0.0) + COALESCE(dram_write_bytes, 0.0)) AS dram_bytes, "
    "BOOL_OR(metrics_estimated) AS estimated"
)
_HAS_COUNTERS = "(flops IS NOT NULL OR dram_read_bytes IS NOT NULL)"


LAYER_METRICS = "layer_metrics"  # the relation `layer_metrics` gives, beside `kernels`
_NOWHERE = "nowhere"  # `layer_metrics`' source where no layer has FLOPs or bytes
# SQL: the leaf layer calls (not containers) that have FLOPs or bytes in `{metrics}`, with
# them and their working sets
_LEAF_METRICS = f"""
    SELECT l.row, l.tkey, l.model, l.batch_size, l.idx, l.name, l.type, l.duration_ns,
        m.flops, m.dram_bytes, CAST(m.estimated AS DOUBLE) AS estimated,
        {WORKING_SET} AS working_set_bytes
    FROM layers AS l JOIN {{metrics}} AS m
        ON m.tkey = l.tkey AND m.name IS NOT DISTINCT FROM l.name
    WHERE l.container IS NOT TRUE
"""


def layer_metrics(fr: Frames) -> tuple[str, str]:
    """Per trace and layer: flops and DRAM bytes, from kernel counters in traces that have
    them, else from the layer's own (possibly estimated) attributes. Returns the name of a
    table beside the relations of `kernel_rows(fr)` and where the numbers come from
    (`source`); made once per `Frames` (A14 and A15 read it). The table's columns: tkey, name
    (the layer call), flops, dram_bytes (DOUBLE; NULL: not recorded), estimated (BOOLEAN) and
    counters (BOOLEAN: from kernel counters)."""
    return fr.memo("layer_metrics", lambda: _layer_metrics(fr))


def _layer_metrics(fr: Frames) -> tuple[str, str]:
    kr = kernel_rows(fr)
    # a layer's own attributes where its trace has no kernel counters (NaN: not recorded)
    kr.execute(f"""
        CREATE TABLE {LAYER_METRICS} AS
        WITH from_kernels AS MATERIALIZED (
            SELECT tkey, layer AS name, {_COUNTER_SUMS} FROM kernels
            WHERE {_ROOFLINE_WORK} AND layer IS NOT NULL AND {_HAS_COUNTERS}
            GROUP BY tkey, layer
        ), from_layers AS (
            SELECT tkey, name, NULLIF(flops, 'NaN'::DOUBLE) AS flops,
                NULLIF(dram_read_bytes + dram_write_bytes, 'NaN'::DOUBLE) AS dram_bytes,
                COALESCE(flops_estimated, FALSE) OR COALESCE(bytes_estimated, FALSE)
                    AS estimated
            FROM layers
            WHERE NULLIF(flops, 'NaN'::DOUBLE) IS NOT NULL
                AND tkey NOT IN (SELECT tkey FROM from_kernels)
        )
        SELECT *, TRUE AS counters FROM from_kernels
        UNION ALL SELECT tkey, name, flops, dram_bytes, estimated, FALSE FROM from_layers
    """)
    have = set(kr.query(f"SELECT DISTINCT counters FROM {LAYER_METRICS}")["counters"])
    sources = [
        name for name, c in (("kernel counters", True), ("layer attributes", False)) if c in have
    ]
    return LAYER_METRICS, " and ".join(sources) or _NOWHERE


def gpu_run_metrics(fr: Frames) -> pd.DataFrame:
    """Per trace with GPU kernel counters: FLOPs and DRAM bytes summed over every kernel of
    the run, in a layer or not (a TorchScript model on CUDA has no layers at all). Computed
    once per `Frames`: do not modify it."""
    return fr.memo("gpu_run_metrics", lambda: _gpu_run_metrics(fr))


def _gpu_run_metrics(fr: Frames) -> pd.DataFrame:
    return kernel_rows(fr).query(
        f"SELECT tkey, {_COUNTER_SUMS} FROM kernels WHERE kind = 'kernel' AND {_HAS_COUNTERS} "
        "GROUP BY tkey ORDER BY tkey"
    )


def layer_roofline(fr: Frames) -> AnalysisResult:
    """A14: each layer on the roofline (FLOPs and bytes over the layer's latency)."""
    if fr.data.empty:
        return empty_result("A14", A14_TITLE)
    kr = kernel_rows(fr)
    metrics, source = layer_metrics(fr)
    if source == _NOWHERE and not gpu_run_metrics(fr).empty:
        return not_captured(
            "A14",
            A14_TITLE,
            "kernel counters were captured, but no kernel belongs to a layer: the traces have "
            "no layer spans (a TorchScript model on CUDA is profiled at M and K only)",
        )
    if source == _NOWHERE:
        return not_captured(
            "A14",
            A14_TITLE,
            "no FLOPs/bytes recorded: kernel counters were not captured and layer spans carry "
            "no flops/dram_*_bytes estimates",
        )
    values = ["duration_ns", "flops", "dram_bytes", "estimated", "working_set_bytes"]
    agg = across_traces_sql(
        kr, _LEAF_METRICS.format(metrics=metrics), [*GROUP, "name"], values, ["idx", "type"]
    )
    roofs = cache_roofs(fr)
    extra: list[str] = []
    if not roofs.empty:  # traces without cache roofs keep today's table
        dram = fr.peaks()[[*GROUP, schema.PEAK_DRAM_BYTES_PER_S]]
        agg = with_memory_roofs(agg.merge(dram, on=GROUP, how="left"), roofs)
        agg = agg.drop(columns=schema.PEAK_DRAM_BYTES_PER_S)
        extra = ["working_set_bytes", "memory_roof", "memory_roof_gbps"]
    agg, table = _on_roofline(fr, agg, ["idx", "name", "type"], ["idx"], extra)
    res = AnalysisResult("A14", A14_TITLE, table, estimated=bool(table["estimated"].any()))
    res.notes = [
        f"FLOPs and bytes from {source}",
        *_cache_roofs_note(agg),
        *_peak_notes(agg),
        *above_roof_note(agg[peak_doubtful(agg)], "layers"),
        *cache_roof_note(agg),
    ]
    if res.estimated:
        res.notes.append("estimated: FLOPs/bytes are estimates from layer shapes, not counters")
    if n := kr.scalar(
        "SELECT count(*) FROM (SELECT DISTINCT model, name FROM layers WHERE container)"
    ):
        res.notes.append(
            container_note(n, "left out")
            + "; the kernels they launch themselves (e.g. residual adds) are in A11/A12"
        )
    res.extra["peaks"] = fr.peaks().to_dict(orient="records")
    if not roofs.empty:  # the HTML roofline draws them
        res.extra["cache_roofs"] = roofs.drop(columns=schema.PEAK_CACHE_SOURCE).to_dict("records")
    return res
