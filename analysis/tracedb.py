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
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

# Span attribute keys (docs/contracts.md) extracted into columns of `TraceData.spans`, and
# the spans they are read from (each json_extract parses the JSON again, so only where used).
LAYER_ATTRIBUTES: tuple[str, ...] = (
    "op_type",
    "input_shapes",
    "output_shapes",
    "allocated_bytes",
    "flops_estimated",
    "bytes_estimated",
)
WORK_ATTRIBUTES: tuple[str, ...] = ("achieved_occupancy", "metrics_estimated", "stream")
SHARED_ATTRIBUTES: tuple[str, ...] = ("flops", "dram_read_bytes", "dram_write_bytes")
SPAN_ATTRIBUTE_COLUMNS = (*LAYER_ATTRIBUTES, *SHARED_ATTRIBUTES, *WORK_ATTRIBUTES)
_LAYER_SCALARS = tuple(
    k for k in (*LAYER_ATTRIBUTES, *SHARED_ATTRIBUTES) if k not in ("input_shapes", "output_shapes")
)
_WORK_SCALARS = (*SHARED_ATTRIBUTES, *WORK_ATTRIBUTES)
_IS_LAYER = "s.level = 'layer'"
_IS_WORK = "s.level = 'kernel' AND s.kind NOT IN ('runtime', 'driver')"
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
    uri = path.resolve().as_uri()
    try:
        try:
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True)
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
        except sqlite3.OperationalError:
            # A WAL-mode store in a directory we cannot write (no -shm file can be created):
            # read the file as it is on disk.
            conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True)
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
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
        # One json_extract per span with several paths returns a JSON array (one parse per
        # span in SQLite, one json.loads for all of them in Python); shapes stay JSON text.
        layer_paths = ", ".join(f"'$.{k}'" for k in _LAYER_SCALARS)
        work_paths = ", ".join(f"'$.{k}'" for k in _WORK_SCALARS)
        extracts = [
            f"CASE WHEN {_IS_LAYER} THEN json_extract(s.attributes, {layer_paths}) "
            f"WHEN {_IS_WORK} THEN json_extract(s.attributes, {work_paths}) END AS _attrs",
            *(
                f"CASE WHEN {_IS_LAYER} THEN json_extract(s.attributes, '$.{k}') END AS {k}"
                for k in ("input_shapes", "output_shapes")
            ),
        ]
        sub = f"SELECT trace_id FROM traces{where}"
        # Selecting a few traces: let SQLite pick their rows. Otherwise reading every row and
        # dropping those of failed traces afterwards is faster than a lookup per row.
        narrow = bool(flt.models or flt.trace_ids or flt.batch_sizes or flt.since_ns is not None)
        # A kernel's layer: its parent, or (kernel launched by a runtime API call) the
        # launch's parent. Joined here on the primary key, which is cheap in SQLite. The CUDA
        # API records themselves (runtime/driver) serve only this join and the timeline
        # export (which reads its trace in full), so the bulk load leaves them out.
        spans = pd.read_sql_query(
            "SELECT s.trace_id, s.level, s.name, s.kind, s.start_ns, "
            f"s.end_ns, s.duration_ns, s.run_level, s.idx, {', '.join(extracts)}, "
            "CASE WHEN p.level = 'layer' THEN p.name WHEN g.level = 'layer' THEN g.name END "
            "AS layer FROM spans s "
            "LEFT JOIN spans p ON s.level = 'kernel' AND p.trace_id = s.trace_id "
            "AND p.span_id = s.parent_id "
            "LEFT JOIN spans g ON p.level = 'kernel' AND g.trace_id = p.trace_id "
            "AND g.span_id = p.parent_id "
            "WHERE NOT (s.level = 'kernel' AND s.kind IN ('runtime', 'driver'))"
            + (f" AND s.trace_id IN ({sub})" if narrow else ""),
            conn,
            params=params if narrow else None,
        )
        stats = pd.read_sql_query(
            "SELECT trace_id, level, iterations, warmup, trimmed_mean_ns, median_ns, min_ns, "
            "max_ns, overhead_ratio FROM level_stats"
            + (f" WHERE trace_id IN ({sub})" if narrow else ""),
            conn,
            params=params if narrow else None,
        )
    except sqlite3.DatabaseError as exc:
        raise TraceStoreError(f"{path}: cannot read the trace store ({exc})") from None
    finally:
        conn.close()
    return traces, spans, stats, skipped


_NUMERIC = ("allocated_bytes", "flops", "dram_read_bytes", "dram_write_bytes",
            "achieved_occupancy")  # fmt: skip
