"""Export one trace as Chrome / Perfetto trace-event JSON (opens in ui.perfetto.dev).

Live spans (proxy and backend) and replay spans (the leveled runs) go to separate processes;
inside each, one track (thread) per level. The kernel level is split into host-side calls
(CUDA API, CPU ops) and one track per GPU stream, because those overlap in time. Times are
microseconds from the trace's first span; `dur` is the span's length on the representative
timeline, and `args.duration_ns` the level's statistic (trimmed mean).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.load.trace_filter import TraceNotFoundError
from analysis.load.tracedb import TraceData, trace_spans

LIVE_PID = 1
REPLAY_PID = 2
_TRACKS = {"request": 1, "server": 2, "model": 10, "layer": 11}  # level -> tid
_TRACK_NAMES = {
    1: "request (proxy)",
    2: "server (backend)",
    10: "model (M run)",
    11: "layer (L run)",
    20: "kernel: host calls / CPU ops",
}
_DEVICE_KINDS = {"kernel", "memcpy", "memset"}


def find_trace(data: TraceData, trace_id: str) -> int:
    """The tkey of the trace whose id is `trace_id` or starts with it (must be unique)."""
    t = data.traces
    exact = t[t["trace_id"] == trace_id]
    hits = exact if not exact.empty else t[t["trace_id"].str.startswith(trace_id)]
    if hits.empty:
        known = ", ".join(t["trace_id"].head(5)) + (", ..." if len(t) > 5 else "")
        raise TraceNotFoundError(
            f"no trace {trace_id!r} in {', '.join(data.sources)} among the selected traces "
            f"(they are: {known or 'none'}; check the filters)"
        )
    if len(hits) > 1:
        ids = ", ".join(f"{r.trace_id} ({r.source_db})" for r in hits.itertuples())
        raise TraceNotFoundError(f"trace id {trace_id!r} is ambiguous: {ids}")
    return int(hits["tkey"].iloc[0])


def _track(span: dict[str, Any]) -> tuple[int, int, str | None]:
    """(pid, tid, track name if not a fixed one) of a span: live vs replay by source."""
    level, kind = span["level"], span["kind"]
    live = span["source"] in ("proxy", "backend")
    if level in _TRACKS:
        return (LIVE_PID if live else REPLAY_PID), _TRACKS[level], None
    if level == "kernel" and kind in _DEVICE_KINDS:
        stream = span["attributes"].get("stream", 0)
        try:
            n = int(stream)
        except (TypeError, ValueError):
            n = abs(hash(str(stream))) % 1000
        return REPLAY_PID, 100 + n, f"kernel: GPU stream {stream}"
    if level == "kernel":
        return REPLAY_PID, 20, None
    return (LIVE_PID if live else REPLAY_PID), 90, f"other: {level}"


def trace_events(data: TraceData, trace_id: str) -> dict[str, Any]:
    """The trace-event JSON object (`traceEvents`, ...) for one trace."""
    tkey = find_trace(data, trace_id)
    head = data.traces[data.traces["tkey"] == tkey].iloc[0]
    spans = trace_spans(head["source_db"], str(head["trace_id"]))
    t0 = min((int(sp["start_ns"]) for sp in spans), default=0)
    events: list[dict[str, Any]] = []
    names: dict[tuple[int, int], str] = {}
    for sp in spans:
        pid, tid, track_name = _track(sp)
        names.setdefault((pid, tid), track_name or _TRACK_NAMES[tid])
        args: dict[str, Any] = {
            "span_id": sp["span_id"],
            "parent_id": sp["parent_id"],
            "kind": sp["kind"],
            "source": sp["source"],
            "run_level": sp["run_level"],
            "index": sp["idx"],
            "duration_ns": sp["duration_ns"],
        }
        for key, value in sp["attributes"].items():
            args.setdefault(key, value)
        start, end = int(sp["start_ns"]), int(sp["end_ns"])
        events.append(
            {
                "name": sp["name"],
                "cat": f"{sp['level']},{sp['source']}",
                "ph": "X",
                "ts": (start - t0) / 1000.0,
                "dur": max(end - start, 0) / 1000.0,
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )
    runtime = f"{head['runtime']} on {head['device']}".strip()
    meta = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": LIVE_PID,
            "tid": 0,
            "args": {"name": "live: proxy + backend"},
        },
        {
            "name": "process_name",
            "ph": "M",
            "pid": REPLAY_PID,
            "tid": 0,
            "args": {"name": f"replay: {runtime}"},
        },
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": LIVE_PID,
            "tid": 0,
            "args": {"sort_index": 1},
        },
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": REPLAY_PID,
            "tid": 0,
            "args": {"sort_index": 2},
        },
    ]
    for (pid, tid), name in sorted(names.items()):
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        meta.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "trace_id": str(head["trace_id"]),
            "model": str(head["model"]),
            "model_version": str(head["model_version"]),
            "batch_size": None if pd.isna(head["batch_size"]) else int(head["batch_size"]),
            "source_db": str(head["source_db"]),
            "start_ns": t0,
        },
    }
