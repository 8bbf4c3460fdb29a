"""Layer-level analyses A2-A7: the layer table, latency and memory per layer and per type.

Layer latency is the L run's statistic (`duration_ns` of layer spans, trimmed mean over the
run's iterations), then a trimmed mean over the traces of the same model and batch size.
Memory is the layer's `allocated_bytes` attribute.

Where layers nest (PyTorch module calls: `layer1` > `layer1.0` > `layer1.0.conv1`) a
container's time spans its children's. A2 lists every call with `container` set on the
enclosing ones; shares, A3-A7 and every sum over layers use the leaves only, so no time is
counted twice; each result says how many containers it left out.

An ensemble's replay holds its steps' layers, each step's under its own model span
(`ensemble_steps.replay_steps`): there A2, A3 and A4 have a `step` column (the step's model; ""
for the rows of other models), rows per step in the steps' order, and latency_share is of the
step's leaves' time.

The layer spans are read in SQL (the relation `layers` of `analysis.relations.kernel_rows`); only
the per-layer table (one row per model, batch size and call) comes back to pandas.
"""

from __future__ import annotations

import json

import pandas as pd

from analysis.analyses import ensemble_steps
from analysis.analyses.common import GROUP, AnalysisResult, Frames, container_note, empty_result
from analysis.relations.kernel_rows import KernelRows, kernel_rows
from analysis.relations.trimmed_sql import across_traces_sql
from sidecar.trace import schema

TITLES = {
    "A2": "Layer table",
    "A3": "Layer latency in execution order",
    "A4": "Layer allocated memory in execution order",
    "A5": "Layer type distribution",
    "A6": "Latency by layer type",
    "A7": "Allocated memory by layer type",
}


_ANY_LAYER = "SELECT EXISTS (SELECT 1 FROM layers)"
STEPS_NOTE = (
    "ensembles: a row per replayed step's layer (column step, the step's model), the steps in "
    "their order; latency_share is of that step's layers' time"
)


def _missing(key: str, fr: Frames) -> AnalysisResult | None:
    if fr.data.empty:
        return empty_result(key, TITLES[key])
    if not fr.memo("has_layers", lambda: bool(kernel_rows(fr).scalar(_ANY_LAYER))):
        levels = fr.data.levels()
        return AnalysisResult(
            key,
            TITLES[key],
            status="not_captured",
            reason="layer level not captured: the selected traces hold no layer spans "
            f"(levels present: {', '.join(levels) or 'none'})",
        )
    return None


def layer_frame(fr: Frames) -> pd.DataFrame:
    """Per model/batch/layer: trimmed-mean latency and memory over traces (A2's rows)."""
    return fr.memo("layer_frame", lambda: _layer_frame(fr)).copy()


def original_nodes(name: str, nodes: object) -> str:
    """The graph nodes a layer computes, comma-separated; empty where the layer is the one
    node of its name (or a node the runtime inserted, which computes none)."""
    if not isinstance(nodes, list | tuple) or list(nodes) in ([], [name]):
        return ""
    return ", ".join(str(n) for n in nodes)


def across_layers(
    kr: KernelRows, keys: list[str], values: list[str], first: list[str], source: str = "layers"
) -> pd.DataFrame:
    """`across_traces` over the relation `layers` (`keys` among them `name`), by SQL over the
    relation `layers`, with the columns typed as `across_traces` gives them over the frame:
    `model` and `type` as strings (objects), `name` a categorical unless some call is a
    repeat (`kernel_rows`' `#n`, an object column then), and without a row the frame
    `across_traces` makes of no rows. `source`: the relation, or a query over `layers` with
    its columns and more."""
    out = across_traces_sql(kr, source, keys, values, [*first, "module"])
    if out.empty:
        return pd.DataFrame(columns=[*keys, *first, *values, "n_traces"])
    # a repeat's name is its module's and `#n`: a group of repeats is named so, and carries
    # that module from its first row
    names = out["name"].astype(object)
    repeats = names.isna().any() or names.ne(out["module"].astype(object)).any()
    for col in ("model", "type", *(["name"] if repeats else [])):
        if col in out.columns:
            out[col] = out[col].astype(object)
    return out.drop(columns=["module"])


