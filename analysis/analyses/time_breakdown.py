"""Model-level time breakdown on the kernel run's timeline (HTA-style temporal breakdown).

Within the model span of a trace's representative iteration, the device is either running a
compute kernel (`kernel_ms`), running only memory operations (memcpy/memset: `non_kernel_ms`)
or idle (`idle_ms`). Overlapping activities (several streams) are counted once (interval
union).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.analyses.common import (
    DEVICE_KINDS,
    GROUP,
    AnalysisResult,
    Frames,
    across_traces,
    empty_result,
    kind_in,
    not_captured,
)
from analysis.relations.kernel_rows import KernelRows, kernel_rows
from sidecar.trace.schema import Level

TITLE = "Model time breakdown (kernel busy / non-kernel / idle)"


_WINDOWS = "time_breakdown_windows"  # per trace: its window, beside `kernels`
# SQL over `kernels` and the windows (tkey, start_ns, end_ns, place: one per trace): per
# trace, the length of the union of its device intervals clipped to its window, over all of
# them (`busy_all`) and over compute kernels only (`busy_kernel`). Sorted by start, an
# interval adds what reaches past the latest end before it. The traces' windows are laid end
# to end on one axis (a window from `place` on), so one sweep without partitions covers every
# trace and no interval reaches into the next trace's. BIGINT throughout: epoch nanoseconds
# do not fit a double exactly.
_BUSY = f"""
WITH clipped AS (
    SELECT k.tkey, k.kind = 'kernel' AS is_kernel,
           GREATEST(k.start_ns, w.start_ns) - w.start_ns + w.place AS s,
           LEAST(k.end_ns, w.end_ns) - w.start_ns + w.place AS e
    FROM kernels AS k JOIN {_WINDOWS} AS w ON k.tkey = w.tkey
    WHERE {kind_in(DEVICE_KINDS, "k.kind")}
), swept AS (
    SELECT tkey, is_kernel, s, e,
           MAX(e) OVER before AS end_all,
           MAX(CASE WHEN is_kernel THEN e END) OVER before AS end_kernel
    FROM clipped
    WHERE e > s
    WINDOW before AS (ORDER BY s ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
)
SELECT tkey,
       CAST(SUM(GREATEST(e - GREATEST(s, COALESCE(end_all, s)), 0)) AS BIGINT) AS busy_all,
       CAST(COALESCE(SUM(GREATEST(e - GREATEST(s, COALESCE(end_kernel, s)), 0))
                     FILTER (WHERE is_kernel), 0) AS BIGINT) AS busy_kernel
FROM swept GROUP BY tkey ORDER BY tkey
"""


def busy_ns(kr: KernelRows, win: pd.DataFrame) -> pd.DataFrame:
    """Per trace with device work in its window (`win`: index tkey, columns start_ns and
    end_ns): `busy_all` and `busy_kernel` (int64 ns), the union of its device intervals and of
    its compute kernels', clipped to the window (SQL over `kr`)."""
    start = win["start_ns"].to_numpy("int64")
    end = win["end_ns"].to_numpy("int64")
    span = np.maximum(end - start, 0) + 1  # what a window takes on the axis, and a gap
    place = np.concatenate([[0], np.cumsum(span)[:-1]]).astype("int64")
    windows = pd.DataFrame(
        {"tkey": win.index.to_numpy("int64"), "start_ns": start, "end_ns": end, "place": place}
    )
    kr.register(_WINDOWS, windows)
    return kr.query(_BUSY).set_index("tkey")


def time_breakdown(fr: Frames) -> AnalysisResult:
    if fr.data.empty:
        return empty_result("time_breakdown", TITLE)
    kr = kernel_rows(fr)
    dev_traces = kr.query(f"SELECT DISTINCT tkey FROM kernels WHERE {kind_in(DEVICE_KINDS)}")
    if dev_traces.empty:
        return not_captured("time_breakdown", TITLE, fr.kernel_reason())
    models = fr.at(Level.MODEL)
    models = models[models["tkey"].isin(dev_traces["tkey"])]
    # The window is the model span of the run the kernels came from (the K run if recorded).
    models = models.assign(_pref=(models["run_level"] != Level.KERNEL).astype(int))
    win = models.sort_values(["tkey", "_pref", "start_ns"]).drop_duplicates("tkey")
    win = win.set_index("tkey")[["start_ns", "end_ns"]]
    if win.empty:
        return not_captured("time_breakdown", TITLE, "kernel traces hold no model span")
    busy = busy_ns(kr, win)
    busy_all = busy["busy_all"]
    busy_kernel = busy["busy_kernel"]
    out = pd.DataFrame(index=win.index)
    out["window_ns"] = (win["end_ns"] - win["start_ns"]).astype("float64")
    out["kernel_ns"] = busy_kernel.reindex(out.index).fillna(0.0)
    out["non_kernel_ns"] = busy_all.reindex(out.index).fillna(0.0) - out["kernel_ns"]
    out["idle_ns"] = out["window_ns"] - busy_all.reindex(out.index).fillna(0.0)
    per = fr.with_meta(out.reset_index())
    vals = ["window_ns", "kernel_ns", "non_kernel_ns", "idle_ns"]
    agg = across_traces(per, GROUP, vals)
    for v in vals:
        agg[v.replace("_ns", "_ms")] = agg[v] / 1e6
    for v in ("kernel", "non_kernel", "idle"):
        agg[f"{v}_pct"] = 100.0 * agg[f"{v}_ns"] / agg["window_ns"]
    cols = [
        *GROUP,
        "window_ms",
        "kernel_ms",
        "non_kernel_ms",
        "idle_ms",
        "kernel_pct",
        "non_kernel_pct",
        "idle_pct",
        "n_traces",
    ]
    return AnalysisResult("time_breakdown", TITLE, agg[cols])
