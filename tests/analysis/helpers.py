"""Independent expectations for the analysis tests: plain SQL on the checked-in trace
stores and plain arithmetic (no code from `analysis` is used here)."""

from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.trace.spans import Level, Source, Span, Trace, new_span_id
from sidecar.trace.store import TraceStore

DATA = Path(__file__).resolve().parent.parent / "data"
CPU_DB = DATA / "cpu" / "traces.sqlite"
GPU_DB = DATA / "gpu" / "traces.sqlite"
LIVE_DB = DATA / "live" / "traces.sqlite"
ENSEMBLE_DB = DATA / "ensemble" / "traces.sqlite"
REPO = Path(__file__).resolve().parents[2]


def q(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def tmean(values: Sequence[float]) -> float:
    """XSP trimmed mean: drop floor(20% of n) values at each end."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return math.nan
    k = int(len(vals) * 0.2)
    kept = vals[k : len(vals) - k]
    return sum(kept) / len(kept)


def trace_attr(db: Path, key: str) -> set[Any]:
    return {json.loads(a).get(key) for (a,) in q(db, "SELECT attributes FROM traces")}


def peaks(db: Path) -> tuple[float, float]:
    (a,) = q(db, "SELECT attributes FROM traces WHERE status='ok' LIMIT 1")[0]
    d = json.loads(a)
    return float(d["peak_flops_per_s"]), float(d["peak_dram_bytes_per_s"])


def model_latency(db: Path) -> dict[tuple[str, int], list[float]]:
    """(model, batch) -> the M run's trimmed-mean latency of each ok trace."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for model, batch, ns in q(
        db,
        "SELECT t.model, t.batch_size, l.trimmed_mean_ns FROM traces t JOIN level_stats l "
        "USING (trace_id) WHERE t.status='ok' AND l.level='model'",
    ):
        out[(model, batch)].append(ns)
    return out


def layer_rows(db: Path, run_level: str = "layer") -> list[dict[str, Any]]:
    """Layer spans of the given leveled run, with their trace's model and batch size."""
    rows = q(
        db,
        "SELECT t.trace_id, t.model, t.batch_size, s.name, s.idx, s.duration_ns, s.attributes "
        "FROM spans s JOIN traces t USING (trace_id) WHERE t.status='ok' AND s.level='layer' "
        "AND s.run_level=?",
        (run_level,),
    )
    out = []
    for tid, model, batch, name, idx, dur, attrs in rows:
        a = json.loads(attrs)
        out.append(
            {
                "trace": tid,
                "model": model,
                "batch": batch,
                "name": name,
                "idx": idx,
                "duration": dur,
                **a,
            }
        )
    return out


def kernel_rows(db: Path) -> list[dict[str, Any]]:
    """Kernel-level spans with the name of their layer (parent, or the launch's parent)."""
    rows = q(
        db,
        "SELECT t.trace_id, t.model, t.batch_size, k.name, k.kind, k.idx, k.duration_ns, "
        "k.start_ns, k.end_ns, k.attributes, p.level, p.name, g.level, g.name "
        "FROM spans k JOIN traces t USING (trace_id) "
        "LEFT JOIN spans p ON p.trace_id = k.trace_id AND p.span_id = k.parent_id "
        "LEFT JOIN spans g ON g.trace_id = p.trace_id AND g.span_id = p.parent_id "
        "WHERE k.level = 'kernel' AND t.status='ok'",
    )
    out = []
    for tid, model, batch, name, kind, idx, dur, start, end, attrs, pl, pn, gl, gn in rows:
        layer = pn if pl == "layer" else (gn if pl == "kernel" and gl == "layer" else None)
        out.append(
            {
                "trace": tid,
                "model": model,
                "batch": batch,
                "name": name,
                "kind": kind,
                "idx": idx,
                "duration": dur,
                "start": start,
                "end": end,
                "layer": layer,
                **json.loads(attrs),
            }
        )
    return out


def close(a: Any, b: Any, rel: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


MS = 1_000_000
T0 = 1_790_000_000_000_000_001  # epoch ns: placement must not lose precision


def relay_request(trace_id: str, span_id: str, marks: tuple[int, int, int, int] | None) -> Span:
    """The proxy's request span; `marks` (request start, request end forwarded, response's
    first byte, response end) in ns after T0, as the relay stores them (None: an old store)."""
    attributes = {}
    if marks is not None:
        keys = ("relay_request_start_ns", "relay_request_end_ns", "relay_response_start_ns",
                "relay_response_end_ns")  # fmt: skip
        attributes = {k: T0 + v for k, v in zip(keys, marks, strict=True)}
    end = marks[3] if marks else 10 * MS
    return Span(trace_id, span_id, None, Level.REQUEST, "ModelInfer", "ModelInfer", T0,
                T0 + end, Source.PROXY, attributes=attributes)  # fmt: skip


def server_spans(trace_id: str, parent: str, spans: dict[str, tuple[float, float]]) -> list[Span]:
    """Server spans of the given kinds, (start, end) in ms after T0."""
    return [
        Span(
            trace_id,
            new_span_id(),
            parent,
            Level.SERVER,
            kind,
            kind,
            T0 + int(a * MS),
            T0 + int(b * MS),
            Source.BACKEND,
        )
        for kind, (a, b) in spans.items()
    ]


def write_live(db: Path, traces: list[tuple[str, list[Span]]]) -> list[str]:
    store = TraceStore(db)
    ids = []
    for n, (model, spans) in enumerate(traces):
        trace_id = spans[0].trace_id
        store.write_trace(Trace(trace_id, model, created_ns=n + 1, batch_size=1), spans)
        ids.append(trace_id)
    store.close()
    return ids


def parquet_rows(out: Path, table: str) -> list[tuple[object, ...]]:
    """Every row of one table of an `export-parquet` folder, in a fixed order."""
    import duckdb

    con = duckdb.connect()
    try:
        return sorted(con.sql(f"SELECT * FROM '{out}/{table}/*.parquet'").fetchall(), key=str)
    finally:
        con.close()
