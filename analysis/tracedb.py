"""Load one or more SQLite trace stores into pandas DataFrames, read-only.

Each database is one source (e.g. one pod of a fleet). Every row keeps its `source_db`, and
`tkey` (an integer unique across all loaded databases) identifies a trace even when two
databases hold the same trace id. Span attributes that the analyses read are pulled out of
the JSON column by SQLite (`json_extract`) so that loading stays fast on large stores.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

# Span attribute keys (docs/contracts.md) extracted into columns of `TraceData.spans`.
SPAN_ATTRIBUTE_COLUMNS: tuple[str, ...] = (
    "op_type",
    "input_shapes",
    "output_shapes",
    "allocated_bytes",
    "activation_bytes",
    "parameter_bytes",
    "output_bytes",
    "flops",
    "flops_estimated",
    "dram_read_bytes",
    "dram_write_bytes",
    "bytes_estimated",
    "achieved_occupancy",
    "metrics_estimated",
    "correlation_id",
    "stream",
    "parent_ambiguous",
    "grpc_code",
)
# Trace attribute keys extracted into columns of `TraceData.traces`.
TRACE_ATTRIBUTE_COLUMNS: tuple[str, ...] = (
    "peak_flops_per_s",
    "peak_dram_bytes_per_s",
    "peak_source",
    "kernel_level",
    "graph_optimizations",
    "layer_names",
    "synthetic",
)
_REQUIRED_TABLES = ("traces", "spans", "level_stats")


class TraceStoreError(Exception):
    """A database could not be read as an xsp-sidecar trace store."""


@dataclass(frozen=True)
class TraceFilter:
    """Which traces to load. Empty fields select everything."""

    models: tuple[str, ...] = ()
    trace_ids: tuple[str, ...] = ()  # full ids or unique prefixes
    batch_sizes: tuple[int, ...] = ()
    since_ns: int | None = None  # created_ns >= since_ns
    include_errors: bool = False  # traces with status != 'ok'


@dataclass
class TraceData:
    """Traces, spans and level statistics of the selected traces, from all sources."""

    traces: pd.DataFrame
    spans: pd.DataFrame
    level_stats: pd.DataFrame
    sources: list[str] = field(default_factory=list)
    skipped_errors: int = 0  # traces left out because their profile failed

    @property
    def empty(self) -> bool:
        return self.traces.empty

    def subset(self, tkeys: Sequence[int] | pd.Series) -> TraceData:
        """The same data restricted to some traces."""
        keys = set(int(k) for k in tkeys)
        return TraceData(
            traces=self.traces[self.traces["tkey"].isin(keys)].reset_index(drop=True),
            spans=self.spans[self.spans["tkey"].isin(keys)].reset_index(drop=True),
            level_stats=self.level_stats[self.level_stats["tkey"].isin(keys)].reset_index(
                drop=True
            ),
            sources=list(self.sources),
            skipped_errors=0,
        )


def parse_since(text: str, now_ns: int | None = None) -> int:
    """`--since` value to epoch ns: a duration back from now (`30m`, `2h`, `7d`, `45s`),
    an ISO date/time (`2026-01-31`, `2026-01-31T12:00:00`, UTC unless it has an offset),
    or epoch nanoseconds."""
    now = time.time_ns() if now_ns is None else now_ns
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - int(float(text[:-1]) * units[text[-1]] * 1e9)
    if text.isdigit():
        return int(text)
    try:
        stamp = pd.Timestamp(text)
    except ValueError:
        raise ValueError(
            f"cannot read --since {text!r}: give a duration like 30m, 2h or 7d, an ISO "
            "date/time like 2026-01-31T12:00, or epoch nanoseconds"
        ) from None
    if stamp.tzinfo is None:
        stamp = stamp.tz_localize("UTC")
    return int(stamp.value)


def _connect_ro(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise TraceStoreError(f"{path}: no such file (expected an xsp-sidecar trace database)")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise TraceStoreError(f"{path}: not a readable SQLite database ({exc})") from None
    missing = [t for t in _REQUIRED_TABLES if t not in names]
    if missing:
        conn.close()
        raise TraceStoreError(
            f"{path}: not an xsp-sidecar trace store (missing tables: {', '.join(missing)}); "
            "produce one with `xsp-sidecar profile --db FILE` or `xsp-sidecar serve --db FILE`"
        )
    return conn


def _where(flt: TraceFilter) -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    if not flt.include_errors:
        clauses.append("status = 'ok'")
    if flt.models:
        clauses.append(f"model IN ({','.join('?' * len(flt.models))})")
        params.extend(flt.models)
    if flt.batch_sizes:
        clauses.append(f"batch_size IN ({','.join('?' * len(flt.batch_sizes))})")
        params.extend(flt.batch_sizes)
    if flt.trace_ids:
        clauses.append("(" + " OR ".join("trace_id LIKE ? || '%'" for _ in flt.trace_ids) + ")")
        params.extend(flt.trace_ids)
    if flt.since_ns is not None:
        clauses.append("created_ns >= ?")
        params.append(flt.since_ns)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def _load_one(path: Path, flt: TraceFilter) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, int]:
    conn = _connect_ro(path)
    try:
        where, params = _where(flt)
        trace_attr_cols = ", ".join(
            f"json_extract(attributes, '$.{k}') AS {k}" for k in TRACE_ATTRIBUTE_COLUMNS
        )
        traces = pd.read_sql_query(
            "SELECT trace_id, model, model_version, batch_size, runtime, device, sample_reason, "
            f"sidecar_version, status, error, created_ns, attributes, {trace_attr_cols} "
            f"FROM traces{where} ORDER BY created_ns, trace_id",
            conn,
            params=params,
        )
        err_where, err_params = _where(TraceFilter(**{**flt.__dict__, "include_errors": True}))
        n_all = conn.execute(f"SELECT COUNT(*) FROM traces{err_where}", err_params).fetchone()[0]
        skipped = int(n_all) - len(traces)
        span_attr_cols = ", ".join(
            f"json_extract(s.attributes, '$.{k}') AS {k}" for k in SPAN_ATTRIBUTE_COLUMNS
        )
        sub = f"SELECT trace_id FROM traces{where}"
        spans = pd.read_sql_query(
            "SELECT s.trace_id, s.span_id, s.parent_id, s.level, s.name, s.kind, s.start_ns, "
            f"s.end_ns, s.duration_ns, s.source, s.run_level, s.idx, {span_attr_cols} "
            f"FROM spans s WHERE s.trace_id IN ({sub})",
            conn,
            params=params,
        )
        stats = pd.read_sql_query(
            "SELECT trace_id, level, iterations, warmup, trimmed_mean_ns, median_ns, min_ns, "
            f"max_ns, overhead_ratio FROM level_stats WHERE trace_id IN ({sub})",
            conn,
            params=params,
        )
    except sqlite3.DatabaseError as exc:
        raise TraceStoreError(f"{path}: cannot read the trace store ({exc})") from None
    finally:
        conn.close()
    return traces, spans, stats, skipped


def load_traces(paths: Sequence[str | Path], flt: TraceFilter | None = None) -> TraceData:
    """Read the selected traces of every database in `paths` (opened read-only)."""
    flt = flt or TraceFilter()
    if not paths:
        raise TraceStoreError("no trace database given")
    all_traces, all_spans, all_stats = [], [], []
    skipped = 0
    sources: list[str] = []
    next_key = 0
    for raw in paths:
        path = Path(raw)
        traces, spans, stats, n_skipped = _load_one(path, flt)
        skipped += n_skipped
        source = str(raw)
        sources.append(source)
        keys = pd.Series(range(next_key, next_key + len(traces)), index=traces["trace_id"])
        next_key += len(traces)
        for df in (traces, spans, stats):
            df.insert(0, "source_db", source)
            df.insert(1, "tkey", df["trace_id"].map(keys).astype("int64"))
        all_traces.append(traces)
        all_spans.append(spans)
        all_stats.append(stats)
    traces = pd.concat(all_traces, ignore_index=True)
    spans = pd.concat(all_spans, ignore_index=True)
    stats = pd.concat(all_stats, ignore_index=True)
    traces["attributes"] = [json.loads(a) if a else {} for a in traces["attributes"]]
    traces["batch_size"] = traces["batch_size"].astype("Int64")
    for col in ("peak_flops_per_s", "peak_dram_bytes_per_s"):
        traces[col] = pd.to_numeric(traces[col], errors="coerce")
    for col in (
        "allocated_bytes", "activation_bytes", "parameter_bytes", "output_bytes", "flops",
        "dram_read_bytes", "dram_write_bytes", "achieved_occupancy",
    ):  # fmt: skip
        spans[col] = pd.to_numeric(spans[col], errors="coerce").astype("float64")
    for col in ("flops_estimated", "bytes_estimated", "metrics_estimated", "parent_ambiguous"):
        spans[col] = spans[col].fillna(0).astype(bool)
    for col in ("start_ns", "end_ns"):
        spans[col] = spans[col].astype("int64")
    spans["duration_ns"] = (
        pd.to_numeric(spans["duration_ns"], errors="coerce")
        .fillna(spans["end_ns"] - spans["start_ns"])
        .astype("int64")
    )
    spans["idx"] = pd.to_numeric(spans["idx"], errors="coerce").fillna(0).astype("int64")
    return TraceData(traces, spans, stats, sources, skipped)
