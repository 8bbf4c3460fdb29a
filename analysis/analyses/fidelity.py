"""Fidelity: whether a sampled request's replay ran as the server ran it.

A profile of a replayed copy is worth what the copy is worth. For every sampled live request
the store keeps the backend's own compute time (Triton's `compute_infer` span, TF-Serving's op
envelope) and the replay's model latency (M) of the same input, and their ratio (trace
attribute `fidelity`, `sidecar.trace.fidelity`). Per model and batch size this analysis gives
the number of requests, p50 and p90 of replay / live, a verdict (within `REPRESENTS` the
replay represents the server; otherwise it does not) and the differences between the server
and the replay that the traces' evidence supports (the causes, when it does not):

- the server runs the model inside a Python-backend model (`backend: python`): the replay runs
  only the model file, not the stub process, its IPC and tensor copies;
- the server runs on another device or execution accelerator than the replay;
- settings of the server's config.pbtxt the replay could not apply (`replay_settings`), and
  threads: an ONNX Runtime model whose config sets no thread count runs on the server with
  ONNX Runtime's default (one thread per core), the replay with the worker's one;
- the server computed the request inside larger batches (the request's batch window,
  `server_batch_window`): the live compute is then also compared with the replay at the batch
  size the server ran, where one was profiled;
- other executions of the model in the request's window (concurrent requests: contention).

Requests sampled because they were slow (`sample_reason` = `slow`) are compared with the
other replays of their model and batch size: a slow request whose replay is also slow
(`SLOW_REPRODUCED` times their median) was slow because of its input; one whose replay is not
was slow because of the server's queue, batching or contention.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.analyses import ensemble_steps
from analysis.analyses.common import AnalysisResult, Frames, empty_result, not_captured
from analysis.analyses.fidelity_attrs import (  # noqa: F401  (the rules per trace, as `fidelity` names them)
    ONNXRUNTIME_BACKEND,
    PYTHON_BACKEND,
    _attrs,
    _causes,
    number,
    request_fields,
)
from sidecar.trace import schema
from sidecar.trace.schema import Level
from sidecar.trace.spans import LIVE_ONLY

TITLE = "Fidelity of the replay (replay's model time vs the server's own compute time)"
REPRESENTS = (0.8, 1.25)  # p50 of replay / live within this range: the replay represents it
SLOW_REPRODUCED = 1.5  # a slow request's replay this many times its peers' median: input-bound
LIVE_REASONS = ("rate", "random", "forced")  # sampled from live traffic with a traceparent
NONE_RECORDED = "none recorded (same backend, device and settings as far as the traces record them)"
SAME_KERNELS = "same_kernels"  # extra: per group, whether shares of layer time may hold


def per_request(fr: Frames) -> pd.DataFrame:
    """One row per sampled trace: model, batch_size, sample_reason, live_ns, replay_ns, ratio,
    the server's executed batch sizes in the request's window, the evidence of causes and
    `live_only` (no replay can run its model)."""
    tr = fr.data.traces
    rows = []
    replay = fr.model_latency.set_index("tkey")["latency_ns"]
    from_spans = _live_from_spans(fr)
    for t in tr.itertuples(index=False):
        fields = request_fields(_attrs(t.attributes))
        reason = str(t.sample_reason or "")
        spans = from_spans.get(int(t.tkey))
        if not fields["fidelity_kept"] and spans:  # a store older than the attribute
            fields.update(spans)
        elif not fields["fidelity_kept"] and reason != "slow":
            continue
        rows.append(
            {
                "tkey": int(t.tkey),
                "model": str(t.model),
                "batch_size": t.batch_size,
                "sample_reason": reason,
                "live_ns": fields["live_ns"],
                schema.LIVE_SOURCE: fields[schema.LIVE_SOURCE],
                "replay_ns": number(replay.get(int(t.tkey))),
                "server_batch_sizes": fields["server_batch_sizes"],
                "window_executions": fields["window_executions"],
                "window_note": fields["window_note"],
                "causes": fields["causes"],
                "from_spans": bool(spans) and not fields["fidelity_kept"],
                "live_only": t.status == LIVE_ONLY,
            }
        )
    cols = ["tkey", "model", "batch_size", "sample_reason", "live_ns", schema.LIVE_SOURCE,
            "replay_ns", "server_batch_sizes", "window_executions", "window_note", "causes",
            "from_spans", "live_only"]  # fmt: skip
    out = pd.DataFrame(rows, columns=cols)
    out["ratio"] = out["replay_ns"] / out["live_ns"].where(out["live_ns"] > 0)
    return out


def _live_from_spans(fr: Frames) -> dict[int, dict[str, Any]]:
    """Per trace: the live compute time from its backend spans, as `sidecar.trace.fidelity`
    records it (for traces stored before the store kept the `fidelity` attribute)."""
    srv = fr.at(Level.SERVER)
    out: dict[int, dict[str, Any]] = {}
    infer = srv[srv["kind"] == schema.COMPUTE_INFER]
    for tkey, ns in (
        (infer["end_ns"] - infer["start_ns"]).groupby(infer["tkey"], observed=True).sum().items()
    ):
        out[int(tkey)] = {"live_ns": float(ns), schema.LIVE_SOURCE: schema.COMPUTE_INFER}
    ops = srv[srv["kind"] == schema.TF_OP].groupby("tkey", observed=True).agg(
        start=("start_ns", "min"), end=("end_ns", "max"))  # fmt: skip
    for tkey, row in ops.iterrows():
        out.setdefault(int(tkey), {"live_ns": float(row["end"] - row["start"]),
                                   schema.LIVE_SOURCE: schema.LIVE_SOURCE_TF_OPS})  # fmt: skip
    return out


def batch_causes(grp: pd.DataFrame, batch: Any) -> list[str]:
    out = []
    sizes = sorted({s for v in grp["server_batch_sizes"] for s in v})
    if sizes and not pd.isna(batch) and max(sizes) > int(batch):
        out.append(
            "the server computed these requests inside batches of up to "
            f"{max(sizes)} (dynamic batching; executed sizes {', '.join(map(str, sizes))})"
        )
    busy = grp["window_executions"].dropna()
    if not busy.empty and busy.max() > 1:
        out.append(
            f"up to {int(busy.max())} executions of the model ran in a request's window "
            "(concurrent requests: queueing or contention on the server)"
        )
    return out


def _at_server_batch(every: pd.DataFrame, grp: pd.DataFrame) -> float:
    """p50 over the group's requests the server ran in one execution of another batch size
    B: the replay's M at batch B (median over traces profiled at B) / the live compute."""
    ratios = []
    for row in grp.itertuples(index=False):
        sizes = row.server_batch_sizes
        if len(sizes) != 1 or pd.isna(row.live_ns) or row.window_executions != 1:
            continue
        if pd.isna(row.batch_size):  # a model without a batch dimension: no batch to compare
            continue
        peers = every[(every["model"] == row.model) & (every["batch_size"] == sizes[0])]
        replay = peers["replay_ns"].dropna()
        if sizes[0] != row.batch_size and not replay.empty:
            ratios.append(float(replay.median()) / row.live_ns)
    return float(np.median(ratios)) if ratios else float("nan")


