"""Shared pieces of the analyses: results, trimmed means across traces, derived span frames.

Statistics follow XSP: a value reported for a model/batch size is the trimmed mean of that
value over the traces of the same model and batch size, cutting `TRIM` (20%) of the values
from each end (`floor(0.2 * n)` values from the bottom and as many from the top).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from analysis.tracedb import TraceData

TRIM = 0.2
GROUP = ["model", "batch_size"]
DEVICE_KINDS = ("kernel", "memcpy", "memset")  # work that runs on the accelerator
KERNEL_TABLE_KINDS = (*DEVICE_KINDS, "cpu_op")  # rows of the kernel table (A8)


class NotCapturedError(LookupError):
    """The level or metric an analysis needs was not captured in the selected traces."""


@dataclass
class AnalysisResult:
    """One analysis: its table, or why there is none.

    `status` is `ok`, `not_captured` (a level/metric was not recorded; `reason` says why),
    `empty` (no trace matched) or `not_applicable` (e.g. a comparison without two sets).
    `estimated` is true when some numbers come from estimated FLOPs/bytes, not counters.
    """

    key: str
    title: str
    table: pd.DataFrame = field(default_factory=pd.DataFrame)
    status: str = "ok"
    reason: str = ""
    estimated: bool = False
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # secondary tables

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def require(self) -> pd.DataFrame:
        """The table, or NotCapturedError saying why there is none."""
        if not self.ok:
            raise NotCapturedError(f"{self.key} {self.title}: {self.reason}")
        return self.table

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "title": self.title,
            "status": self.status,
            "estimated": self.estimated,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.notes:
            out["notes"] = list(self.notes)
        if self.extra:
            out.update(_jsonable(self.extra))
        out["rows"] = records(self.table)
        for name, table in self.tables.items():
            out[name] = records(table)
        return out


def not_captured(key: str, title: str, reason: str) -> AnalysisResult:
    return AnalysisResult(key, title, status="not_captured", reason=reason)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame rows as JSON-safe dicts (NaN -> None, numpy scalars -> Python)."""
    return [
        {str(k): _jsonable(v) for k, v in row.items()} for row in df.to_dict(orient="records")
    ]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def trimmed_mean(values: Iterable[float], proportion: float = TRIM) -> float:
    """Mean after dropping floor(proportion * n) values from each end; NaNs are ignored."""
    arr = np.sort(np.asarray([v for v in values if v is not None], dtype="float64"))
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return math.nan
    k = int(math.floor(proportion * arr.size))
    return float(arr[k : arr.size - k].mean())


def across_traces(
    df: pd.DataFrame,
    keys: Sequence[str],
    values: Sequence[str],
    first: Sequence[str] = (),
    proportion: float = TRIM,
) -> pd.DataFrame:
    """Trimmed mean of each column in `values` over the traces in each `keys` group.

    `df` has one row per trace (`tkey`) and key. Columns in `first` are carried from the
    first row of each group. Adds `n_traces`. Vectorised: one sort per value column.
    """
    keys = list(keys)
    if df.empty:
        return pd.DataFrame(columns=[*keys, *first, *values, "n_traces"])
    base = df[[*keys, "tkey", *first]].copy()
    gid = base.groupby(keys, dropna=False, sort=True).ngroup()
    out = base.assign(_g=gid.to_numpy()).groupby("_g", sort=True).first()
    out["n_traces"] = base.assign(_g=gid.to_numpy()).groupby("_g")["tkey"].nunique()
    for col in values:
        v = pd.DataFrame({"_g": gid.to_numpy(), "v": pd.to_numeric(df[col]).to_numpy("float64")})
        v = v[~np.isnan(v["v"].to_numpy())].sort_values(["_g", "v"], kind="stable")
        n = v.groupby("_g")["v"].transform("size").to_numpy()
        rank = v.groupby("_g").cumcount().to_numpy()
        k = np.floor(proportion * n)
        kept = v[(rank >= k) & (rank < n - k)]
        out[col] = kept.groupby("_g")["v"].mean()
    return out.drop(columns=["tkey"]).reset_index(drop=True)


def weighted(values: pd.Series, weights: pd.Series) -> float:
    """Weighted mean ignoring rows where the value is NaN."""
    mask = values.notna() & weights.notna()
    w = weights[mask].sum()
    return float((values[mask] * weights[mask]).sum() / w) if w > 0 else math.nan


def ns_to_ms(col: pd.Series) -> pd.Series:
    return col.astype("float64") / 1e6


