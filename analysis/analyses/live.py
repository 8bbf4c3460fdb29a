"""The live request breakdown: what the client waited for, phase by phase, per model.

The proxy's request span is the latency the client observed (level `request`): from the
request's first byte at the relay to the response's last byte passed to the client. The relay
also marks when it forwarded the request's end to the backend and when the response's first
frame came back (request span attributes `relay_request_end_ns`, `relay_response_start_ns`);
`backend_response` (the backend's time to respond, as the relay saw it) is the time between
them, from the relay's clock alone.

The backend's spans (level `server`) are placed inside that window: each is clipped to start no
earlier than the request reached the relay and to end no later than the response's first byte
reached it. A backend sends its response from inside its execute call and stamps its ends
afterwards (Triton's COMPUTE_END and REQUEST_END come when the request is released), so work
past that point is its own phase, `server_after_response`: shown apart, not part of the
client's latency. With Triton's spans the phases that add up to the client's latency are
`network_proxy` (client latency - the server's request span as placed: network, the relay and
gRPC framing), `queue`, `compute_input`, `compute_infer`, `compute_output` and `server_other`
(the placed request span - its placed phases).

A TF-Serving backend has no request span: its profiler's capture gives the TensorFlow op
events in the request's window (kind `tf_op`). `tf_ops` is their envelope, from the first op's
start to the last op's end, placed the same way (ops of concurrent requests that overlap the
window are in it too), and `outside_tf_ops` is client latency - `tf_ops`: network, the relay,
gRPC framing and TF-Serving's own request handling (tensor decode and encode).

A trace whose backend spans cannot be placed (Triton's spans start before the request reached
the relay, or after its response came back, by more than `PLACEMENT_TOLERANCE_NS`: a backend
clock that is off; op events all outside the request's window; phases that overlap) is left
out of the breakdown, counted and named in a note. A store written before the relay marked its
calls has no `relay_response_start_ns`: its spans are clipped at the response's end at the
relay instead, `backend_response` is unknown, and a note says so.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.analyses import ensemble_steps
from analysis.analyses.common import AnalysisResult, Frames, empty_result, not_captured
from analysis.load.tracedb import RELAY_OFFSET_COLUMNS
from sidecar.trace import schema
from sidecar.trace.schema import TF_OP, TRITON_PHASES, Level

TITLE = "Live request breakdown (client latency at the proxy vs backend phases)"
BACKEND_PHASES = TRITON_PHASES
TF_OP_KIND = TF_OP
# Per request, the phases after client_total up to outside_tf_ops that a backend's spans give
# add up to client_total; backend_response (the relay's view) and server_after_response
# (after the client had its answer) are shown apart.
PHASES = (
    "client_total", "backend_response", "network_proxy", *BACKEND_PHASES, "server_other",
    "tf_ops", "outside_tf_ops", "server_after_response",
)  # fmt: skip
TRITON_SUM = ("network_proxy", *BACKEND_PHASES, "server_other")
TF_SUM = ("tf_ops", "outside_tf_ops")
APART = ("backend_response", "server_after_response")
PERCENTILES = (0.5, 0.9, 0.99)
# A backend span may start this much before the request reached the relay (or after its
# response came back) and still be placed (clipped): clocks of one host read a few µs apart.
PLACEMENT_TOLERANCE_NS = 250_000
OVERLAP_TOLERANCE = 0.01  # placed phases may exceed the placed request span by this share
NAMED_TRACES = 5  # left-out traces named in the note
STEPS_NOTE = (
    "ensembles are read as their steps too (column step, `<n>. <model>` in order of start): "
    "each step's queue and compute phases and step_other (its model span less them), from "
    "Triton's own spans; between_steps (from one step's end to the next one's start) and "
    "ensemble_overhead (the ensemble's span before its first step and after its last) are the "
    "time no step holds, steps_overlap the time a step's span runs on after the next step "
    "started (Triton stamps a step's ends after it sent its outputs on), in the rows whose step "
    "is empty: the ensemble's span = its steps + between_steps + ensemble_overhead - "
    "steps_overlap"
)
REQUEST_END = RELAY_OFFSET_COLUMNS[schema.RELAY_REQUEST_END_NS]
RESPONSE_START = RELAY_OFFSET_COLUMNS[schema.RELAY_RESPONSE_START_NS]


def request_phases(fr: Frames) -> pd.DataFrame:
    """One row per sampled request (trace): model, trace id, every phase in ns (NaN if
    unknown), `relay_marks` (the store has the relay's marks of the call) and `unplaced` (why
    its backend spans cannot be placed; None when they can, or when it has none)."""
    req = fr.at(Level.REQUEST).sort_values(["tkey", "start_ns"]).drop_duplicates("tkey")
    out = pd.DataFrame(
        {
            "tkey": req["tkey"].to_numpy(),
            "client_total": req["duration_ns"].to_numpy("float64"),
            "request_end": _column(req, REQUEST_END),
            "response_start": _column(req, RESPONSE_START),
        }
    ).set_index("tkey")
    out["relay_marks"] = out["response_start"].notna()
    out["backend_response"] = out["response_start"] - out["request_end"]
    # where the backend's spans are cut: the response's first byte, else (an older store)
    # the response's end at the relay
    cut = out["response_start"].where(out["relay_marks"], out["client_total"])
    srv = fr.at(Level.SERVER)
    srv = srv[srv["tkey"].isin(out.index)]
    t0 = req.set_index("tkey")["start_ns"]
    start = (srv["start_ns"] - srv["tkey"].map(t0)).astype("float64")  # exact: int64 first
    end = (srv["end_ns"] - srv["tkey"].map(t0)).astype("float64")
    span_cut = srv["tkey"].map(cut)
    placed = (np.minimum(end, span_cut) - np.maximum(start, 0.0)).clip(lower=0.0)
    pos = pd.DataFrame(
        {"tkey": srv["tkey"], "kind": srv["kind"], "start": start, "end": end, "placed": placed}
    )
    ops = pos["kind"] == TF_OP_KIND
    triton = pos[~ops]
    wide = triton.pivot_table(
        index="tkey", columns="kind", values="placed", aggfunc="sum", observed=True
    )
    for col in ("request", *BACKEND_PHASES):
        out[col] = wide[col] if col in wide.columns else float("nan")
    envelope = (
        pos[ops].groupby("tkey", observed=True).agg(start=("start", "min"), end=("end", "max"))
    )
    env_cut = cut.reindex(envelope.index)
    out["tf_ops"] = (np.minimum(envelope["end"], env_cut) - envelope["start"].clip(lower=0.0)).clip(
        lower=0.0
    )
    last_end = pos.groupby("tkey", observed=True)["end"].max()
    out["server_after_response"] = (last_end - cut.reindex(last_end.index)).clip(lower=0.0)
    out = out.astype({c: "float64" for c in out.columns if c != "relay_marks"})
    phase_sum = out[list(BACKEND_PHASES)].sum(axis=1, min_count=1)
    out["network_proxy"] = out["client_total"] - out["request"]
    out["server_other"] = out["request"] - phase_sum
    out["outside_tf_ops"] = out["client_total"] - out["tf_ops"]
    out["unplaced"] = _unplaced(out, triton, envelope, cut, _steps_overlap(fr, out.index))
    out = out.drop(columns=["request", "request_end", "response_start"]).reset_index()
    return fr.with_meta(out, ["model", "trace_id"])


def _column(df: pd.DataFrame, col: str) -> np.ndarray:
    if col not in df.columns:  # a frame built without the loader's relay columns
        return np.full(len(df), np.nan)
    return df[col].to_numpy("float64")


def _steps_overlap(fr: Frames, tkeys: pd.Index) -> pd.Series:
    """Per trace (`tkeys`): the ns its ensemble's steps overlap (0 for other traces)."""
    gaps = ensemble_steps.gaps(fr)
    if gaps.empty:
        return pd.Series(0.0, index=tkeys)
    return gaps.set_index("tkey")["steps_overlap"].reindex(tkeys).fillna(0.0).astype("float64")