def fidelity(fr: Frames) -> AnalysisResult:
    if fr.data.empty:
        return empty_result("fidelity", TITLE)
    every = per_request(fr)
    live = every[every["sample_reason"] != "slow"]
    measured = live.dropna(subset=["ratio"])
    slow = every[every["sample_reason"] == "slow"]
    if measured.empty and slow.empty:
        reasons = fr.data.traces["sample_reason"].astype(str).value_counts().to_dict()
        with_live = int(every["live_ns"].notna().sum()) if not every.empty else 0
        live_only = int(every["live_only"].sum()) if not every.empty else 0
        why = [why_none(reasons, with_live, live_only), *ensemble_steps.fidelity_notes(fr)]
        return not_captured("fidelity", TITLE, "; ".join(why))
    rows, same_kernels = [], {}
    keys = ["model", "batch_size"]
    for (model, batch), grp in pd.concat([measured, slow]).groupby(
        keys, dropna=False, sort=True, observed=True
    ):
        ok = grp[grp["sample_reason"] != "slow"].dropna(subset=["ratio"])
        p50 = float(ok["ratio"].median()) if not ok.empty else float("nan")
        causes = dict.fromkeys(c for cs in ok["causes"] for c in cs)
        reasons = [c for c, _ in causes] + batch_causes(ok, batch)
        if not reasons:
            reasons = [NONE_RECORDED]
        same_kernels[f"{model}|{batch}"] = all(same for _, same in causes)
        reproduced, slow_n = _slow(every, model, batch)
        rows.append(
            {
                "model": model,
                "batch_size": batch,
                "requests": len(ok),
                "live_p50_ms": float(ok["live_ns"].median()) / 1e6 if not ok.empty else np.nan,
                "replay_p50_ms": float(ok["replay_ns"].median()) / 1e6 if not ok.empty else np.nan,
                "ratio_p50": p50,
                "ratio_p90": float(ok["ratio"].quantile(0.9)) if not ok.empty else np.nan,
                "ratio_at_server_batch_p50": _at_server_batch(every, ok),
                "verdict": verdict(len(ok), p50),
                "differences": "; ".join(reasons),
                "slow_requests": slow_n,
                "slow_reproduced": reproduced,
            }
        )
    table = pd.DataFrame(rows)
    res = AnalysisResult("fidelity", TITLE, table)
    res.extra[SAME_KERNELS] = same_kernels
    res.notes.append(RATIO_NOTE)
    res.notes += _notes(every, live)
    res.notes += ensemble_steps.fidelity_notes(fr)
    return res


