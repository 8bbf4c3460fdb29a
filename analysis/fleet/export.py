"""A trace store's rows as Parquet (`report.py export-parquet`), for the fleet report.

`export_parquet` writes each store's rows (as `analysis.load.tracedb` loads them, so damaged rows
are left out the same way, layer types are resolved the same way, and the CUDA runtime/driver
API records, which only place kernels under their layers, are not carried) to
`DIR/{traces,spans,level_stats}/NNNN-<db>.parquet`, files that DuckDB, Spark or Trino read as
they are; each trace carries its fidelity fields (`FIDELITY_COLUMNS`, from its attributes by
`analysis.analyses.fidelity`'s rules), each stream message's request span its responses
(`STREAM_COLUMNS`). SQLite's rows reach DuckDB's Parquet writer as Arrow record batches
(`analysis.load.columnar`); no Python runs per span, and the command starts without pandas and the
analyses (`main`: `report.py` hands `export-parquet` over before it imports them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import duckdb

from analysis.analyses import fidelity_attrs
from analysis.load import columnar
from analysis.load.store_file import TraceDatabaseError
from sidecar.trace import schema

TABLES = ("traces", "spans", "level_stats")
DESCRIPTION = (
    "Write each store's traces, spans and level statistics as Parquet under "
    "DIR/{traces,spans,level_stats}/ (failed profiles included, with their status)."
)
ROW_GROUP_ROWS = 32_768  # Parquet row groups: what the writer holds per file before it flushes
STREAM_COLUMNS = {"stream_span": "BOOLEAN", schema.RESPONSES: "DOUBLE",
                  schema.RESPONSE_GAPS_NS: "DOUBLE[]"}  # fmt: skip
# What a trace's attributes say for the fidelity analysis (`fidelity_attrs.request_fields`),
# kept as columns of `traces` (DuckDB types); `replay_model_ns` and `fidelity_ratio` are the
# stored attribute's own (the analysis takes the replay's time from the model spans and
# statistics).
FIDELITY_COLUMNS = {
    "fidelity_kept": "BOOLEAN",
    schema.LIVE_COMPUTE_NS: "DOUBLE",
    schema.LIVE_SOURCE: "VARCHAR",
    schema.REPLAY_MODEL_NS: "DOUBLE",
    "fidelity_ratio": "DOUBLE",
    "server_batch_sizes": "INTEGER[]",
    "window_executions": "DOUBLE",
    "window_note": "VARCHAR",
    "fidelity_causes": "VARCHAR[]",
}
_FIDELITY_UDF = "xsp_fidelity_fields"
_FIDELITY_EXPORT = (
    f"unnest(from_json({_FIDELITY_UDF}(coalesce(attributes, '')), "
    f"'{json.dumps(FIDELITY_COLUMNS)}'))"
)


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
    Parquet writer as Arrow record batches (`analysis.load.columnar`), a few at a time, in
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

    local = threading.local()
    opened: list[duckdb.DuckDBPyConnection] = []

    def database() -> duckdb.DuckDBPyConnection:
        """The calling reader's DuckDB, made at its first job (11 ms) and kept for its others:
        one per reader, as parallel COPYs in one DuckDB hold more rows in flight."""
        if (con := getattr(local, "con", None)) is None:
            con = local.con = reader_duckdb()
            con.create_function(_FIDELITY_UDF, fidelity_fields, ["VARCHAR"], "VARCHAR")
            opened.append(con)
        return con

    def write(job: tuple[str | Path, str, Path, tuple[int, int] | None, bool]) -> tuple[str, int]:
        db, table, target, rowids, sound = job
        con = database().cursor()
        try:
            extra = _FIDELITY_EXPORT if table == "traces" else ""
            with columnar.record_batches(db, table, rowids, sound) as batches:
                con.register("batches", batches)
                try:
                    select = columnar.select_sql(table, str(db), "batches", extra)
                    n = con.execute(
                        f"COPY ({select}) TO '{quote(target)}' "
                        f"(FORMAT parquet, ROW_GROUP_SIZE {ROW_GROUP_ROWS})"
                    ).fetchone()
                finally:  # DuckDB lets go of the stream before ADBC closes it
                    con.unregister("batches")
            return table, int(n[0]) if n else 0
        finally:
            con.close()

    counts = {t: 0 for t in TABLES}
    try:
        with ThreadPoolExecutor(workers) as pool:  # ADBC and DuckDB run without the GIL
            for table, n in pool.map(write, jobs):
                counts[table] += n
    finally:
        for con in opened:
            con.close()
    return ExportCounts(**counts)


def reader_duckdb() -> duckdb.DuckDBPyConnection:
    """The DuckDB of one reader: one thread (the readers are the parallelism), and no filter
    pushdown: pushed down into the scan, the spans' WHERE would parse each attribute JSON
    again for every reference to its members (`columnar.SPANS_DUCKDB`'s `j`), 2-3 parses a
    row instead of one, half the DuckDB time of an export."""
    con = duckdb.connect()
    con.execute("SET threads = 1")
    con.execute("SET enable_progress_bar = false")
    con.execute("SET disabled_optimizers = 'filter_pushdown'")
    return con


def fidelity_fields(attributes: str) -> str:
    """A trace's `FIDELITY_COLUMNS` as JSON, from its attribute text, by the rules of the
    single-store report (`fidelity_attrs.request_fields`; missing numbers are null)."""
    try:
        attrs = json.loads(attributes) if attributes else {}
    except ValueError:  # a damaged trace (left out of the export)
        attrs = {}
    attrs = attrs if isinstance(attrs, dict) else {}
    got = fidelity_attrs.request_fields(attrs)
    stored = attrs.get(schema.FIDELITY)
    fid = stored if isinstance(stored, dict) else {}
    out = {
        "fidelity_kept": got["fidelity_kept"],
        schema.LIVE_COMPUTE_NS: got["live_ns"],
        schema.LIVE_SOURCE: got[schema.LIVE_SOURCE],
        schema.REPLAY_MODEL_NS: fidelity_attrs.number(fid.get(schema.REPLAY_MODEL_NS)),
        "fidelity_ratio": fidelity_attrs.number(fid.get(schema.RATIO)),
        "server_batch_sizes": got["server_batch_sizes"],
        "window_executions": got["window_executions"],
        "window_note": got["window_note"],
        "fidelity_causes": [cause for cause, _ in got["causes"]],
    }
    return json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v
                       for k, v in out.items()})  # fmt: skip


def quote(path: Path) -> str:
    """A path inside a DuckDB SQL string literal."""
    return str(path).replace("'", "''")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of `report.py export-parquet`."""
    parser.add_argument("dbs", nargs="+", metavar="DB", help="trace store(s)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")


def run(args: argparse.Namespace) -> int:
    """`report.py export-parquet`: export, then say what was written (stderr)."""
    for db in args.dbs:
        if not Path(db).is_file():
            raise TraceDatabaseError(f"{db}: no such file (expected a trace database)")
    t0 = time.perf_counter()
    n = export_parquet(args.dbs, args.out)
    print(
        f"wrote {n.traces} traces, {n.spans} spans, {n.level_stats} level statistics of "
        f"{len(args.dbs)} stores to {args.out} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str]) -> int:
    """`report.py export-parquet ARGV` without the report's imports (`report.py` calls it)."""
    parser = argparse.ArgumentParser(prog="report.py export-parquet", description=DESCRIPTION)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except (TraceDatabaseError, FileNotFoundError) as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 1
