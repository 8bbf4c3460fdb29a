"""Which memory level's bandwidth bounds a layer: the smallest one that holds its working set.

A layer whose tensors fit in a cache reads them at that cache's bandwidth, so against the DRAM
roof alone it runs "above the roof" by design. A layer's working set is what it touches: its
inputs, weights and outputs, the bytes `sidecar.profiling.flops` estimates from its shapes
(the layer span's `dram_read_bytes` + `dram_write_bytes` where `bytes_estimated`; measured
DRAM counters are traffic, not a footprint, and pick no cache). Traces record their machine's
cache sizes and roofs (`cache_sizes_bytes`, `peak_cache_bytes_per_s`, measured by
`sidecar.profiling.cache_roofs`); a trace without them (recorded before they existed, or on a
GPU) is judged against DRAM alone, as it always was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from analysis.analyses.common import GROUP, Frames
from sidecar.trace import schema

DRAM = "DRAM"
SIZES = schema.CACHE_SIZES_BYTES
ROOFS = schema.PEAK_CACHE_BYTES_PER_S
SOURCE = schema.PEAK_CACHE_SOURCE


def _number(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out if math.isfinite(out) and out > 0 else math.nan


def cache_levels(sizes: Mapping[str, Any], bandwidth: Mapping[str, Any]) -> list[str]:
    """The cache levels with both a size and a roof, smallest first."""
    known = [
        k for k in sizes if k != DRAM and _number(sizes[k]) > 0 and _number(bandwidth.get(k)) > 0
    ]
    return sorted(known, key=lambda k: _number(sizes[k]))


def memory_roof(
    working_set: float,
    sizes: Mapping[str, Any] | None,
    bandwidth: Mapping[str, Any] | None,
    dram_bytes_per_s: float,
) -> tuple[str, float]:
    """The memory level bounding a layer and its bandwidth in bytes/s.

    Args:
        working_set: the layer's inputs + weights + outputs in bytes (NaN where unknown).
        sizes: cache level -> size in bytes (`L1`, `L2`, `L3`), or None.
        bandwidth: level -> measured bytes/s (the cache levels, and `DRAM`), or None.
        dram_bytes_per_s: the trace's DRAM roof (`peak_dram_bytes_per_s`).

    Returns the smallest cache level whose size holds `working_set`, else `DRAM` (also where
    the working set or the caches are unknown). A level's roof is never below a larger
    level's, nor below the DRAM roof: a slow measurement of L3 cannot put a layer that fits
    in it below a layer that does not.
    """
    ws = float(working_set) if working_set is not None else math.nan
    if not sizes or not bandwidth or not ws >= 0:  # NaN: unknown
        return DRAM, dram_bytes_per_s
    levels = cache_levels(sizes, bandwidth)
    below = [_number(bandwidth[k]) for k in levels] + [_number(bandwidth.get(DRAM))]
    for i, level in enumerate(levels):
        if ws <= _number(sizes[level]):
            return level, float(np.nanmax([*below[i:], _number(dram_bytes_per_s)]))
    return DRAM, dram_bytes_per_s


# SQL over the relation `layers` (`analysis.relations.kernel_rows`): per layer call, inputs +
# weights + outputs in bytes, from the estimated bytes of its shapes (NULL where the bytes were
# measured or not recorded)
WORKING_SET = (
    "CASE WHEN COALESCE(bytes_estimated, FALSE) "
    "THEN CAST(dram_read_bytes AS DOUBLE) + CAST(dram_write_bytes AS DOUBLE) END"
)


def cache_roofs(fr: Frames) -> pd.DataFrame:
    """Per model/batch: the cache sizes, roofs and their source recorded with its traces (the
    first trace that has them); groups without any are left out."""
    traces = fr.data.traces
    rows = []
    for tkey, attrs in zip(traces["tkey"], traces["attributes"], strict=True):
        if not isinstance(attrs, dict):
            continue
        sizes, roofs = attrs.get(SIZES), attrs.get(ROOFS)
        if isinstance(sizes, dict) and isinstance(roofs, dict) and cache_levels(sizes, roofs):
            source = str(attrs.get(SOURCE) or "source not recorded")
            rows.append({"tkey": tkey, SIZES: sizes, ROOFS: roofs, SOURCE: source})
    columns = [*GROUP, SIZES, ROOFS, SOURCE]
    if not rows:
        return pd.DataFrame(columns=columns)
    df = fr.with_meta(pd.DataFrame(rows))
    return df.drop_duplicates(GROUP)[columns].reset_index(drop=True)


def with_memory_roofs(agg: pd.DataFrame, roofs: pd.DataFrame) -> pd.DataFrame:
    """`agg` (rows with GROUP, working_set_bytes, peak_dram_bytes_per_s) with `memory_roof`
    (the level; None where the traces recorded no cache roofs), `memory_roof_bytes_per_s`
    and `peak_cache_source`."""
    df = agg.merge(roofs, on=GROUP, how="left")
    picked = [
        memory_roof(ws, s, b, dram) if isinstance(s, dict) else (None, math.nan)
        for ws, s, b, dram in zip(
            df["working_set_bytes"],
            df[SIZES],
            df[ROOFS],
            df[schema.PEAK_DRAM_BYTES_PER_S],
            strict=True,
        )
    ]
    return df.assign(
        memory_roof=[p[0] for p in picked], memory_roof_bytes_per_s=[p[1] for p in picked]
    ).drop(columns=[SIZES, ROOFS])
