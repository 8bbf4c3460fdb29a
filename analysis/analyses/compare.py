"""Compare two sets of traces (models, versions, batch sizes, machines), HTA TraceDiff-style.

Each side's layer latency is the trimmed mean over that side's traces; the comparison shows
model latency per side, latency by layer type, and the layers whose latency changed most.
Sets are chosen with selectors like `model=resnet,batch_size=8` or `source=pod-a.db`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.analyses.common import AnalysisResult, Frames, across_traces
from analysis.analyses.layer_level import across_layers
from analysis.load.tracedb import TraceData
from analysis.relations.kernel_rows import kernel_rows

TITLE = "Comparison of two trace sets"
SELECTOR_KEYS = {
    "model": "model",
    "version": "model_version",
    "model_version": "model_version",
    "batch_size": "batch_size",
    "batch": "batch_size",
    "device": "device",
    "runtime": "runtime",
    "source": "source_db",
    "trace": "trace_id",
}


@dataclass(frozen=True)
class Selector:
    """Conditions on trace columns; every condition must hold (values may use `|` for OR)."""

    text: str
    conditions: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def parse(cls, text: str) -> Selector:
        conds = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            col = SELECTOR_KEYS.get(key.strip())
            if not sep or col is None:
                raise ValueError(
                    f"bad selector {part!r} in {text!r}: use KEY=VALUE[,KEY=VALUE...] with KEY "
                    f"one of {', '.join(sorted(SELECTOR_KEYS))}"
                )
            conds.append((col, tuple(v.strip() for v in value.split("|"))))
        return cls(text, tuple(conds))

    def select(self, traces: pd.DataFrame) -> pd.Series:
        mask = pd.Series(True, index=traces.index)
        for col, values in self.conditions:
            column = traces[col].astype(str)
            if col == "trace_id":
                mask &= column.map(lambda t, vs=values: any(t.startswith(v) for v in vs))
            elif col == "source_db":
                mask &= column.map(lambda s, vs=values: any(s == v or s.endswith(v) for v in vs))
            else:
                mask &= column.isin(values)
        return mask


def split(data: TraceData, base: Selector, new: Selector) -> tuple[TraceData, TraceData]:
    return (
        data.subset(data.traces.loc[base.select(data.traces), "tkey"]),
        data.subset(data.traces.loc[new.select(data.traces), "tkey"]),
    )


def _side(fr: Frames) -> tuple[pd.DataFrame, float]:
    """Per layer call over the side's traces: type, idx and trimmed-mean duration; and the
    side's model latency."""
    layers = across_layers(kernel_rows(fr), ["name"], ["duration_ns"], ["type", "idx"])
    ml = fr.model_latency.assign(_all=0)
    model = across_traces(ml, ["_all"], ["latency_ns"])
    latency = float(model["latency_ns"].iloc[0]) if not model.empty else float("nan")
    return layers, latency


def _same_categories(a: pd.DataFrame, b: pd.DataFrame, col: str) -> None:
    """`col` of both sides as categoricals of one set of categories (sorted) where both are
    categoricals, so that a merge on it keeps it one (as the loader's codes did)."""
    if all(isinstance(d[col].dtype, pd.CategoricalDtype) for d in (a, b)):
        cats = sorted(set(a[col].cat.categories) | set(b[col].cat.categories))
        a[col] = a[col].cat.set_categories(cats)
        b[col] = b[col].cat.set_categories(cats)


def _describe(label: str, fr: Frames, latency_ns: float) -> dict[str, object]:
    t = fr.data.traces
    return {
        "set": label,
        "traces": len(t),
        "models": ", ".join(sorted(t["model"].astype(str).unique())),
        "batch_sizes": ", ".join(str(b) for b in sorted(t["batch_size"].dropna().unique())),
        "devices": ", ".join(sorted(t["device"].astype(str).unique())),
        "sources": ", ".join(sorted(t["source_db"].astype(str).unique())),
        "model_latency_ms": latency_ns / 1e6,
    }


def compare(
    base: TraceData, new: TraceData, labels: tuple[str, str] = ("base", "new"), top: int = 15
) -> AnalysisResult:
    """Latency by layer type (main table), a summary and the top changed layers."""
    if base.empty or new.empty:
        which = " and ".join(lbl for lbl, d in zip(labels, (base, new), strict=True) if d.empty)
        return AnalysisResult(
            "comparison",
            TITLE,
            status="not_applicable",
            reason=f"no trace matched the {which} selection",
        )
    fb, fn = Frames(base), Frames(new)
    lb, mb = _side(fb)
    ln, mn = _side(fn)
    _same_categories(lb, ln, "name")
    a, b = labels
    summary = pd.DataFrame([_describe(a, fb, mb), _describe(b, fn, mn)])
    by_type = (
        lb.groupby("type", observed=True)["duration_ns"]
        .agg(["sum", "size"])
        .rename(columns={"sum": f"{a}_ms", "size": f"{a}_layers"})
        .join(
            ln.groupby("type", observed=True)["duration_ns"]
            .agg(["sum", "size"])
            .rename(columns={"sum": f"{b}_ms", "size": f"{b}_layers"}),
            how="outer",
        )
    )
    by_type[[f"{a}_ms", f"{b}_ms"]] = by_type[[f"{a}_ms", f"{b}_ms"]].fillna(0.0) / 1e6
    by_type[[f"{a}_layers", f"{b}_layers"]] = by_type[[f"{a}_layers", f"{b}_layers"]].fillna(0)
    by_type["diff_ms"] = by_type[f"{b}_ms"] - by_type[f"{a}_ms"]
    with np.errstate(divide="ignore", invalid="ignore"):
        by_type["ratio"] = by_type[f"{b}_ms"] / by_type[f"{a}_ms"].replace(0.0, np.nan)
    by_type = by_type.reset_index().sort_values("diff_ms", key=abs, ascending=False)
    layers = lb[["name", "type", "duration_ns"]].merge(
        ln[["name", "type", "duration_ns"]], on="name", how="outer", suffixes=("_a", "_b")
    )
    layers["type"] = layers["type_a"].fillna(layers["type_b"])
    layers[f"{a}_ms"] = layers["duration_ns_a"] / 1e6
    layers[f"{b}_ms"] = layers["duration_ns_b"] / 1e6
    layers["diff_ms"] = layers[f"{b}_ms"].fillna(0.0) - layers[f"{a}_ms"].fillna(0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        layers["ratio"] = layers[f"{b}_ms"] / layers[f"{a}_ms"]
    top_layers = layers.sort_values("diff_ms", key=abs, ascending=False).head(top)
    top_layers = top_layers[["name", "type", f"{a}_ms", f"{b}_ms", "diff_ms", "ratio"]]
    res = AnalysisResult(
        "comparison",
        TITLE,
        by_type.reset_index(drop=True),
        tables={"summary": summary, "top_layers": top_layers.reset_index(drop=True)},
    )
    res.extra["labels"] = list(labels)
    only_a = int(layers["duration_ns_b"].isna().sum())
    only_b = int(layers["duration_ns_a"].isna().sum())
    if only_a or only_b:
        res.notes.append(f"{only_a} layers only in {a}, {only_b} only in {b} (different graphs)")
    return res