# each layer with the ensemble step whose span holds its start ("" and -1 outside every step)
_STEP_LAYERS = (
    "SELECT l.*, coalesce(s.step, '') AS step, coalesce(s.step_index, -1) AS step_index "
    "FROM layers l LEFT JOIN _replay_steps s ON s.tkey = l.tkey "
    "AND l.start_ns >= s.start_ns AND l.start_ns < s.end_ns"
)


def by_step(agg: pd.DataFrame) -> list[str]:
    """The columns a layer frame's rows are grouped by: `GROUP`, and `step` where it has one."""
    return [*GROUP, "step"] if "step" in agg.columns else list(GROUP)


def _layer_frame(fr: Frames) -> pd.DataFrame:
    first = [
        "idx",
        "type",
        "container",
        schema.ORIGINAL_NODES,
        schema.INPUT_SHAPES,
        schema.OUTPUT_SHAPES,
    ]
    kr, values = kernel_rows(fr), ["duration_ns", schema.ALLOCATED_BYTES]
    steps = ensemble_steps.replay_steps(fr)
    if steps.empty:
        agg = across_layers(kr, [*GROUP, "name"], values, first)
    else:  # an ensemble's layers, per step
        kr.register("_replay_steps", steps)
        try:
            keys = [*GROUP, "step", "name"]
            agg = across_layers(kr, keys, values, [*first, "step_index"], _STEP_LAYERS)
        finally:
            kr.unregister("_replay_steps")
        agg["step"] = agg["step"].astype(object)
    # of each group's first row, as carried: once per row of the table, not per layer span
    # (the relation holds the list as JSON text)
    agg[schema.ORIGINAL_NODES] = [
        original_nodes(n, json.loads(o) if isinstance(o, str) else o)
        for n, o in zip(agg["name"], agg[schema.ORIGINAL_NODES], strict=True)
    ]
    agg["container"] = agg["container"].astype(bool)
    agg["latency_ms"] = agg["duration_ns"] / 1e6
    leaf_ns = agg["duration_ns"].where(~agg["container"])
    by = by_step(agg)
    total = leaf_ns.groupby([agg[k] for k in by], dropna=False, observed=True).transform("sum")
    agg["latency_share"] = leaf_ns / total  # of the leaves' time; NaN for a container
    if "step" not in agg.columns:
        return agg.sort_values([*GROUP, "idx"]).reset_index(drop=True)
    agg = agg.sort_values([*GROUP, "step_index", "idx"]).reset_index(drop=True)
    return agg.drop(columns="step_index")


def leaf_frame(fr: Frames, res: AnalysisResult | None = None) -> pd.DataFrame:
    """`layer_frame` without container rows; notes on `res` how many were left out."""
    agg = layer_frame(fr)
    n = int(agg.drop_duplicates([*GROUP[:1], "name"])["container"].sum())
    if res is not None and n:
        res.notes.append(container_note(n, "left out"))
    return agg[~agg["container"]].reset_index(drop=True)


def layer_table(fr: Frames) -> AnalysisResult:
    """A2: index, full name, type, original graph nodes, shapes, latency and allocated
    memory of every layer."""
    if (miss := _missing("A2", fr)) is not None:
        return miss
    agg = layer_frame(fr)
    cols = [
        *by_step(agg),
        "idx",
        "name",
        "type",
        "container",
        schema.ORIGINAL_NODES,
        schema.INPUT_SHAPES,
        schema.OUTPUT_SHAPES,
        "latency_ms",
        "latency_share",
        schema.ALLOCATED_BYTES,
        "n_traces",
    ]
    res = AnalysisResult("A2", TITLES["A2"], agg[cols])
    if agg[schema.ORIGINAL_NODES].astype(bool).any():
        res.notes.append(
            "original_nodes: the graph nodes a layer computes where the runtime fused or "
            "renamed them (type names what it fused, e.g. Conv+Relu)"
        )
    if agg[schema.ALLOCATED_BYTES].isna().all():
        res.notes.append("layer memory not recorded (no allocated_bytes attribute)")
    if (n := int(agg.drop_duplicates(["model", "name"])["container"].sum())) > 0:
        res.notes.append(
            container_note(n, "marked container")
            + "; latency_share is of the leaves' time and left empty for containers"
        )
    if "step" in agg.columns:
        res.notes.append(STEPS_NOTE)
    return res