_FLAGS = ("flops_estimated", "bytes_estimated", "metrics_estimated")


def _as_float(values: Sequence[object]) -> np.ndarray:
    try:
        return np.array(values, dtype="float64")  # None -> NaN
    except (TypeError, ValueError):  # a producer wrote a string: keep what parses
        return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy("float64")


def _unpack_attributes(spans: pd.DataFrame) -> dict[str, np.ndarray]:
    """Typed columns from the `_attrs` JSON arrays (layer or kernel scalars)."""
    texts = spans["_attrs"].to_numpy()
    is_layer = (spans["level"] == "layer").to_numpy()
    has = pd.notna(texts)
    n = len(spans)
    columns: dict[str, np.ndarray] = {k: np.full(n, np.nan) for k in (*_NUMERIC, *_FLAGS)}
    columns.update({k: np.full(n, None, dtype=object) for k in ("op_type", "stream")})
    for mask, keys in ((has & is_layer, _LAYER_SCALARS), (has & ~is_layer, _WORK_SCALARS)):
        if not mask.any():
            continue
        parsed = json.loads("[" + ",".join(texts[mask]) + "]")
        for key, values in zip(keys, zip(*parsed, strict=True), strict=True):
            if key in columns and columns[key].dtype == object:
                columns[key][mask] = values
            else:
                columns[key][mask] = _as_float(values)
    for key in _FLAGS:
        columns[key] = columns[key] > 0
    return columns


def _normalize(traces: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """Typed columns that do not depend on which values a database happens to hold; returns
    the spans frame with the attribute columns."""
    traces["attributes"] = [json.loads(a) if a else {} for a in traces["attributes"]]
    traces["batch_size"] = traces["batch_size"].astype("Int64")
    for col in ("peak_flops_per_s", "peak_dram_bytes_per_s"):
        traces[col] = pd.to_numeric(traces[col], errors="coerce")
    start = spans["start_ns"].to_numpy("int64")
    end = spans["end_ns"].to_numpy("int64")
    duration = pd.to_numeric(spans["duration_ns"], errors="coerce").to_numpy("float64")
    columns = {
        "start_ns": start,
        "end_ns": end,
        "duration_ns": np.where(np.isnan(duration), end - start, duration).astype("int64"),
        "idx": pd.to_numeric(spans["idx"], errors="coerce").fillna(0).to_numpy("int64"),
        **_unpack_attributes(spans),
    }
    rest = spans.drop(columns=["_attrs", "start_ns", "end_ns", "duration_ns", "idx"])
    return pd.concat([rest, pd.DataFrame(columns, index=spans.index)], axis=1)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    non_empty = [f for f in frames if not f.empty]
    if len(non_empty) == 1:
        return non_empty[0].reset_index(drop=True)
    with warnings.catch_warnings():  # all-NA attribute columns in one source are expected
        warnings.simplefilter("ignore", FutureWarning)
        return pd.concat(non_empty or frames[:1], ignore_index=True)


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
        spans = _normalize(traces, spans)
        skipped += n_skipped
        source = str(raw)
        sources.append(source)
        keys = pd.Series(range(next_key, next_key + len(traces)), index=traces["trace_id"])
        next_key += len(traces)
        mask = spans["trace_id"].isin(keys.index)
        if not mask.all():  # spans of failed traces
            spans = spans[mask].reset_index(drop=True)
        stats = stats[stats["trace_id"].isin(keys.index)].reset_index(drop=True)
        for df in (traces, spans, stats):
            df.insert(0, "source_db", source)
            df.insert(1, "tkey", df["trace_id"].map(keys).astype("int64"))
        all_traces.append(traces)
        all_spans.append(spans)
        all_stats.append(stats)
    traces, spans, stats = (_concat(f) for f in (all_traces, all_spans, all_stats))
    return TraceData(traces, spans, stats, sources, skipped)


def trace_spans(source: str | Path, trace_id: str) -> list[dict[str, Any]]:
    """Every column and attribute of one trace's spans (for exports that show everything;
    the bulk load keeps only what the analyses need)."""
    conn = _connect_ro(Path(source))
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(
            "SELECT * FROM spans WHERE trace_id = ? ORDER BY start_ns, idx", (trace_id,)
        ).fetchall()
    finally:
        conn.close()
    out = []
    for r in rows:
        d = dict(r)
        d["attributes"] = json.loads(d["attributes"]) if d["attributes"] else {}
        out.append(d)
    return out
