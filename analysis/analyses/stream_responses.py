"""Streamed responses: a decoupled model's live answers, per model, from sampled stream messages.

A sampled message of an inference stream (Triton's `ModelStreamInfer`) has its request span
(level `request`) run from the message to its final response, with the relay's view of its
responses (docs/contracts.md): `relay_response_start_ns` (the first response), `responses`
(how many) and `response_gaps_ns` (the gaps between consecutive ones, the first 256). Per
model: percentiles of the time to the first response, of the gaps (pooled over requests) and
of the responses per request, and the share of each request's latency spent before its first
response.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import pandas as pd

from analysis.analyses.common import AnalysisResult, Frames, empty_result, not_captured
from analysis.load.store_file import RELAY_OFFSET_COLUMNS
from sidecar.trace import schema
from sidecar.trace.schema import Level

KEY = "stream_responses"
TITLE = "Streamed responses (time to first response, gaps, responses per request)"
PERCENTILES = (0.5, 0.9, 0.99)
FIRST_RESPONSE = RELAY_OFFSET_COLUMNS[schema.RELAY_RESPONSE_START_NS]
NONE = (
    "no sampled stream messages: the selected traces hold no request span of an "
    "inference stream (ModelStreamInfer) sampled by the relay"
)
NOTE = (
    "times on the relay's clock: first_response from the request message to its first "
    "response; gaps between consecutive responses of one request (pooled over requests; "
    "at most 256 per request); latency from the message to its final response; "
    "first_response_share is the median of first_response / latency"
)


def _number(value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return float(value) if ok else float("nan")


def _gaps(value: Any) -> list[float] | None:
    if not isinstance(value, list):
        return None
    out = [_number(v) for v in value]
    return None if any(np.isnan(out)) else out


def stream_requests(fr: Frames) -> tuple[pd.DataFrame, int]:
    """One row per sampled stream message: model, trace id, `latency_ns`, `first_ns` (its
    first response after the message; NaN: none), `responses`, `gaps` (list of ns); and how
    many stream spans were left out because their values are not numbers."""
    req = fr.at(Level.REQUEST)
    cols = ("responses", schema.RESPONSE_GAPS_NS)
    if req.empty or any(c not in req.columns for c in cols) or FIRST_RESPONSE not in req.columns:
        return pd.DataFrame(), 0
    req = req[req["responses"].notna()]
    responses = req["responses"].map(_number).to_numpy("float64")
    gaps = req[schema.RESPONSE_GAPS_NS].map(lambda v: [] if v is None else _gaps(v))
    bad = np.isnan(responses) | gaps.isna().to_numpy()
    out = pd.DataFrame(
        {
            "tkey": req["tkey"].to_numpy(),
            "latency_ns": req["duration_ns"].to_numpy("float64"),
            "first_ns": req[FIRST_RESPONSE].to_numpy("float64"),
            "responses": responses,
            "gaps": gaps.to_numpy(object),
        }
    )[~bad]
    return fr.with_meta(out.reset_index(drop=True), ["model", "trace_id"]), int(bad.sum())


def _percentiles(values: pd.Series | np.ndarray, prefix: str) -> dict[str, float]:
    arr = np.asarray(values, dtype="float64")
    arr = arr[~np.isnan(arr)]
    return {
        f"{prefix}_p{round(q * 100)}": float(np.quantile(arr, q)) if arr.size else float("nan")
        for q in PERCENTILES
    }


def stream_responses(fr: Frames) -> AnalysisResult:
    if fr.data.empty:
        return empty_result(KEY, TITLE)
    per, bad = stream_requests(fr)
    if per.empty:
        reason = NONE
        if bad:
            reason += f" ({bad} whose response counts or gaps are not numbers)"
        return not_captured(KEY, TITLE, reason)
    rows = []
    for model, g in per.groupby("model", sort=True, observed=True):
        gaps = np.array([x for lst in g["gaps"] for x in lst], dtype="float64") / 1e6
        share = (g["first_ns"] / g["latency_ns"]).where(g["latency_ns"] > 0)
        rows.append(
            {
                "model": model,
                "requests": len(g),
                **_percentiles(g["responses"], "responses"),
                **_percentiles(g["first_ns"] / 1e6, "first_response_ms"),
                "gaps": int(gaps.size),
                **_percentiles(gaps, "gap_ms"),
                **_percentiles(g["latency_ns"] / 1e6, "latency_ms"),
                "first_response_share": float(share.median()),
            }
        )
    res = AnalysisResult(KEY, TITLE, pd.DataFrame(rows))
    res.notes.append(NOTE)
    if bad:
        res.notes.append(f"{bad} stream span(s) left out: response counts or gaps not numbers")
    return res
