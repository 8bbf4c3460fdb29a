"""A fleet's traces as Parquet, and the fleet-level analyses over them in DuckDB SQL.

One SQLite store per pod is right for a pod; a fleet of hundreds is analysed columnar:
`export_parquet` writes each store's rows (as `analysis.tracedb` loads them, so damaged rows
are left out the same way, layer types are resolved the same way, and the CUDA runtime/driver
API records, which only place kernels under their layers, are not carried) to
`DIR/{traces,spans,level_stats}/NNNN-<db>.parquet`, files that DuckDB, Spark or Trino read
as they are. `fleet_tables` runs the per-model analyses over `DIR` with DuckDB in process:
traces per model, model latency per batch size, layer type shares, top layers by time and the
live request breakdown. The numbers follow the single-store report's rules (trimmed means over
traces cutting `TRIM` at each end, the L run's layer spans where there is one, pandas' linear
quantiles), which `tests/analysis/test_fleet.py` checks against it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pandas as pd

from analysis import columnar
from analysis.live import (
    BACKEND_PHASES,
    OVERLAP_TOLERANCE,
    PERCENTILES,
    PHASES,
    PLACEMENT_TOLERANCE_NS,
    REQUEST_END,
    RESPONSE_START,
    TF_OP_KIND,
)
from analysis.store_file import RELAY_OFFSET_COLUMNS
from sidecar.profiling.stats import TRIM

TABLES = ("traces", "spans", "level_stats")
TRACE_COLUMNS = columnar.TRACE_COLUMNS
SPAN_COLUMNS = columnar.SPAN_COLUMNS
STATS_COLUMNS = columnar.STATS_COLUMNS
ROW_GROUP_ROWS = 32_768  # Parquet row groups: what the writer holds per file before it flushes
FLEET_ANALYSES = ("traces", "model_latency", "layer_types", "top_layers", "live_breakdown")


@dataclass(frozen=True)
class ExportCounts:
    """Rows written per table (over all databases)."""

    traces: int = 0
    spans: int = 0
    level_stats: int = 0


def export_parquet(
    dbs: Sequence[str | Path], out: Path, threads: int | None = None
) -> ExportCounts:
    """Write every trace of each store (failed profiles included, `status` says so) as
    Parquet under `out`; returns the rows written. Streams: SQLite's rows reach DuckDB's
    Parquet writer as Arrow record batches (`analysis.columnar`), a few at a time, in
    `threads` (default: one per core) readers at once, over stores and parts of a large
    store's spans (each part its own file)."""
    for table in TABLES:
        (out / table).mkdir(parents=True, exist_ok=True)
    workers = max(1, threads or os.cpu_count() or 1)
    jobs: list[tuple[str | Path, str, Path, tuple[int, int] | None, bool]] = []
    for i, db in enumerate(dbs):
        sound = columnar.all_in_sound_traces(db)
        for table in TABLES:
            stem = f"{i:04d}-{Path(db).stem}"
            ranges = columnar.span_ranges(db, workers) if table == "spans" else [None]
            for k, rowids in enumerate(ranges):
                name = stem if len(ranges) == 1 else f"{stem}-{k:02d}"
                jobs.append((db, table, out / table / f"{name}.parquet", rowids, sound))

    def write(job: tuple[str | Path, str, Path, tuple[int, int] | None, bool]) -> tuple[str, int]:
        db, table, target, rowids, sound = job
        # one single-threaded DuckDB per reader: parallel COPYs in one DuckDB hold more
        # rows in flight, and the readers are the parallelism
        con = duckdb.connect()
        try:
            con.execute("SET threads = 1")
            con.execute("SET enable_progress_bar = false")
            with columnar.record_batches(db, table, rowids, sound) as batches:
                con.register("batches", batches)
                try:
                    select = columnar.select_sql(table, str(db), "batches")
                    n = con.execute(
                        f"COPY ({select}) TO '{_quote(target)}' "
                        f"(FORMAT parquet, ROW_GROUP_SIZE {ROW_GROUP_ROWS})"
                    ).fetchone()
                finally:  # DuckDB lets go of the stream before ADBC closes it
                    con.unregister("batches")
            return table, int(n[0]) if n else 0
        finally:
            con.close()

    counts = {t: 0 for t in TABLES}
    with ThreadPoolExecutor(workers) as pool:  # ADBC and DuckDB run without the GIL
        for table, n in pool.map(write, jobs):
            counts[table] += n
    return ExportCounts(**counts)