def layer_latency(fr: Frames) -> AnalysisResult:
    """A3: layer latency in execution order."""
    if (miss := _missing("A3", fr)) is not None:
        return miss
    res = AnalysisResult("A3", TITLES["A3"])
    agg = leaf_frame(fr, res)
    res.table = agg[
        [*by_step(agg), "idx", "name", "type", schema.ORIGINAL_NODES, "latency_ms", "latency_share"]
    ]
    if "step" in agg.columns:
        res.notes.append(STEPS_NOTE)
    return res


def layer_memory(fr: Frames) -> AnalysisResult:
    """A4: allocated memory per layer in execution order."""
    if (miss := _missing("A4", fr)) is not None:
        return miss
    agg = leaf_frame(fr)
    if agg[schema.ALLOCATED_BYTES].isna().all():
        return AnalysisResult(
            "A4",
            TITLES["A4"],
            status="not_captured",
            reason="layer memory not captured: no layer span carries allocated_bytes",
        )
    agg["allocated_mib"] = agg[schema.ALLOCATED_BYTES] / 2**20
    cols = [*by_step(agg), "idx", "name", "type", schema.ALLOCATED_BYTES, "allocated_mib"]
    return AnalysisResult("A4", TITLES["A4"], agg[cols])


def _by_type(agg: pd.DataFrame, value: str) -> pd.DataFrame:
    g = agg.groupby([*GROUP, "type"], dropna=False, as_index=False, observed=True).agg(
        layers=("name", "size"), total=(value, "sum")
    )
    g["share"] = g["total"] / g.groupby(GROUP, dropna=False, observed=True)["total"].transform(
        "sum"
    )
    return g.sort_values([*GROUP, "total"], ascending=[True, True, False]).reset_index(drop=True)


def type_distribution(fr: Frames) -> AnalysisResult:
    """A5: how many layers of each type."""
    if (miss := _missing("A5", fr)) is not None:
        return miss
    res = AnalysisResult("A5", TITLES["A5"])
    agg = leaf_frame(fr, res).assign(one=1)
    g = _by_type(agg, "one").drop(columns=["total"])
    g["share"] = g["layers"] / g.groupby(GROUP, dropna=False, observed=True)["layers"].transform(
        "sum"
    )
    g = g.sort_values([*GROUP, "layers"], ascending=[True, True, False])
    res.table = g.reset_index(drop=True)
    return res


def latency_by_type(fr: Frames) -> AnalysisResult:
    """A6: summed layer latency per layer type and its share of all layer time."""
    if (miss := _missing("A6", fr)) is not None:
        return miss
    res = AnalysisResult("A6", TITLES["A6"])
    g = _by_type(leaf_frame(fr, res), "latency_ms").rename(columns={"total": "latency_ms"})
    res.table = g
    return res


def memory_by_type(fr: Frames) -> AnalysisResult:
    """A7: summed allocated memory per layer type."""
    if (miss := _missing("A7", fr)) is not None:
        return miss
    agg = leaf_frame(fr)
    if agg[schema.ALLOCATED_BYTES].isna().all():
        return AnalysisResult(
            "A7",
            TITLES["A7"],
            status="not_captured",
            reason="layer memory not captured: no layer span carries allocated_bytes",
        )
    g = _by_type(agg, schema.ALLOCATED_BYTES).rename(columns={"total": schema.ALLOCATED_BYTES})
    return AnalysisResult("A7", TITLES["A7"], g)
