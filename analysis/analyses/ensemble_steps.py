"""An ensemble request as its steps, from Triton's own spans.

In OpenTelemetry trace mode Triton gives an ensemble request one model span for the ensemble
and, inside it, one model span per step (named after the step's model), each with its own
`queue` and `compute` phases. A trace is an ensemble's when one of its server model spans lies
inside another: the outermost is the ensemble, the ones inside are its steps, in order of
start. Phase spans belong to the innermost model span that holds them (all on Triton's clock).

Per step: `queue`, `compute_input`, `compute_infer`, `compute_output` and `step_other` (the
step's model span less those phases). Per ensemble request, the time that is no step's:
`between_steps` (the scheduling gaps, from one step's end to the next step's start; steps that
overlap add no gap) and `ensemble_overhead` (the ensemble's span before its first step and after
its last: Triton's ensemble scheduler taking the request in and handing the response out); and
`steps_overlap`, the time a step's span runs on after the next step started. Triton's own
traces show it: a backend sends its response from inside its execute call and stamps
COMPUTE_END and REQUEST_END afterwards, so the next step starts before the previous one's span
ends (with a Python-backend step, 50-100 µs on a 2-core machine). So the steps' times add up
to more than the ensemble's span by `steps_overlap`: ensemble = steps + between_steps +
ensemble_overhead - steps_overlap.
Steps are keyed `<ensemble>/<step model>` (`step_key`), the key a replay of the ensemble's
steps (ensemble -> step -> that step's levels, its spans named after the step's model) joins on.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.analyses.common import Frames
from sidecar.trace.schema import TRITON_PHASES, Level

STEP_PHASES = (*TRITON_PHASES, "step_other")
# the ensemble's own rows (step ""): time no step holds, then time two steps hold at once
GAP_PHASES = ("between_steps", "ensemble_overhead", "steps_overlap")
_MEASURED = STEP_PHASES[:-1]
TOLERANCE_NS = 1_000  # a phase may stick out of its model span by this much (rounding)


def step_key(ensemble: str, step: str) -> str:
    """The key of one step of an ensemble, e.g. `ens_cnn/pre`."""
    return f"{ensemble}/{step}"


def _model_spans(fr: Frames) -> pd.DataFrame:
    srv = fr.at(Level.SERVER)
    ms = srv[srv["kind"] == "model"]
    return pd.DataFrame(
        {
            "tkey": ms["tkey"].to_numpy(),
            "name": ms["name"].astype(str).to_numpy(),
            "start": ms["start_ns"].to_numpy("int64"),
            "end": ms["end_ns"].to_numpy("int64"),
        }
    )


def steps(fr: Frames) -> pd.DataFrame:
    """One row per step of each ensemble request: tkey, ensemble, step (its model), index
    (order of start), start/end (ns) and every `STEP_PHASES` value in ns; empty (with these
    columns) when no trace is an ensemble's."""
    return fr.memo("ensemble_steps", lambda: _steps(fr))


def _steps(fr: Frames) -> pd.DataFrame:
    cols = ["tkey", "ensemble", "step", "index", "start", "end", *STEP_PHASES]
    ms = _model_spans(fr)
    if ms.empty:
        return pd.DataFrame(columns=cols)
    # the outermost model span of each trace: the earliest start, the longest first
    ms = ms.sort_values(["tkey", "start", "end"], ascending=[True, True, False])
    outer = ms.drop_duplicates("tkey").set_index("tkey")
    inner = ms[~ms.index.isin(ms.drop_duplicates("tkey").index)]
    inside = (inner["start"] >= inner["tkey"].map(outer["start"])) & (
        inner["end"] <= inner["tkey"].map(outer["end"])
    )
    st = inner[inside].copy()
    if st.empty:
        return pd.DataFrame(columns=cols)
    st["ensemble"] = st["tkey"].map(outer["name"])
    st = st.rename(columns={"name": "step"}).sort_values(["tkey", "start"])
    st["index"] = st.groupby("tkey", observed=True).cumcount()
    st = st.reset_index(drop=True)
    phases = _phases_in(fr, st)
    for phase in _MEASURED:
        st[phase] = phases[phase] if phase in phases.columns else np.nan
    measured = st[list(_MEASURED)].sum(axis=1, min_count=1)
    st["step_other"] = ((st["end"] - st["start"]) - measured).clip(lower=0.0)
    return st[cols]


