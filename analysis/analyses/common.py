"""Shared pieces of the analyses: results, trimmed means across traces, derived span frames.

Statistics follow XSP: a value reported for a model/batch size is the trimmed mean of that
value over the traces of the same model and batch size, cutting `TRIM` (20%) of the values
from each end (`floor(0.2 * n)` values from the bottom and as many from the top).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from analysis.analyses.group_ids import group_ids
from analysis.analyses.once import OncePerKey
from analysis.load import sparse_columns
from analysis.load.store_file import TRACE_IDENTITY
from analysis.load.tracedb import TraceData
from analysis.relations.kernel_rows import kernel_rows
from sidecar.profiling.stats import TRIM
from sidecar.trace import schema
from sidecar.trace.schema import Level
from sidecar.trace.spans import LIVE_ONLY

T = TypeVar("T")
GROUP = ["model", "batch_size"]
DEVICE_KINDS = ("kernel", "memcpy", "memset")  # work that runs on the accelerator
KERNEL_TABLE_KINDS = (*DEVICE_KINDS, "cpu_op")  # rows of the kernel table (A8)


def kind_in(kinds: Sequence[str], column: str = "kind") -> str:
    """SQL: `column` (a span's kind) is one of `kinds`."""
    return f"{column} IN ({', '.join(repr(k) for k in kinds)})"


class NotCapturedError(LookupError):
    """The level or metric an analysis needs was not captured in the selected traces."""


@dataclass
class AnalysisResult:
    """One analysis: its table, or why there is none.

    `status` is `ok`, `not_captured` (a level/metric was not recorded; `reason` says why),
    `empty` (no trace matched), `not_applicable` (e.g. a comparison without two sets) or
    `error` (the analysis raised `exception`; `reason` is its one line: the section alone
    fails, the rest of the report renders). `estimated` is true when some numbers come from
    estimated FLOPs/bytes, not counters.
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
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def require(self) -> pd.DataFrame:
        """The table, or NotCapturedError saying why there is none (the analysis' own
        exception where it raised one)."""
        if self.exception is not None:
            raise self.exception
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


def live_only_note(traces: pd.DataFrame) -> str:
    """What a replay analysis says of the live-only traces (`traces`: their rows) it leaves
    out."""
    models = ", ".join(sorted(traces["model"].astype(str).unique()))
    return (
        f"{len(traces)} live-only traces (models: {models}) have no replay: no replay can "
        "run their model (trace attribute `replay` says why); the live breakdown shows them"
    )


def failed(key: str, title: str, exc: BaseException) -> AnalysisResult:
    """The result of an analysis that raised `exc`: its section says so in one line."""
    where = ""
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame of the analyses (not pandas', not the caller)
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module.startswith("analysis.") and module != "analysis.trace_analysis":
            where = f" (in {module.removeprefix('analysis.')}.{tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    text = " ".join(str(exc).split())[:300]
    reason = f"the analysis failed: {type(exc).__name__}: {text}{where}"
    return AnalysisResult(key, title, status="error", reason=reason, exception=exc)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame rows as JSON-safe dicts (NaN -> None, numpy scalars -> Python), converted a
    column at a time: numpy's `tolist` for numbers, `_jsonable` only on other values."""
    keys = [str(k) for k in df.columns]
    if not keys:
        return [{} for _ in range(len(df))]
    columns = [_jsonable_column(df.iloc[:, i]) for i in range(len(keys))]
    return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]


def _jsonable_column(col: pd.Series) -> list[Any]:
    dtype = col.dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "iub":
        return col.to_numpy().tolist()
    if isinstance(dtype, np.dtype) and dtype.kind == "f":
        values = col.to_numpy()
        out = values.tolist()
        for pos in np.flatnonzero(~np.isfinite(values)).tolist():
            out[pos] = None
        return out
    return [v if type(v) is str else _jsonable(v) for v in col.tolist()]


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