RATIO_NOTE = (
    "ratio = the replay's model time (M, trimmed mean) / the server's own compute time of "
    "the same request (Triton: compute_infer; TF-Serving: its op envelope); "
    f"{REPRESENTS[0]}-{REPRESENTS[1]}: the replay represents the server; "
    "ratio_at_server_batch: the same against the replay at the batch size the server ran"
)


def verdict(requests: int, ratio_p50: float) -> str:
    """The verdict on one model and batch size, from its measured requests' p50 ratio."""
    if not requests:
        return "no live compute time (slow requests only)"
    if REPRESENTS[0] <= ratio_p50 <= REPRESENTS[1]:
        return "the replay represents the server"
    return "the replay does not represent the server"


def _slow(every: pd.DataFrame, model: Any, batch: Any) -> tuple[int | None, int]:
    """For one model and batch size: how many slow requests' replays reproduced their
    slowness (None: no replay of another sample to compare with), and how many slow
    requests there are."""
    same = (every["model"] == model) & (
        every["batch_size"].isna() if pd.isna(batch) else every["batch_size"] == batch
    )
    slow = every[same & (every["sample_reason"] == "slow")]
    peers = every[same & (every["sample_reason"] != "slow")]["replay_ns"].dropna()
    replayed = slow["replay_ns"].dropna()
    if replayed.empty or peers.empty:
        return None, len(slow)
    return int((replayed >= SLOW_REPRODUCED * float(peers.median())).sum()), len(slow)


def why_none(reasons: dict[str, int], with_live: int, live_only: int = 0) -> str:
    """Why no request can be compared: `reasons`, the traces per sample reason; `with_live`,
    the sampled requests with the backend's compute time; `live_only`, the live-only ones
    among the samples (no replay can run their model)."""
    live = sum(n for r, n in reasons.items() if r in LIVE_REASONS)
    if not live:
        return (
            "no trace sampled from live traffic (the selected traces come from "
            f"{', '.join(sorted(reasons))}): there is no server compute time to compare"
        )
    if with_live == 0:
        return (
            f"none of the {live} live samples has the backend's own compute time "
            "(no backend span: Triton's tracing is off or its spans did not arrive; "
            "TF-Serving needs --tf-profiler-address)"
        )
    if live_only >= with_live:
        return (
            f"{with_live} live samples have the backend's compute time but no replay to "
            "compare: they are live-only (no replay can run their model; trace attribute "
            "`replay` says why)"
        )
    return (
        f"{with_live} live samples have the backend's compute time but no replay to compare "
        "(their profiles failed)"
    )


def _notes(every: pd.DataFrame, live: pd.DataFrame) -> list[str]:
    notes = []
    older = int(live["from_spans"].sum())
    if older:
        notes.append(
            f"{older} traces were stored before the sidecar kept their fidelity: the "
            "server's compute time is read from their backend spans (no batch window)"
        )
    no_live = int(live["live_ns"].isna().sum())
    if no_live:
        notes.append(
            f"{no_live} sampled requests have no backend compute span (tracing off or the "
            "spans did not arrive) and are left out"
        )
    no_replay = live["live_ns"].notna() & live["replay_ns"].isna()
    failed = int((no_replay & ~live["live_only"].astype(bool)).sum())
    if failed:
        notes.append(f"{failed} sampled requests have no replay (failed profiles)")
    live_only = int((no_replay & live["live_only"].astype(bool)).sum())
    if live_only:
        notes.append(
            f"{live_only} sampled requests are live-only (no replay can run their model): "
            "their server compute time is in the live breakdown, with nothing to compare"
        )
    unobserved = live["window_note"].dropna()
    if not unobserved.empty:
        first = str(unobserved.iloc[0])
        notes.append(
            f"{len(unobserved)} requests' batch windows were not observed, so the batches "
            f"the server ran are unknown for them (e.g. {first})"
        )
    if (every["sample_reason"] == "slow").any():
        notes.append(
            "slow_reproduced: slow-sampled requests whose replay took at least "
            f"{SLOW_REPRODUCED}x the median replay of the model's other samples at that batch "
            "size (their input makes the model slow: the layer table shows where); the others "
            "were slow on the server only (queueing, batching or contention: the live "
            "breakdown shows which phase)"
        )
    return notes