def _unplaced(
    out: pd.DataFrame,
    triton: pd.DataFrame,
    envelope: pd.DataFrame,
    cut: pd.Series,
    steps_overlap: pd.Series,
) -> pd.Series:
    """Per trace (index of `out`): why its backend spans cannot be placed, or None."""
    tol = PLACEMENT_TOLERANCE_NS
    reason = pd.Series(None, index=out.index, dtype=object)
    first = triton.groupby("tkey", observed=True)["start"].min()
    early = first[first < -tol]
    reason[early.index] = "a backend span starts before the request reached the relay"
    late = first[(first > cut.reindex(first.index) + tol) & reason.reindex(first.index).isna()]
    reason[late.index] = (
        "the backend's spans start after its response reached the relay (its clock is off)"
    )
    env_cut = cut.reindex(envelope.index)
    outside = envelope[(envelope["start"] > env_cut + tol) | (envelope["end"] < -tol)]
    outside = outside[reason.reindex(outside.index).isna()]
    reason[outside.index] = "the op events lie outside the request's window (a clock is off)"
    # an ensemble's steps overlap by Triton's own stamps (ensemble_steps.GAP_PHASES): allowed
    overlap = out["server_other"] < -OVERLAP_TOLERANCE * out["client_total"] - steps_overlap
    overlap &= reason.isna()
    reason[overlap[overlap].index] = (
        "the backend's phases overlap (more phase time than its request span)"
    )
    return reason