def across_traces(
    df: pd.DataFrame,
    keys: Sequence[str],
    values: Sequence[str],
    first: Sequence[str] = (),
    proportion: float = TRIM,
    rows: np.ndarray | None = None,
) -> pd.DataFrame:
    """Trimmed mean of each column in `values` over the traces in each `keys` group.

    `df` has one row per trace (`tkey`) and key. Columns in `first` are carried from the
    first row of each group. Adds `n_traces`. Vectorised: one sort per value column.
    `rows` (a boolean mask): the rows to take, as `across_traces(df[rows], ...)` does, without
    copying the columns of every row kept (only the keys' codes, and one value column at a
    time).
    """
    keys = list(keys)
    if rows is not None and rows.all():
        rows = None
    if df.empty or (rows is not None and not rows.any()):
        return pd.DataFrame(columns=[*keys, *first, *values, "n_traces"])
    gid, first_row = group_ids(df, keys, rows)  # groups numbered in key order
    n_groups = len(first_row)
    at = first_row if rows is None else np.flatnonzero(rows)[first_row]
    out = df[[*keys, *first]].iloc[at].reset_index(drop=True)
    tkey = df["tkey"].to_numpy("int64")
    if rows is not None:
        tkey = tkey[rows]
    pairs = np.unique(gid.astype("int64") * (int(tkey.max()) + 1) + tkey)
    out["n_traces"] = np.bincount(pairs // (int(tkey.max()) + 1), minlength=n_groups)
    for col in values:
        v = pd.to_numeric(df[col]).to_numpy("float64")
        out[col] = _trimmed_means(gid, v if rows is None else v[rows], n_groups, proportion)
    return out


def _trimmed_means(gid: np.ndarray, v: np.ndarray, n_groups: int, proportion: float) -> np.ndarray:
    """Per group id: the trimmed mean of its non-NaN values (NaN for a group without any),
    by the rule of `sidecar.profiling.stats.trimmed_mean`, vectorised."""
    ok = ~np.isnan(v)
    small = gid.astype(np.int32) if n_groups < 1 << 31 else gid
    g, v = (small, v) if ok.all() else (small[ok], v[ok])
    del small, ok
    # `lexsort((v, g))`'s order, by a sort of the values and then a stable sort of their
    # groups (a radix sort where the group ids fit 16 bits): a third less time. The values'
    # sort need not be stable: values that compare equal are equal (NaN is left out, and
    # -0.0 and 0.0 add alike), so their order changes neither the trim nor the sums.
    order = np.argsort(v)
    ids = g[order].astype(np.uint16) if n_groups <= 1 << 16 else g[order]
    order = order[np.argsort(ids, kind="stable")]
    del ids
    g, v = g[order], v[order]
    del order
    # each group's rows lie together, its values ascending: keep those from its start + k
    # to its end - k (k = floor(proportion * count)), marked by +1/-1 at the bounds
    counts = np.bincount(g, minlength=n_groups)
    starts = np.cumsum(counts) - counts
    k = np.floor(proportion * counts).astype(np.int64)
    bounds = np.zeros(len(g) + 1, dtype=np.int8)
    np.add.at(bounds, starts + k, 1)
    np.add.at(bounds, starts + counts - k, -1)
    keep = np.cumsum(bounds[:-1], dtype=np.int8).astype(bool)
    del bounds
    g, v = g[keep], v[keep]
    sums = np.bincount(g, weights=v, minlength=n_groups)
    kept = np.bincount(g, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(kept > 0, sums / np.maximum(kept, 1), np.nan)


def weighted(values: pd.Series, weights: pd.Series) -> float:
    """Weighted mean ignoring rows where the value is NaN."""
    mask = values.notna() & weights.notna()
    w = weights[mask].sum()
    return float((values[mask] * weights[mask]).sum() / w) if w > 0 else math.nan


def ns_to_ms(col: pd.Series) -> pd.Series:
    return col.astype("float64") / 1e6


def container_note(n: int, what: str) -> str:
    return (
        f"{n} container layers (module calls that enclose other layers, e.g. layer1 > layer1.0) "
        f"are {what}: their time spans their children's and would count it twice"
    )


def left_join(df: pd.DataFrame, right: pd.DataFrame, on: Sequence[str]) -> pd.DataFrame:
    """`df.merge(right, on=on, how="left")` where `right`'s keys are unique, without copying
    `df`'s columns (copy-on-write): only the key columns are merged, to find each row's match,
    and `right`'s other columns taken by it (missing where none matches, as merge fills)."""
    on = list(on)
    if right.duplicated(on).any() or df.columns.isin(right.columns.difference(on)).any():
        return df.merge(right, on=on, how="left")  # rows repeated, or columns renamed
    rows = pd.Series(np.arange(len(right)), index=pd.MultiIndex.from_frame(right[on]))
    found = df[on].merge(rows.rename("_row").reset_index(), on=on, how="left")["_row"]
    at = found.fillna(-1).to_numpy("int64")  # -1: no match
    missing = bool((at < 0).any())
    out = df.reset_index(drop=True)
    for col in right.columns.difference(on, sort=False):
        values = right[col]
        data = values.to_numpy() if isinstance(values.dtype, np.dtype) else values.array
        out[col] = pd.api.extensions.take(data, at, allow_fill=missing)
    return out


def _level_slices(spans: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each level's spans: slices (no copy under copy-on-write) where each level's rows lie
    together, as the loader orders them; else a split by `groupby`. Either way the rows of a
    level in their order, with their index labels."""
    level = spans["level"].to_numpy(object)
    if len(level):
        starts = np.flatnonzero(np.r_[True, level[1:] != level[:-1]])
        ends = np.r_[starts[1:], len(level)]
        runs = [(v, a, b) for v, a, b in zip(level[starts], starts, ends, strict=True)]
        named = [v for v, _, _ in runs if isinstance(v, str)]  # groupby drops missing levels
        if len(set(named)) == len(named) and all(
            isinstance(v, str) or pd.isna(v) for v, _, _ in runs
        ):
            return {v: spans.iloc[a:b] for v, a, b in runs if isinstance(v, str)}
    return {str(k): g for k, g in spans.groupby("level", sort=False, observed=True)}


class Frames:
    """Derived frames shared by the analyses, computed once per TraceData."""

    def __init__(self, data: TraceData) -> None:
        self.data = data
        self._memo: OncePerKey[str, Any] = OncePerKey()

    def memo(self, key: str, build: Callable[[], T]) -> T:
        """`build()` once per key, whichever thread asks first; callers must not modify what
        it returns."""
        value: T = self._memo.get(key, build)
        return value

    def at(self, level: str) -> pd.DataFrame:
        """The spans of one level (split once, then shared: do not modify)."""
        levels = self.memo("levels", self._split_levels)
        if level not in levels:
            return sparse_columns.dense(self.data.spans.iloc[:0], level)
        return levels[level]

    def _split_levels(self) -> dict[str, pd.DataFrame]:
        split = _level_slices(self.data.spans)
        return {k: sparse_columns.dense(v, k) for k, v in split.items()}

    # (properties made by `memo`, not `cached_property`: in Python 3.11 a cached property
    # holds a lock of its class while it is made, which could wait on a `memo` in another
    # thread that waits on it)
    @property
    def meta(self) -> pd.DataFrame:
        """Per trace: tkey, model, batch_size and what the analyses group by."""
        return self.memo("meta", self._meta)

    def _meta(self) -> pd.DataFrame:
        cols = [
            "tkey",
            *TRACE_IDENTITY,
            schema.KERNEL_LEVEL,
            schema.PEAK_FLOPS_PER_S,
            schema.PEAK_DRAM_BYTES_PER_S,
            schema.PEAK_SOURCE,
            "created_ns",
        ]
        return self.data.traces[cols]

    def with_meta(self, df: pd.DataFrame, cols: Sequence[str] = GROUP) -> pd.DataFrame:
        return left_join(df, self.meta[["tkey", *cols]], ["tkey"])

    @property
    def model_latency(self) -> pd.DataFrame:
        """Per trace model latency (ns): the M run's trimmed mean, else the model span."""
        return self.memo("model_latency", self._model_latency)

    def _model_latency(self) -> pd.DataFrame:
        ls = self.data.level_stats
        from_stats = ls[ls["level"] == Level.MODEL][["tkey", "trimmed_mean_ns"]]
        from_stats = from_stats.rename(columns={"trimmed_mean_ns": "latency_ns"})
        ms = self.at(Level.MODEL)
        ms = ms.assign(_pref=(ms["run_level"] != Level.MODEL).astype(int)).sort_values(
            ["tkey", "_pref", "start_ns"]
        )
        from_spans = ms.drop_duplicates("tkey")[["tkey", "duration_ns"]]
        from_spans = from_spans.rename(columns={"duration_ns": "latency_ns"})
        missing = from_spans[~from_spans["tkey"].isin(from_stats["tkey"])]
        out = pd.concat([from_stats, missing], ignore_index=True)
        out["latency_ns"] = out["latency_ns"].astype("float64")
        return self.with_meta(out)

    def model_samples(self) -> dict[int, list[float]]:
        """Per trace (tkey): the M run's per-iteration latencies in ns, where recorded."""
        ls = self.data.level_stats
        if "samples_ns" not in ls.columns:
            return {}
        rows = ls[(ls["level"] == Level.MODEL) & ls["samples_ns"].notna()]
        return {int(k): list(v) for k, v in zip(rows["tkey"], rows["samples_ns"], strict=True)}

    def kernel_reason(self) -> str:
        """Why the kernel level is missing from the selected traces."""
        reasons = [
            str(r) for r in self.meta[schema.KERNEL_LEVEL].dropna().unique() if str(r) != "captured"
        ]
        if reasons:
            quoted = "; ".join(f'"{r}"' for r in sorted(reasons))
            return f"no kernel-level spans; the traces record kernel_level = {quoted}"
        if self.meta[schema.KERNEL_LEVEL].eq("captured").any():
            return "traces say the kernel level was captured, but they hold no kernel spans"
        return "no kernel spans in the selected traces (trace attribute kernel_level not set)"

    def metrics_notes(self) -> list[str]:
        """What GPU traces say about their hardware-metrics level (`metrics_level`: Nsight
        Compute, or why not captured; `pm_sampling`), one note per distinct statement."""
        seen: dict[str, set[str]] = {}
        rows = zip(
            self.meta["model"], self.meta["batch_size"], self.data.traces["attributes"], strict=True
        )
        for model, batch, attrs in rows:
            if not isinstance(attrs, dict):
                continue
            for key in ("metrics_level", "pm_sampling"):
                if isinstance(text := attrs.get(key), str):
                    seen.setdefault(f"{key}: {text}", set()).add(f"{model} b{batch}")
        return [f"{text} ({', '.join(sorted(m))})" for text, m in seen.items()]

    def missing_level_note(self, level: str) -> str | None:
        """For a mixed selection: which models' traces lack `level` spans, and why."""
        if level in ("kernel", "layer"):  # (held in DuckDB: `kernel_rows`)
            relation = "kernels" if level == "kernel" else "layer_calls"
            tkeys = kernel_rows(self).query(f"SELECT DISTINCT tkey FROM {relation}")["tkey"]
            have = set(tkeys.tolist())
        else:
            have = set(self.at(level)["tkey"].unique())
        lacking = self.meta[~self.meta["tkey"].isin(have)]
        if lacking.empty or not have:
            return None
        live = lacking["tkey"].isin(self.live_only_tkeys())
        notes = []
        if live.any():
            notes.append(live_only_note(lacking[live]))
        lacking = lacking[~live]
        if lacking.empty:
            return notes[0]
        models = ", ".join(sorted(lacking["model"].astype(str).unique()))
        text = f"{level} level not captured in {len(lacking)} traces (models: {models})"
        if level == "kernel":
            reasons = sorted(
                str(r) for r in lacking[schema.KERNEL_LEVEL].dropna().unique() if r != "captured"
            )
            if reasons:
                text += ": " + "; ".join(reasons)
        return "; ".join([text + "; they are left out of this table", *notes])

    def live_only_tkeys(self) -> set[int]:
        """The traces kept live-only (`status` `live_only`: no replay can run their model)."""
        tr = self.data.traces
        return set(tr.loc[tr["status"] == LIVE_ONLY, "tkey"].astype(int).tolist())

    def peaks(self) -> pd.DataFrame:
        """Per model/batch: the roofline peaks recorded with the traces (median over traces)."""
        m = self.meta
        return m.groupby(GROUP, dropna=False, as_index=False, observed=True).agg(
            peak_flops_per_s=(schema.PEAK_FLOPS_PER_S, "median"),
            peak_dram_bytes_per_s=(schema.PEAK_DRAM_BYTES_PER_S, "median"),
            peak_source=(schema.PEAK_SOURCE, "first"),
        )


def empty_result(key: str, title: str) -> AnalysisResult:
    return AnalysisResult(key, title, status="empty", reason="no trace matched the filters")