def _quote(path: Path) -> str:
    return str(path).replace("'", "''")


def connect(fleet_dir: Path, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with views `traces`, `spans`, `level_stats` over the Parquet files
    of `fleet_dir`, the traces restricted to profiles that succeeded."""
    con = duckdb.connect()
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    for table in TABLES:
        files = sorted((fleet_dir / table).glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{fleet_dir / table}: no Parquet files (export first)")
        where = " WHERE status = 'ok'" if table == "traces" else ""
        # union_by_name: a folder may hold exports of older sidecars, whose spans lack the
        # relay's marks; those columns then read as NULL (the breakdown's fallback)
        con.execute(
            f"CREATE VIEW {table}_raw AS SELECT * FROM read_parquet("
            f"'{_quote(fleet_dir / table)}/*.parquet', union_by_name = true)"
        )
        have = {row[0] for row in con.execute(f"DESCRIBE {table}_raw").fetchall()}
        missing = [c for c in RELAY_OFFSET_COLUMNS.values() if table == "spans" and c not in have]
        extra = "".join(f", NULL::BIGINT AS {c}" for c in missing)
        con.execute(f"CREATE VIEW {table}_all AS SELECT *{extra} FROM {table}_raw{where}")
    con.execute("CREATE VIEW traces AS SELECT * FROM traces_all")
    for table in ("spans", "level_stats"):  # only rows of the selected traces
        con.execute(
            f"CREATE VIEW {table} AS SELECT x.* FROM {table}_all x "
            "SEMI JOIN traces t USING (source_db, trace_id)"
        )
    return con


def _trimmed(value: str, partition: str) -> str:
    """SQL over a subquery: keep rows whose rank within `partition` (by `value`) survives the
    trim of `TRIM` at each end (the rule of `sidecar.profiling.stats.trimmed_mean`)."""
    return (
        f"row_number() OVER (PARTITION BY {partition} ORDER BY {value}) - 1 AS _rank, "
        f"count(*) OVER (PARTITION BY {partition}) AS _n"
    )


_KEEP = f"_rank >= floor({TRIM} * _n) AND _rank < _n - floor({TRIM} * _n)"

_MODEL_LATENCY = f"""
WITH from_stats AS (
    SELECT source_db, trace_id, trimmed_mean_ns::DOUBLE AS latency_ns
    FROM level_stats WHERE level = 'model'
), from_spans AS (
    SELECT source_db, trace_id, arg_min(duration_ns, (run_level IS DISTINCT FROM 'model',
           start_ns))::DOUBLE AS latency_ns
    FROM spans WHERE level = 'model' GROUP BY source_db, trace_id
), per_trace AS (
    SELECT * FROM from_stats
    UNION ALL
    SELECT * FROM from_spans s ANTI JOIN from_stats f USING (source_db, trace_id)
), ranked AS (
    SELECT t.model, t.batch_size, p.latency_ns,
           {_trimmed("p.latency_ns", "t.model, t.batch_size")}
    FROM per_trace p JOIN traces t USING (source_db, trace_id)
)
SELECT model, batch_size, avg(latency_ns) FILTER (WHERE {_KEEP}) / 1e6 AS latency_ms,
       count(*) AS n_traces
FROM ranked GROUP BY model, batch_size ORDER BY model, batch_size
"""

# Layer spans as the report takes them (`common.Frames.layers`): one run per trace, the L
# run's where it has one, and every call its own row: the n-th repeat of a name in the run is
# `name#n` (CPU traces store each call under the module's name).
_LAYERS = """
layer_spans AS (
    SELECT s.*, arg_min(run_level, (run_level <> 'layer', run_level))
                    OVER (PARTITION BY source_db, trace_id) AS run
    FROM spans s WHERE level = 'layer'
), calls AS (
    SELECT *, row_number() OVER (PARTITION BY source_db, trace_id, run_level, name
                                 ORDER BY start_ns, idx) - 1 AS repeat
    FROM layer_spans WHERE run_level IS NOT DISTINCT FROM run
), layers AS (
    SELECT source_db, trace_id,
           CASE WHEN repeat > 0 THEN name || '#' || repeat ELSE name END AS name,
           duration_ns::DOUBLE AS duration_ns, layer_type AS type, idx
    FROM calls
), ranked AS (
    SELECT t.model, t.batch_size, l.name, l.type, l.idx, l.duration_ns,
           {trimmed}
    FROM layers l JOIN traces t USING (source_db, trace_id)
), per_layer AS (
    SELECT model, batch_size, name, arg_min(type, _rank) AS type,
           avg(duration_ns) FILTER (WHERE {keep}) AS duration_ns,
           count(*) AS n_traces
    FROM ranked GROUP BY model, batch_size, name
)
""".format(trimmed=_trimmed("l.duration_ns", "t.model, t.batch_size, l.name"), keep=_KEEP)

_LAYER_TYPES = f"""
WITH {_LAYERS}
SELECT model, batch_size, type, count(*) AS layers, sum(duration_ns) / 1e6 AS latency_ms,
       sum(duration_ns) / sum(sum(duration_ns)) OVER (PARTITION BY model, batch_size) AS share
FROM per_layer GROUP BY model, batch_size, type
ORDER BY model, batch_size, latency_ms DESC, type
"""

_TOP_LAYERS = f"""
WITH {_LAYERS}, shares AS (
    SELECT *, duration_ns / sum(duration_ns) OVER (PARTITION BY model, batch_size) AS share,
           row_number() OVER (PARTITION BY model, batch_size
                              ORDER BY duration_ns DESC, name) AS rank
    FROM per_layer
)
SELECT model, batch_size, rank, name, type, duration_ns / 1e6 AS latency_ms,
       share AS latency_share, n_traces
FROM shares WHERE rank <= $top ORDER BY model, batch_size, rank
"""

_PHASE_SUMS = ", ".join(
    f"sum(placed) FILTER (WHERE kind = '{k}') AS {k}" for k in ("request", *BACKEND_PHASES)
)
_PHASE_ANY = " OR ".join(f"{p} IS NOT NULL" for p in BACKEND_PHASES)
_PHASE_TOTAL = " + ".join(f"coalesce({p}, 0)" for p in BACKEND_PHASES)
_TOL = PLACEMENT_TOLERANCE_NS
# The rules of analysis.live.request_phases: backend spans placed in the request's window at
# the relay (cut at the response's first byte, else at its end), traces whose spans cannot be
# placed left out.
_LIVE = f"""
WITH requests AS (
    SELECT source_db, trace_id, arg_min(duration_ns, start_ns)::DOUBLE AS client_total,
           min(start_ns) AS t0,
           arg_min({REQUEST_END}, start_ns)::DOUBLE AS request_end,
           arg_min({RESPONSE_START}, start_ns)::DOUBLE AS response_start
    FROM spans WHERE level = 'request' GROUP BY source_db, trace_id
), win AS (
    SELECT *, coalesce(response_start, client_total) AS cut,
           response_start - request_end AS backend_response
    FROM requests
), placed AS (
    SELECT s.source_db, s.trace_id, s.kind, a, b,
           greatest(least(b, w.cut) - greatest(a, 0), 0) AS placed
    FROM (SELECT *, (start_ns - w0.t0)::DOUBLE AS a, (end_ns - w0.t0)::DOUBLE AS b
          FROM spans JOIN win w0 USING (source_db, trace_id) WHERE level = 'server') s
    JOIN win w USING (source_db, trace_id)
), server AS (
    SELECT source_db, trace_id, {_PHASE_SUMS},
           min(a) FILTER (WHERE kind <> '{TF_OP_KIND}') AS first_start,
           min(a) FILTER (WHERE kind = '{TF_OP_KIND}') AS op_start,
           max(b) FILTER (WHERE kind = '{TF_OP_KIND}') AS op_end,
           max(b) AS last_end
    FROM placed GROUP BY source_db, trace_id
), raw AS (
    SELECT t.model, w.client_total, w.backend_response, w.cut, s.*,
           w.client_total - s.request AS network_proxy,
           s.request - CASE WHEN {_PHASE_ANY} THEN {_PHASE_TOTAL} END AS server_other_raw,
           CASE WHEN s.op_end IS NOT NULL
                THEN greatest(least(s.op_end, w.cut) - greatest(s.op_start, 0), 0) END AS tf_ops,
           CASE WHEN s.last_end IS NOT NULL
                THEN greatest(s.last_end - w.cut, 0) END AS server_after_response
    FROM win w JOIN traces t USING (source_db, trace_id)
    LEFT JOIN server s USING (source_db, trace_id)
), per AS (
    SELECT *, CASE WHEN server_other_raw IS NOT NULL THEN greatest(server_other_raw, 0) END
              AS server_other,  -- greatest() skips a NULL
           client_total - tf_ops AS outside_tf_ops
    FROM raw
    WHERE NOT coalesce(first_start < -{_TOL} OR first_start > cut + {_TOL}
                       OR op_start > cut + {_TOL} OR op_end < -{_TOL}
                       OR server_other_raw < -{OVERLAP_TOLERANCE} * client_total, false)
), long AS (
    UNPIVOT (SELECT model, {", ".join(PHASES)} FROM per)
    ON {", ".join(PHASES)} INTO NAME phase VALUE ns
)
SELECT model, phase, count(*) AS requests, avg(ns) / 1e6 AS mean_ms,
       {", ".join(f"quantile_cont(ns, {q}) / 1e6 AS p{round(q * 100)}_ms" for q in PERCENTILES)}
FROM long WHERE ns IS NOT NULL AND NOT isnan(ns) GROUP BY model, phase
"""

_TRACES = """
SELECT model, count(*) AS traces, count(DISTINCT source_db) AS databases,
       min(created_ns) AS first_ns, max(created_ns) AS last_ns
FROM traces GROUP BY model ORDER BY model
"""


def fleet_tables(
    fleet_dir: Path, top: int = 10, threads: int | None = None
) -> dict[str, pd.DataFrame]:
    """Every fleet analysis over the Parquet files of `fleet_dir`, as DataFrames."""
    con = connect(fleet_dir, threads)
    try:
        out = {
            "traces": con.execute(_TRACES).df(),
            "model_latency": con.execute(_MODEL_LATENCY).df(),
            "layer_types": con.execute(_LAYER_TYPES).df(),
            "top_layers": con.execute(_TOP_LAYERS, {"top": top}).df(),
        }
        live = con.execute(_LIVE).df()
    finally:
        con.close()
    client = live[live["phase"] == "client_total"].set_index("model")["mean_ms"]
    live["share_of_client"] = live["mean_ms"] / live["model"].map(client)
    live["phase"] = pd.Categorical(live["phase"], categories=list(PHASES), ordered=True)
    live = live.sort_values(["model", "phase"]).reset_index(drop=True)
    live["phase"] = live["phase"].astype(str)
    out["live_breakdown"] = live
    return out


def render_text(tables: dict[str, pd.DataFrame]) -> str:
    """The fleet report as plain text, one section per analysis."""
    parts = []
    for key in FLEET_ANALYSES:
        df = tables[key]
        body = "(none)" if df.empty else df.to_string(index=False, float_format=_fmt)
        parts.append(f"== {key} ==\n{body}\n")
    return "\n".join(parts)


def _fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"