def live_breakdown(fr: Frames) -> AnalysisResult:
    if fr.data.empty:
        return empty_result("live_breakdown", TITLE)
    every = request_phases(fr)
    if every.empty:
        return not_captured(
            "live_breakdown",
            TITLE,
            "no live spans: the selected traces were not sampled from live traffic (they "
            "hold no request-level spans from the proxy; e.g. `xsp-sidecar profile` traces)",
        )
    left_out = every[every["unplaced"].notna()]
    per = every[every["unplaced"].isna()]
    # placed or not, a request is in the table: with its rows and notes, or named as left out
    server = per["network_proxy"].notna() | per["tf_ops"].notna()
    per = per.assign(server_other=per["server_other"].clip(lower=0.0))  # within the tolerance
    long = per.melt(id_vars=["model", "tkey"], value_vars=list(PHASES), var_name="phase")
    long = long.dropna(subset=["value"])
    if long.empty:
        return not_captured(
            "live_breakdown", TITLE, "; ".join(_left_out_notes(left_out)) or "no live spans"
        )
    client = per.set_index("tkey")["client_total"]
    long["client"] = long["tkey"].map(client)
    long["value"] = long["value"] / 1e6
    table = _aggregate(long, ["model", "phase"], PHASES)
    step_rows = ensemble_steps.long_rows(fr, client)
    if not step_rows.empty:  # an ensemble's requests, read as its steps too
        table = _with_steps(table, step_rows)
    res = AnalysisResult("live_breakdown", TITLE, table)
    res.notes.append(
        "phases placed on the relay's clock: backend spans are clipped to the request's "
        "window at the relay, ending at the response's first byte; the phases from "
        "network_proxy to server_other (Triton) or tf_ops and outside_tf_ops (TF-Serving) "
        "add up to client_total; backend_response (request forwarded -> first response byte, "
        "the relay's clock alone) and server_after_response (backend work after the response "
        "left, not part of the client's latency) are shown apart; share_of_client is a "
        "phase's time over the client latency of the same requests"
    )
    if per["tf_ops"].notna().any():
        res.notes.append(
            "tf_ops: from the first to the last TensorFlow op event the backend's profiler "
            "captured in the request's window (ops of concurrent requests in that window "
            "count too); outside_tf_ops = client_total - tf_ops"
        )
    old = int((~per["relay_marks"]).sum())
    if old:
        res.notes.append(
            f"{old} sampled requests were stored without the relay's timestamps (a sidecar "
            "older than them): their backend spans are clipped at the response's end at the "
            "relay instead of its first byte, and backend_response is not known"
        )
    no_server = int((~server).sum())
    if no_server:
        res.notes.append(
            f"{no_server} sampled requests have no backend spans (backend tracing off or its "
            "spans did not arrive); they count only in the phases the relay measures "
            "(client_total, backend_response)"
        )
    if not step_rows.empty:
        res.notes.append(STEPS_NOTE)
    res.notes += _left_out_notes(left_out)
    return res


