"""Model-level time breakdown on the kernel run's timeline (HTA-style temporal breakdown).

Within the model span of a trace's representative iteration, the device is either running a
compute kernel (`kernel_ms`), running only memory operations (memcpy/memset: `non_kernel_ms`)
or idle (`idle_ms`). Overlapping activities (several streams) are counted once (interval
union).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.common import (
    DEVICE_KINDS,
    GROUP,
    AnalysisResult,
    Frames,
    across_traces,
    empty_result,
    not_captured,
    sort_rows,
)

TITLE = "Model time breakdown (kernel busy / non-kernel / idle)"


def union_ns(df: pd.DataFrame) -> pd.Series:
    """Per tkey: total length of the union of [start_ns, end_ns) intervals."""
    if df.empty:
        return pd.Series(dtype="float64")
    d = sort_rows(df[["tkey", "start_ns", "end_ns"]], ["tkey", "start_ns"])
    # int64 throughout: epoch nanoseconds do not fit a float64 exactly
    lowest = np.iinfo(np.int64).min
    cummax = d.groupby("tkey", observed=True)["end_ns"].cummax().astype("int64")
    prev = cummax.groupby(d["tkey"], observed=True).shift(1, fill_value=lowest).to_numpy("int64")
    start = np.maximum(d["start_ns"].to_numpy("int64"), prev)
    contrib = np.clip(d["end_ns"].to_numpy("int64") - start, 0, None)
    return pd.Series(contrib, index=d.index).groupby(d["tkey"], observed=True).sum()


def time_breakdown(fr: Frames) -> AnalysisResult:
    if fr.data.empty:
        return empty_result("time_breakdown", TITLE)
    dev = fr.at("kernel")[["tkey", "kind", "start_ns", "end_ns"]]  # (rows filtered are copied)
    dev = dev[dev["kind"].isin(DEVICE_KINDS)]
    if dev.empty:
        return not_captured("time_breakdown", TITLE, fr.kernel_reason())
    models = fr.at("model")
    models = models[models["tkey"].isin(set(dev["tkey"]))]
    # The window is the model span of the run the kernels came from (the K run if recorded).
    models = models.assign(_pref=(models["run_level"] != "kernel").astype(int))
    win = models.sort_values(["tkey", "_pref", "start_ns"]).drop_duplicates("tkey")
    win = win.set_index("tkey")[["start_ns", "end_ns"]]
    if win.empty:
        return not_captured("time_breakdown", TITLE, "kernel traces hold no model span")
    dev = dev[dev["tkey"].isin(win.index)]
    w_start = dev["tkey"].map(win["start_ns"])
    w_end = dev["tkey"].map(win["end_ns"])
    clipped = dev.assign(
        start_ns=np.maximum(dev["start_ns"], w_start), end_ns=np.minimum(dev["end_ns"], w_end)
    )
    clipped = clipped[clipped["end_ns"] > clipped["start_ns"]]
    busy_all = union_ns(clipped)
    busy_kernel = union_ns(clipped[clipped["kind"] == "kernel"])
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