class Frames:
    """Derived frames shared by the analyses, computed once per TraceData."""

    def __init__(self, data: TraceData) -> None:
        self.data = data
        self._memo: dict[str, pd.DataFrame] = {}

    def memo(self, key: str, build: Callable[[], pd.DataFrame]) -> pd.DataFrame:
        """`build()` once per key; callers must not modify the returned frame."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @cached_property
    def meta(self) -> pd.DataFrame:
        """Per trace: tkey, model, batch_size and what the analyses group by."""
        cols = ["tkey", "source_db", "trace_id", "model", "model_version", "batch_size",
                "device", "runtime", "kernel_level", "peak_flops_per_s",
                "peak_dram_bytes_per_s", "peak_source", "created_ns"]  # fmt: skip
        return self.data.traces[cols]

    def with_meta(self, df: pd.DataFrame, cols: Sequence[str] = GROUP) -> pd.DataFrame:
        return df.merge(self.meta[["tkey", *cols]], on="tkey", how="left")

    @cached_property
    def model_latency(self) -> pd.DataFrame:
        """Per trace model latency (ns): the M run's trimmed mean, else the model span."""
        ls = self.data.level_stats
        from_stats = ls[ls["level"] == "model"][["tkey", "trimmed_mean_ns"]]
        from_stats = from_stats.rename(columns={"trimmed_mean_ns": "latency_ns"})
        sp = self.data.spans
        ms = sp[sp["level"] == "model"]
        ms = ms.assign(_pref=(ms["run_level"] != "model").astype(int)).sort_values(
            ["tkey", "_pref", "start_ns"]
        )
        from_spans = ms.drop_duplicates("tkey")[["tkey", "duration_ns"]]
        from_spans = from_spans.rename(columns={"duration_ns": "latency_ns"})
        missing = from_spans[~from_spans["tkey"].isin(from_stats["tkey"])]
        out = pd.concat([from_stats, missing], ignore_index=True)
        out["latency_ns"] = out["latency_ns"].astype("float64")
        return self.with_meta(out)

    @cached_property
    def layers(self) -> pd.DataFrame:
        """Layer spans, one per (trace, layer name), from the L run where there is one."""
        sp = self.data.spans
        ly = sp[sp["level"] == "layer"]
        has_l = set(ly.loc[ly["run_level"] == "layer", "tkey"].unique())
        ly = ly[(ly["run_level"] == "layer") | ~ly["tkey"].isin(has_l)]
        ly = ly.sort_values(["tkey", "idx", "start_ns"]).drop_duplicates(["tkey", "name"])
        ly = ly.assign(type=ly["op_type"].fillna(ly["kind"]).astype(str))
        return self.with_meta(ly.reset_index(drop=True))

    @cached_property
    def kernels(self) -> pd.DataFrame:
        """Kernel-level spans with the name and type of the layer they ran under."""
        sp = self.data.spans
        kn = sp[sp["level"] == "kernel"]
        if kn.empty:
            return self.with_meta(kn.assign(layer=pd.Series(dtype=str), layer_type=""))
        parents = sp[["tkey", "span_id", "level", "name", "kind", "op_type", "parent_id"]]
        parents = parents.rename(
            columns={"span_id": "parent_id", "level": "_plevel", "name": "_pname",
                     "kind": "_pkind", "op_type": "_pop", "parent_id": "_gparent"}
        )  # fmt: skip
        kn = kn.merge(parents, on=["tkey", "parent_id"], how="left")
        # A kernel launched from a runtime API span: its layer is one step further up.
        up = kn["_plevel"] == "kernel"
        if up.any():
            gp = parents.rename(columns={"parent_id": "_gparent", "_gparent": "_ggparent"})
            hop = kn.loc[up, ["tkey", "_gparent"]].merge(gp, on=["tkey", "_gparent"], how="left")
            for col in ("_plevel", "_pname", "_pkind", "_pop"):
                kn.loc[up, col] = hop[col].to_numpy()
        is_layer = kn["_plevel"] == "layer"
        kn["layer"] = kn["_pname"].where(is_layer)
        kn["layer_type"] = kn["_pop"].fillna(kn["_pkind"]).where(is_layer)
        kn = kn.drop(columns=["_plevel", "_pname", "_pkind", "_pop", "_gparent"])
        return self.with_meta(kn.reset_index(drop=True))

    def kernel_reason(self) -> str:
        """Why the kernel level is missing from the selected traces."""
        reasons = [
            str(r) for r in self.meta["kernel_level"].dropna().unique() if str(r) != "captured"
        ]
        if reasons:
            return "kernel level not captured: " + "; ".join(sorted(reasons))
        if self.meta["kernel_level"].eq("captured").any():
            return "traces say the kernel level was captured, but they hold no kernel spans"
        return "no kernel spans in the selected traces (trace attribute kernel_level not set)"

    def peaks(self) -> pd.DataFrame:
        """Per model/batch: the roofline peaks recorded with the traces (median over traces)."""
        m = self.meta
        return m.groupby(GROUP, dropna=False, as_index=False).agg(
            peak_flops_per_s=("peak_flops_per_s", "median"),
            peak_dram_bytes_per_s=("peak_dram_bytes_per_s", "median"),
            peak_source=("peak_source", "first"),
        )


def empty_result(key: str, title: str) -> AnalysisResult:
    return AnalysisResult(key, title, status="empty", reason="no trace matched the filters")