def _aggregate(long: pd.DataFrame, keys: list[str], order: tuple[str, ...]) -> pd.DataFrame:
    """Per `keys` group of `long` (value in ms, client in ns): requests, mean, percentiles
    and the share of the client's latency; `phase` sorted in `order`."""
    g = long.groupby(keys, observed=True)["value"]
    table = g.agg(requests="size", mean_ms="mean").reset_index()
    for q in PERCENTILES:
        col = f"p{round(q * 100)}_ms"
        table = table.merge(g.quantile(q).rename(col).reset_index(), on=keys, how="left")
    table["share_of_client"] = _shares(long, table, keys)
    table["phase"] = pd.Categorical(
        table["phase"], categories=list(dict.fromkeys(order)), ordered=True
    )
    table = table.sort_values(keys).reset_index(drop=True)
    table["phase"] = table["phase"].astype(str)
    return table


STEP_ORDER = (*PHASES, *ensemble_steps.STEP_PHASES, *ensemble_steps.GAP_PHASES)  # of phases


def _with_steps(table: pd.DataFrame, step_rows: pd.DataFrame) -> pd.DataFrame:
    return with_step_rows(table, _aggregate(step_rows, ["model", "step", "phase"], STEP_ORDER))


def with_step_rows(table: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The whole-request rows (step "") and, after an ensemble's, its steps' rows and its own
    (between_steps, ensemble_overhead), in a `step` column after `model`; `steps`: the step
    rows aggregated per model, step and phase (sorted so, the phases in `STEP_ORDER`)."""
    whole = table.assign(step="")
    own = steps["step"] == ""
    out = pd.concat([whole, steps[own], steps[~own]], ignore_index=True)
    out["_part"] = (out["step"] != "").astype(int)  # a model's own rows, then its steps'
    out = out.sort_values(["model", "_part", "step"], kind="stable").drop(columns="_part")
    cols = ["model", "step", *[c for c in table.columns if c != "model"]]
    return out[cols].reset_index(drop=True)


def _shares(long: pd.DataFrame, table: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """Per row of `table` (model, phase): the phase's time over the client latency of the same
    requests (those that have the phase), so the shares of phases measured on fewer requests
    than client_total (no backend spans, no relay marks) still add up where the phases do."""
    sums = long.groupby(keys, observed=True)[["value", "client"]].sum()
    keyed = sums.reindex(pd.MultiIndex.from_frame(table[keys]))
    return (keyed["value"] * 1e6 / keyed["client"]).to_numpy()


def _left_out_notes(left_out: pd.DataFrame) -> list[str]:
    if left_out.empty:
        return []
    notes = []
    for reason, grp in left_out.groupby("unplaced", sort=True, observed=True):
        ids = ", ".join(str(t)[:16] for t in grp["trace_id"].head(NAMED_TRACES))
        more = f" and {len(grp) - NAMED_TRACES} more" if len(grp) > NAMED_TRACES else ""
        models = ", ".join(sorted(map(str, grp["model"].unique())))
        notes.append(
            f"{len(grp)} sampled requests left out of the breakdown ({models}): their backend "
            f"spans cannot be placed on the relay's clock ({reason}); traces {ids}{more}"
        )
    return notes