def _phases_in(fr: Frames, st: pd.DataFrame) -> pd.DataFrame:
    """Per row of `st` (a step): the ns of each phase span inside that step's model span."""
    srv = fr.at(Level.SERVER)
    ph = srv[srv["kind"].isin(_MEASURED) & srv["tkey"].isin(st["tkey"].unique())]
    ph = pd.DataFrame(
        {
            "tkey": ph["tkey"].to_numpy(),
            "kind": ph["kind"].astype(str).to_numpy(),
            "pstart": ph["start_ns"].to_numpy("int64"),
            "pend": ph["end_ns"].to_numpy("int64"),
        }
    )
    box = st[["tkey", "start", "end"]].assign(row=np.arange(len(st)))
    both = ph.merge(box, on="tkey")
    both = both[
        (both["pstart"] >= both["start"] - TOLERANCE_NS)
        & (both["pend"] <= both["end"] + TOLERANCE_NS)
    ]
    both = both.assign(ns=(both["pend"] - both["pstart"]).astype("float64"))
    wide = both.pivot_table(index="row", columns="kind", values="ns", aggfunc="sum")
    return wide.reindex(range(len(st)))


def gaps(fr: Frames) -> pd.DataFrame:
    """Per ensemble request: tkey, ensemble, `between_steps`, `ensemble_overhead`,
    `steps_overlap` and the ensemble's latency (its model span), in ns."""
    st = steps(fr)
    cols = ["tkey", "ensemble", *GAP_PHASES, "ensemble_ns"]
    if st.empty:
        return pd.DataFrame(columns=cols)
    ms = _model_spans(fr).sort_values(["tkey", "start", "end"], ascending=[True, True, False])
    outer = ms.drop_duplicates("tkey").set_index("tkey")
    rows = []
    for tkey, grp in st.groupby("tkey", sort=True, observed=True):
        grp = grp.sort_values("start")
        # the latest end of the steps before each one (int64: epoch ns lose µs as floats)
        reach = grp["end"].cummax().shift(fill_value=int(grp["start"].iat[0]))
        between = float((grp["start"] - reach).clip(lower=0).sum())
        overlap = float((np.minimum(reach, grp["end"]) - grp["start"]).clip(lower=0).sum())
        first, last = int(grp["start"].min()), int(grp["end"].max())
        ens_start, ens_end = int(outer.at[tkey, "start"]), int(outer.at[tkey, "end"])
        overhead = float(max(first - ens_start, 0) + max(ens_end - last, 0))
        ensemble = str(grp["ensemble"].iat[0])
        rows.append((tkey, ensemble, between, overhead, overlap, float(ens_end - ens_start)))
    return pd.DataFrame(rows, columns=cols)


def long_rows(fr: Frames, client_ns: pd.Series) -> pd.DataFrame:
    """The live breakdown's step rows, one per (request, step, phase): model (the ensemble),
    tkey, step (`index. model`, or "" for the ensemble's own `GAP_PHASES`), phase, value (ms)
    and client (the request's client latency in ns, `client_ns` by tkey). Only requests in
    `client_ns` (those the breakdown placed)."""
    cols = ["model", "tkey", "step", "phase", "value", "client"]
    st = steps(fr)
    st = st[st["tkey"].isin(client_ns.index)]
    if st.empty:
        return pd.DataFrame(columns=cols)
    st = st.assign(step=(st["index"] + 1).astype(str) + ". " + st["step"].astype(str))
    per_step = st.melt(
        id_vars=["ensemble", "tkey", "step"], value_vars=list(STEP_PHASES), var_name="phase"
    )
    gp = gaps(fr)
    gp = gp[gp["tkey"].isin(client_ns.index)].assign(step="")
    own = gp.melt(
        id_vars=["ensemble", "tkey", "step"], value_vars=list(GAP_PHASES), var_name="phase"
    )
    out = pd.concat([per_step, own], ignore_index=True).dropna(subset=["value"])
    out = out.rename(columns={"ensemble": "model"})
    out["value"] = out["value"].astype("float64") / 1e6
    out["client"] = out["tkey"].map(client_ns)
    return out[cols]


def step_fidelity(fr: Frames) -> pd.DataFrame:
    """Per step (`key` = `step_key`): requests, the step's live compute_infer p50 and its
    replay's p50 (ms; a replay span of level `model` named after the step's model, in the
    same trace), and their ratio; only steps that have a replay."""
    cols = ["key", "requests", "live_p50_ms", "replay_p50_ms", "ratio_p50"]
    st = steps(fr)
    rep = replayed_steps(fr)
    if rep.empty:
        return pd.DataFrame(columns=cols)
    both = st.merge(rep[["tkey", "step", "replay"]], on=["tkey", "step"])
    both = both.dropna(subset=["compute_infer", "replay"])
    if both.empty:
        return pd.DataFrame(columns=cols)
    both = both.assign(
        key=both["ensemble"].astype(str) + "/" + both["step"].astype(str),
        ratio=both["replay"] / both["compute_infer"],
    )
    out = (
        both.groupby("key", sort=True)
        .agg(
            requests=("tkey", "size"),
            live_p50_ms=("compute_infer", "median"),
            replay_p50_ms=("replay", "median"),
            ratio_p50=("ratio", "median"),
        )
        .reset_index()
    )
    out[["live_p50_ms", "replay_p50_ms"]] /= 1e6
    return out[cols]


