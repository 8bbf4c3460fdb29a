"""How far a sampled request's replay is from what the server itself ran: the trace's
`fidelity` attribute.

A sampled trace is written in parts, in any order: the proxy's request span, the backend's own
spans (Triton's OTLP spans, TF-Serving's profiler capture) and the replay (trace row, spans,
level statistics). Once the trace is final (`parts`: its parts are all there, or one never
will be) the store computes, in the transaction of the part that made it final (a trace not
under assembly: after each part):

- `live_compute_ns`: the backend's own compute time for the request. Triton: its
  `compute_infer` span (as the server stamped it); TF-Serving: the envelope of the request's
  TensorFlow op events (`tf_op`), first start to last end. `live_source` says which.
- `replay_model_ns`: the replay's model latency (the M run's trimmed mean) of the same input,
  so at the request's batch size.
- `ratio`: replay / live (1: the replay ran as fast as the server; 0.1: ten times faster).
- `server_batch_window`: what the server executed around the request (`sampling.batch_windows`,
  from the request span), copied here so that the trace carries it.

A trace without a replay or without live compute has no ratio; one with neither part (e.g. an
`xsp-sidecar profile` trace) gets no `fidelity` attribute.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from sidecar.trace import schema
from sidecar.trace.schema import COMPUTE_INFER, TF_OP, Level, Source, json_path

ATTRIBUTE = schema.FIDELITY
WINDOW_ATTRIBUTE = schema.SERVER_BATCH_WINDOW

_PARTS = f"""
SELECT
  (SELECT attributes FROM traces WHERE trace_id = :t),
  (SELECT sum(end_ns - start_ns) FROM spans
     WHERE trace_id = :t AND level = '{Level.SERVER}' AND kind = '{COMPUTE_INFER}'),
  (SELECT max(end_ns) - min(start_ns) FROM spans
     WHERE trace_id = :t AND level = '{Level.SERVER}' AND kind = '{TF_OP}'),
  (SELECT trimmed_mean_ns FROM level_stats WHERE trace_id = :t AND level = '{Level.MODEL}'),
  (SELECT json_extract(attributes, '{json_path(WINDOW_ATTRIBUTE)}') FROM spans
     WHERE trace_id = :t AND level = '{Level.REQUEST}' AND source = '{Source.PROXY}' LIMIT 1)
"""


def record(
    compute_infer_ns: float | None,
    tf_ops_ns: float | None,
    replay_ns: float | None,
    window: Any = None,
) -> dict[str, Any] | None:
    """The `fidelity` attribute from a trace's parts (None: nothing to say)."""
    live, source = (
        (compute_infer_ns, COMPUTE_INFER)
        if compute_infer_ns is not None
        else (tf_ops_ns, schema.LIVE_SOURCE_TF_OPS)
        if tf_ops_ns is not None
        else (None, None)
    )
    if live is None and window is None:
        return None
    out: dict[str, Any] = {schema.LIVE_COMPUTE_NS: live, schema.LIVE_SOURCE: source}
    out[schema.REPLAY_MODEL_NS] = replay_ns
    out[schema.RATIO] = replay_ns / live if replay_ns is not None and live else None
    if window is not None:
        out[WINDOW_ATTRIBUTE] = window
    return out


def refresh(conn: sqlite3.Connection, trace_ids: Iterable[str]) -> None:
    """Recompute the `fidelity` attribute of each trace that has a trace row (inside the
    caller's transaction)."""
    for trace_id in dict.fromkeys(trace_ids):
        row = conn.execute(_PARTS, {"t": trace_id}).fetchone()
        attributes_text, compute_infer, tf_ops, replay, window_text = row
        if attributes_text is None:
            continue  # the replay has not been written yet: it refreshes when it is
        window = json.loads(window_text) if window_text else None
        found = record(compute_infer, tf_ops, replay, window)
        try:
            attributes = json.loads(attributes_text) if attributes_text else {}
        except ValueError:
            continue  # a damaged row stays as it is (the report names it)
        if found is None or not isinstance(attributes, dict):
            continue
        if attributes.get(ATTRIBUTE) == found:
            continue
        attributes[ATTRIBUTE] = found
        conn.execute(
            "UPDATE traces SET attributes = ? WHERE trace_id = ?",
            (json.dumps(attributes, separators=(",", ":"), allow_nan=False), trace_id),
        )