def replayed_steps(fr: Frames) -> pd.DataFrame:
    """Per ensemble trace and replayed step: tkey, ensemble, step, replay (ns: the median of
    the step's model-level replay spans, those named after the step's model)."""
    cols = ["tkey", "ensemble", "step", "replay"]
    st = steps(fr)
    if st.empty:
        return pd.DataFrame(columns=cols)
    rep = fr.at(Level.MODEL)
    if "source" in rep.columns:
        rep = rep[rep["source"].astype(str) == "replay"]
    if "run_level" in rep.columns:  # the model level's own run, where the levels were split;
        # else the timeline's model spans (their duration is the M run's statistic too)
        own = rep["run_level"].astype(str).isin(["model", "nan", "None", ""])
        rep = rep[own | ~rep["tkey"].map(own.groupby(rep["tkey"]).any())]
    rep = pd.DataFrame(
        {
            "tkey": rep["tkey"].to_numpy(),
            "step": rep["name"].astype(str).to_numpy(),
            "replay": rep["duration_ns"].to_numpy("float64"),
        }
    )
    rep = rep.groupby(["tkey", "step"], observed=True, as_index=False)["replay"].median()
    named = st[["tkey", "ensemble", "step"]].drop_duplicates()
    return named.merge(rep, on=["tkey", "step"]).dropna(subset=["replay"])[cols]


def replay_steps(fr: Frames) -> pd.DataFrame:
    """Per replayed ensemble trace and step: tkey, step (its model), step_index (order of
    start), start_ns and end_ns on the replay's timeline: the replay's model spans inside
    another model span of the trace (the ensemble's: `runners.ensemble` lays its steps end to
    end inside it, each holding its own layers); empty (with these columns) without one."""
    return fr.memo("replay_steps", lambda: _replay_steps(fr))


def _replay_steps(fr: Frames) -> pd.DataFrame:
    cols = ["tkey", "step", "step_index", "start_ns", "end_ns"]
    rep = fr.at(Level.MODEL)
    if "source" in rep.columns:
        rep = rep[rep["source"].astype(str) == "replay"]
    if rep.empty:
        return pd.DataFrame(columns=cols)
    ms = pd.DataFrame(
        {
            "tkey": rep["tkey"].to_numpy(),
            "step": rep["name"].astype(str).to_numpy(),
            "start_ns": rep["start_ns"].to_numpy("int64"),
            "end_ns": rep["end_ns"].to_numpy("int64"),
        }
    ).sort_values(["tkey", "start_ns", "end_ns"], ascending=[True, True, False])
    first = ms.drop_duplicates("tkey")  # the outermost: the earliest start, the longest first
    outer = first.set_index("tkey")
    inner = ms[~ms.index.isin(first.index)]
    inside = (inner["start_ns"] >= inner["tkey"].map(outer["start_ns"])) & (
        inner["end_ns"] <= inner["tkey"].map(outer["end_ns"])
    )
    st = inner[inside]
    if st.empty:
        return pd.DataFrame(columns=cols)
    st = st.sort_values(["tkey", "start_ns"], kind="stable")
    st = st.assign(step_index=st.groupby("tkey", observed=True).cumcount())
    return st[cols].reset_index(drop=True)


def fidelity_notes(fr: Frames) -> list[str]:
    """The fidelity analysis' lines on ensembles: each replayed step against that step's live
    compute_infer, or one line saying no step has a replay; none without ensembles."""
    st = steps(fr)
    if st.empty:
        return []
    ensembles = ", ".join(sorted(map(str, st["ensemble"].unique())))
    per_step = step_fidelity(fr)
    if per_step.empty:
        return [
            f"ensembles ({ensembles}): no step has a replay, so no step's replay is compared "
            "with its live compute_infer (live_breakdown shows each step's live phases)"
        ]
    return [
        f"ensemble step {r.key}: replay p50 {r.replay_p50_ms:.3g} ms vs its live "
        f"compute_infer p50 {r.live_p50_ms:.3g} ms, ratio {r.ratio_p50:.2f} over "
        f"{r.requests} requests"
        for r in per_step.itertuples(index=False)
    ]
