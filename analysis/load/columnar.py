"""A trace store read columnar: SQLite rows to Arrow record batches to DuckDB, no Python per row.

ADBC's SQLite driver runs one query per table and hands its rows over as Arrow record batches
(`batch_rows` at a time, in C); DuckDB reads those batches as they come and writes them
(`COPY ... TO parquet`) or aggregates them. Memory stays that of a few batches, whatever the
store's size, and the Python interpreter touches no row.

The rows are the ones `analysis.load.tracedb` loads, by the same rules, written here as SQL that
SQLite evaluates while it scans:

- a damaged row (a duration that is NULL, negative or not a number, an end before its start,
  attribute text that is not JSON, a trace without a sound batch size or creation time, a
  statistic that is not a duration) is left out (`damage.py`'s checks), and so are the spans
  and statistics of a damaged trace;
- the CUDA runtime/driver API records (which only place kernels under their layers) are not
  carried, nor the ops a TensorFlow profile found outside every Keras layer;
- a layer's type is what it fused (`Conv+Relu` from `original_op_types`), else its `op_type`,
  else its kind (`analysis.load.layer_type`); an attribute value that is not a number
  where one is expected reads as missing.

ADBC infers each column's Arrow type from the first batch and refuses a later value of
another type, so every column is given one SQLite type (integers, reals or text) and the
first row of each result is a typed sentinel that DuckDB drops.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.load import damage
from analysis.load.store_file import (
    RELAY_OFFSET_COLUMNS,
    STREAM_RESPONSE_COLUMNS,
    TRACE_IDENTITY,
    TraceDatabaseError,
    connect_ro,
)
from analysis.tuning import BATCH_ROWS, EXPORT_PART_ROWS, REPORT_BATCH_ROWS
from sidecar.trace import schema
from sidecar.trace.schema import KernelKind, Level, json_path

if TYPE_CHECKING:  # (the export, which imports this module, needs no filter)
    from analysis.load.trace_filter import TraceFilter

# CUDA runtime and driver calls: kernel-level spans that are API records, not work
_API_KINDS = f"('{KernelKind.RUNTIME}', '{KernelKind.DRIVER}')"
_RESPONSES, _GAPS = json_path(schema.RESPONSES), json_path(schema.RESPONSE_GAPS_NS)

BUSY_TIMEOUT_MS = 10_000  # how long a batch reader waits for a lock on the store

TRACE_COLUMNS = (*TRACE_IDENTITY, "status", "created_ns", "sample_reason")
# the traces' columns as SQLite hands them over (attributes as JSON text)
_TRACE_ROWS = (*TRACE_COLUMNS, "attributes")
# the columns every span has, as stored
_SPAN_FIELDS = ("source_db", "trace_id", "span_id", "level", "name", "kind", "run_level",
                "start_ns", "end_ns", "duration_ns", "idx")  # fmt: skip
# the spans' columns as SQLite hands them over (attributes still JSON text)
_SPAN_ROWS = (*_SPAN_FIELDS, "attributes")
SPAN_COLUMNS = (
    *_SPAN_FIELDS,
    "layer_type",
    "flops",
    *RELAY_OFFSET_COLUMNS.values(),  # the relay's marks on a live request span
    "stream_span",  # a request span with a stream message's `responses`
    *STREAM_RESPONSE_COLUMNS,  # its values, where they are numbers (else NULL)
)
STATS_COLUMNS = ("source_db", "trace_id", "level", "trimmed_mean_ns", "overhead_ratio")
_NAMES = {"traces": _TRACE_ROWS, "spans": _SPAN_ROWS, "level_stats": STATS_COLUMNS}


def _text(expr: str) -> str:
    return f"CAST({expr} AS TEXT)"


def _int(expr: str) -> str:
    """An integer, or 0 where the value is not one (such rows are left out anyway)."""
    return f"CASE WHEN typeof({expr}) = 'integer' THEN {expr} ELSE 0 END"


def _rint(expr: str) -> str:
    """A non-negative number of ns as an integer, reals rounded half to even (numpy's rint,
    as the pandas loader rounds)."""
    whole = f"CAST({expr} AS INTEGER)"
    frac = f"({expr} - {whole})"
    return (
        f"CASE WHEN typeof({expr}) = 'integer' THEN {expr} "
        f"WHEN typeof({expr}) = 'real' THEN {whole} + (CASE WHEN {frac} > 0.5 OR "
        f"({frac} = 0.5 AND {whole} % 2 = 1) THEN 1 ELSE 0 END) END"
    )


def _real(expr: str) -> str:
    return f"CASE WHEN typeof({expr}) IN ('integer', 'real') THEN CAST({expr} AS REAL) END"


def trace_ok() -> str:
    """SQL over `traces`: the trace is sound (its spans and statistics are kept)."""
    checks = [
        damage.integer("created_ns"),
        damage.positive_integer("batch_size"),
        ("model IS NULL", "'model: NULL'"),
    ]
    bad = " OR ".join(f"({c})" for c, _ in checks)
    is_object = "(CASE WHEN json_valid(attributes) THEN json_type(attributes) END) = 'object'"
    return f"NOT ({bad}) AND (attributes IS NULL OR attributes = '' OR {is_object})"


def _span_ok() -> str:
    # and attribute text that is not JSON: DuckDB checks it (`SPANS_DUCKDB`)
    return damage.sound_span("s")


def _stats_ok() -> str:
    checks = [
        *damage.duration("trimmed_mean_ns"),
        *(c for col in ("median_ns", "min_ns", "max_ns") for c in damage.duration(col, True)),
        *damage.ratio("overhead_ratio"),
        damage.integer("iterations", nullable=True),
        damage.integer("warmup", nullable=True),
    ]
    return "NOT (" + " OR ".join(f"({c})" for c, _ in checks) + ")"


def _sentinel(table: str, types: Sequence[str]) -> str:
    """A first row of the given SQLite types, so that ADBC infers them (DuckDB drops it),
    which names the columns of the result."""
    values = {"text": "''", "integer": "0", "real": "0.0"}
    names = _NAMES[table][1:]
    assert len(names) == len(types)
    return "SELECT 1 AS _first, " + ", ".join(
        f"{values[t]} AS {n}" for t, n in zip(types, names, strict=True)
    )


TRACES_SQL = (
    _sentinel("traces", ["text"] * 3 + ["integer"] + ["text"] * 3 + ["integer"] + ["text"] * 2)
    + " UNION ALL SELECT 0, trace_id, "
    + ", ".join(_text(c) for c in ("model", "model_version"))
    + ", CASE WHEN typeof(batch_size) = 'integer' THEN batch_size END, "
    + ", ".join(_text(c) for c in ("device", "runtime", "status"))
    + f", created_ns, {_text('sample_reason')}, {_text('attributes')} FROM traces "
    f"WHERE {trace_ok()}"
)

SPANS_SQL = (
    _sentinel("spans", ["text"] * 6 + ["integer"] * 4 + ["text"])
    + " UNION ALL SELECT 0, s.trace_id, "
    + ", ".join(_text(f"s.{c}") for c in ("span_id", "level", "name", "kind", "run_level"))
    + f", s.start_ns, s.end_ns, {_rint('s.duration_ns')}, {_int('s.idx')}, "
    "CAST(s.attributes AS TEXT) FROM spans s "
    f"WHERE NOT (s.level = '{Level.KERNEL}' AND s.kind IN {_API_KINDS}) "
    f"AND {_span_ok()}"
)
# a span of a damaged trace, or of none, is left out (needless where `all_in_sound_traces`)
IN_SOUND_TRACES = f" AND s.trace_id IN (SELECT trace_id FROM traces WHERE {trace_ok()})"
STATS_SQL = (
    _sentinel("level_stats", ["text", "text", "integer", "real"])
    + " UNION ALL SELECT 0, trace_id, CAST(level AS TEXT), "
    + f"{_rint('trimmed_mean_ns')}, {_real('overhead_ratio')} FROM level_stats "
    f"WHERE {_stats_ok()} AND trace_id IN (SELECT trace_id FROM traces WHERE {trace_ok()})"
)
QUERIES = {"traces": TRACES_SQL, "spans": SPANS_SQL, "level_stats": STATS_SQL}


def _uri(path: Path, immutable: bool) -> str:
    return f"{path.resolve().as_uri()}?mode=ro" + ("&immutable=1" if immutable else "")


def _immutable(path: Path) -> bool:
    """Whether the store must be read as the file on disk (a WAL-mode store in a folder we
    cannot write); checks that it is a trace store on the way (errors said for people)."""
    connect_ro(path).close()
    try:
        conn = sqlite3.connect(_uri(path, False), uri=True)
        try:
            conn.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
        finally:
            conn.close()
        return False
    except sqlite3.OperationalError:
        return True


@contextmanager
def record_batches(
    db: str | Path,
    table: str,
    rowids: tuple[int, int] | None = None,
    sound_traces: bool = False,
) -> Iterator[Any]:
    """A `pyarrow.RecordBatchReader` over one table's rows as the analyses take them, with a
    leading `_first` column (true only on the typed sentinel row, which readers drop).
    `rowids` (spans only): read the rows whose rowid lies in that closed range.
    `sound_traces` (spans only): the caller found `all_in_sound_traces(db)` true, so no
    span needs its trace looked up."""
    path = Path(db)
    query = QUERIES[table]
    if table == "spans" and not sound_traces:
        query += IN_SOUND_TRACES
    if rowids is not None:
        query += f" AND s.rowid BETWEEN {int(rowids[0])} AND {int(rowids[1])}"
    with sqlite_reader(db, _uri(path, _immutable(path)), query) as reader:
        yield reader


@contextmanager
def sqlite_reader(name: str | Path, uri: str, query: str) -> Iterator[Any]:
    """A `pyarrow.RecordBatchReader` over SQLite's rows of `query` on the store at `uri`,
    `BATCH_ROWS` a batch; an ADBC error is said as the store `name`'s. Through ADBC's own
    statements, not its DB-API module, which imports pyarrow.dataset and pandas (a third of
    the export's start-up, a tenth of a second before the report's first batch)."""
    import adbc_driver_manager as adbc
    import adbc_driver_sqlite
    import pyarrow as pa

    try:
        with (
            adbc_driver_sqlite.connect(uri) as database,
            adbc.AdbcConnection(database) as conn,
            adbc.AdbcStatement(conn) as stmt,
        ):
            # wait out another reader's brief lock (readers of a WAL store opening beside
            # each other, one of them setting up its shared memory), which without a
            # timeout fails the query at once
            stmt.set_sql_query(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            stmt.execute_update()
            stmt.set_options(**{"adbc.sqlite.query.batch_rows": str(BATCH_ROWS)})
            stmt.set_sql_query(query)
            stream, _ = stmt.execute_query()
            # (as ADBC's DB-API module takes its stream; `from_stream` needs pyarrow 15)
            reader = pa.RecordBatchReader._import_from_c(stream.address)
            try:
                yield reader
            finally:
                reader.close()
    except adbc.Error as exc:
        raise TraceDatabaseError(f"{name}: cannot read the trace store ({exc})") from None


# The spans' distinct trace ids, one index seek each (the next id after the last), rather
# than a walk over every entry of the index: 0.08 s instead of 0.45 s at 8 M spans.
_SPAN_TRACE_IDS = """
WITH RECURSIVE ids(trace_id) AS (
    SELECT (SELECT min(trace_id) FROM spans)
    UNION ALL
    SELECT (SELECT min(trace_id) FROM spans WHERE trace_id > ids.trace_id) FROM ids
    WHERE ids.trace_id IS NOT NULL
)"""


def all_in_sound_traces(db: str | Path) -> bool:
    """Whether every span of the store belongs to a sound trace (the common case), found
    over the trace-id index's distinct values rather than one lookup per span."""
    conn = connect_ro(Path(db))
    try:
        (outside,) = conn.execute(
            f"{_SPAN_TRACE_IDS} SELECT EXISTS (SELECT 1 FROM spans WHERE trace_id IS NULL) "
            "OR EXISTS (SELECT 1 FROM ids WHERE trace_id IS NOT NULL AND NOT coalesce("
            f"trace_id IN (SELECT trace_id FROM traces WHERE {trace_ok()}), 0))"
        ).fetchone()
    finally:
        conn.close()
    return not outside


def _rowid_bounds(db: str | Path) -> tuple[int | None, int | None]:
    """The spans' smallest and largest rowid (None, None for no span)."""
    conn = connect_ro(Path(db))
    try:
        low, high = conn.execute(  # each alone, so that SQLite looks it up, not scans
            "SELECT (SELECT min(rowid) FROM spans), (SELECT max(rowid) FROM spans)"
        ).fetchone()
    finally:
        conn.close()
    return low, high


def span_ranges(db: str | Path, parts: int) -> list[tuple[int, int] | None]:
    """The spans table cut into up to `parts` rowid ranges of about `EXPORT_PART_ROWS` rows or more,
    which separate readers scan at once (`[None]`: one reader for all). The rows are counted
    by their rowid range (two lookups; pruned traces' gaps count as rows), not by a scan."""
    low, high = _rowid_bounds(db)
    if low is None or high is None:
        return [None]
    parts = min(parts, (high - low + 1) // EXPORT_PART_ROWS)
    if parts <= 1:
        return [None]
    step = (high - low + parts) // parts
    return [(low + k * step, min(high, low + (k + 1) * step - 1)) for k in range(parts)]


# DuckDB over the rows of `SPANS_SQL` (relation `{relation}`): the attribute JSON is checked
# and read here, parsed once per row into the typed members a span needs (`from_json`: a
# value that is not a number where one is expected reads as NULL, true as 1), which costs a
# fraction of SQLite's parser. A text that is not JSON fails `from_json` (NULL by `try`) and
# then `json_valid`.
_MEMBERS = json.dumps(
    {
        schema.OP_TYPE: "VARCHAR",
        schema.ORIGINAL_OP_TYPES: "JSON",
        schema.FLOPS: "DOUBLE",
        schema.OUTSIDE_LAYERS: "DOUBLE",
    }
)
_MEMBERS_SQL = _MEMBERS.replace("{", "{{").replace("}", "}}")  # SPANS_DUCKDB is formatted
_IS_WORK = f"level = '{Level.KERNEL}' AND kind NOT IN {_API_KINDS}"
_RELAY_EXPORT = ",\n".join(
    f"       CASE WHEN level = '{Level.REQUEST}' AND try(json_type(attributes, '$.{k}')) IN "
    f"('BIGINT', 'UBIGINT') THEN try(json_extract(attributes, '$.{k}')::BIGINT) - start_ns "
    f"END AS {col}"
    for k, col in RELAY_OFFSET_COLUMNS.items()
)
_NUMBER_TYPES = "('BIGINT', 'UBIGINT', 'DOUBLE')"  # a JSON number (not a boolean)
# A sampled stream message's responses (`analysis.analyses.stream_responses`' rules): whether the
# request span has a `responses` (not null), the count as a number and the gaps as a list of
# numbers (empty when absent), each NULL where it is something else.
_STREAM_EXPORT = f"""
       CASE WHEN level = '{Level.REQUEST}' THEN
           coalesce(try(json_type(attributes, '{_RESPONSES}')), 'NULL') <> 'NULL'
       END AS stream_span,
       CASE WHEN level = '{Level.REQUEST}' AND try(json_type(attributes, '{_RESPONSES}'))
                 IN {_NUMBER_TYPES}
            THEN try(json_extract(attributes, '{_RESPONSES}')::DOUBLE) END AS responses,
       CASE WHEN level = '{Level.REQUEST}' THEN
           CASE WHEN coalesce(try(json_type(attributes, '{_GAPS}')), 'NULL') = 'NULL'
                THEN []::DOUBLE[]
                WHEN try(json_type(attributes, '{_GAPS}')) = 'ARRAY'
                     AND list_bool_and(list_transform(
                         try(json_extract(attributes, '{_GAPS}[*]')),
                         lambda x: json_type(x) IN {_NUMBER_TYPES})) IS NOT FALSE
                THEN try(json_extract(attributes, '{_GAPS}')::DOUBLE[]) END
       END AS response_gaps_ns"""
_STREAM_SQL = _STREAM_EXPORT.replace("{", "{{").replace("}", "}}")  # SPANS_DUCKDB is formatted
SPANS_DUCKDB = f"""
SELECT {{source}} AS source_db, trace_id, span_id, level, name, kind, run_level, start_ns,
       end_ns, duration_ns, idx,
       CASE WHEN level = '{Level.LAYER}' THEN
           CASE WHEN json_type(j.original_op_types) = 'ARRAY'
                     AND json_array_length(j.original_op_types) > 1
                THEN array_to_string(json_extract_string(j.original_op_types, '$[*]'), '+')
                ELSE coalesce(j.op_type, kind) END
       END AS layer_type,
       j.flops AS flops,
{_RELAY_EXPORT},{_STREAM_SQL}
FROM (
    SELECT *, CASE WHEN level = '{Level.LAYER}' OR ({_IS_WORK})
                   THEN try(from_json(attributes, '{_MEMBERS_SQL}')) END AS j
    FROM {{relation}} WHERE _first = 0
)
WHERE (attributes IS NULL OR j IS NOT NULL OR json_valid(attributes))
  AND NOT (level = '{Level.LAYER}' AND coalesce(j.outside_layers > 0, false))
"""


def select_sql(table: str, source: str, relation: str, extra: str = "") -> str:
    """DuckDB SQL over a relation of `record_batches(db, table)`: the table's columns with
    `source_db` in front, the sentinel row dropped (spans: attributes read). `extra`: more
    columns (traces: SQL expressions over the relation, e.g. of its `attributes` text)."""
    quoted = "'" + source.replace("'", "''") + "'"
    if table == "spans":
        return SPANS_DUCKDB.format(source=quoted, relation=relation)
    names = TRACE_COLUMNS if table == "traces" else _NAMES[table]
    cols = ", ".join([*(f'"{c}"' for c in names[1:]), *([extra] if extra else [])])
    return f"SELECT {quoted} AS source_db, {cols} FROM {relation} WHERE _first = 0"


# --- the single-store report's spans ---------------------------------------------------
# `analysis.load.tracedb.load_traces` takes its spans from here: SQLite checks each row (the
# `_bad` reason) and joins a kernel's layer; DuckDB checks the attribute JSON and reads the
# attributes the analyses use, as typed columns; pandas gets the columns, not the rows.

LAYER_NUMBERS = (
    schema.ALLOCATED_BYTES,
    schema.LEAF,
    schema.FLOPS,
    schema.DRAM_READ_BYTES,
    schema.DRAM_WRITE_BYTES,
)
LAYER_FLAGS = (schema.FLOPS_ESTIMATED, schema.BYTES_ESTIMATED, schema.OUTSIDE_LAYERS)
LAYER_OBJECTS = (schema.OP_TYPE, schema.ORIGINAL_NODES, schema.ORIGINAL_OP_TYPES)
LAYER_JSON = (schema.INPUT_SHAPES, schema.OUTPUT_SHAPES)  # kept as JSON text
WORK_NUMBERS = (
    schema.FLOPS,
    schema.DRAM_READ_BYTES,
    schema.DRAM_WRITE_BYTES,
    schema.ACHIEVED_OCCUPANCY,
)
WORK_FLAGS = (schema.METRICS_ESTIMATED,)
NUMBERS = (schema.ALLOCATED_BYTES, schema.FLOPS, schema.DRAM_READ_BYTES,
           schema.DRAM_WRITE_BYTES, schema.ACHIEVED_OCCUPANCY, schema.LEAF)  # fmt: skip
FLAGS = (
    schema.FLOPS_ESTIMATED,
    schema.BYTES_ESTIMATED,
    schema.METRICS_ESTIMATED,
    schema.OUTSIDE_LAYERS,
)
OBJECTS = LAYER_OBJECTS
_LAYER_KEYS = (*LAYER_NUMBERS, *LAYER_FLAGS, *LAYER_OBJECTS, *LAYER_JSON)
_WORK_KEYS = (*WORK_NUMBERS, *WORK_FLAGS)
_REPORT_NAMES = ("trace_id", "span_id", "level", "name", "kind", "start_ns", "end_ns",
                 "duration_ns", "run_level", "idx", "attributes", "layer", "_bad",
                 *RELAY_OFFSET_COLUMNS.values(), *STREAM_RESPONSE_COLUMNS)  # fmt: skip


def report_spans_sql(span_checks: str, trace_subquery: str | None) -> str:
    """SQLite: the spans the report reads (not the CUDA API records), each with its layer
    (a kernel's parent, or its launch's parent) and `_bad`, the reason a row is damaged."""
    types = ["text"] * 5 + ["integer"] * 3 + ["text", "integer"] + ["text"] * 3
    types += ["integer"] * len(RELAY_OFFSET_COLUMNS) + ["text"] * len(STREAM_RESPONSE_COLUMNS)
    values = {"text": "''", "integer": "0"}
    first = "SELECT 1 AS _first, " + ", ".join(
        f"{values[t]} AS {n}" for t, n in zip(types, _REPORT_NAMES, strict=True)
    )
    return (
        f"{first} UNION ALL SELECT 0, s.trace_id, "
        + ", ".join(_text(f"s.{c}") for c in ("span_id", "level", "name", "kind"))
        + f", {_int('s.start_ns')}, {_int('s.end_ns')}, {_rint('s.duration_ns')}, "
        f"{_text('s.run_level')}, {_int('s.idx')}, {_text('s.attributes')}, "
        f"CASE WHEN p.level = '{Level.LAYER}' THEN CAST(p.name AS TEXT) "
        f"WHEN g.level = '{Level.LAYER}' THEN CAST(g.name AS TEXT) END, "
        f"{span_checks}, "
        + ", ".join(  # the relay's marks as offsets from the span's start (request spans)
            f"CASE WHEN s.level = '{Level.REQUEST}' AND json_valid(s.attributes) AND "
            f"json_type(s.attributes, '$.{k}') = 'integer' AND typeof(s.start_ns) = 'integer' "
            f"THEN json_extract(s.attributes, '$.{k}') - s.start_ns END"
            for k in RELAY_OFFSET_COLUMNS
        )
        + "".join(  # a stream message's responses (request spans), as JSON text
            f", CASE WHEN s.level = '{Level.REQUEST}' AND json_valid(s.attributes) THEN "
            f"json_quote(json_extract(s.attributes, '$.{k}')) END"
            for k in STREAM_RESPONSE_COLUMNS
        )
        + " FROM spans s "
        f"LEFT JOIN spans p ON s.level = '{Level.KERNEL}' AND p.trace_id = s.trace_id "
        "AND p.span_id = s.parent_id "
        f"LEFT JOIN spans g ON p.level = '{Level.KERNEL}' AND g.trace_id = p.trace_id "
        "AND g.span_id = p.parent_id "
        f"WHERE NOT (s.level = '{Level.KERNEL}' AND s.kind IN {_API_KINDS})"
        + (f" AND s.trace_id IN ({trace_subquery})" if trace_subquery else "")
    )


def duck_number(x: str) -> str:
    """A JSON value `x` as a DOUBLE as numpy reads the decoded value: numbers, booleans
    (1/0), numeric text; NULL otherwise. DuckDB's cast of a JSON value reads numbers and
    booleans so and makes NULL of the rest; a JSON string's text is cast as text."""
    return (
        f"CASE WHEN starts_with({x}::VARCHAR, '\"') "
        f"THEN TRY_CAST(json_extract_string({x}, '$') AS DOUBLE) ELSE TRY_CAST({x} AS DOUBLE) END"
    )


def _attribute(key: str) -> str:
    """DuckDB: attribute `key` of a span, from the JSON array `a` its level's paths read."""
    refs = []
    if key in _LAYER_KEYS:
        refs.append(f"WHEN level = '{Level.LAYER}' THEN a[{_LAYER_KEYS.index(key) + 1}]")
    if key in _WORK_KEYS:
        refs.append(f"WHEN level != '{Level.LAYER}' THEN a[{_WORK_KEYS.index(key) + 1}]")
    return f"(CASE {' '.join(refs)} END)"


def _report_duckdb() -> str:
    """DuckDB over the rows of `report_spans_sql` (relation `batches`). Each numeric
    attribute's JSON value (`_v_KEY`) and its number are computed once each, one subquery
    after the other (not once per expression that reads them). `span_id` only names a
    damaged row or value, so it is handed over for those rows alone (a unique string per
    span is what costs most to make a Python object of)."""
    layer_paths = "[" + ", ".join(f"'$.{k}'" for k in _LAYER_KEYS) + "]"
    work_paths = "[" + ", ".join(f"'$.{k}'" for k in _WORK_KEYS) + "]"
    numeric = (*NUMBERS, *FLAGS)
    values = ", ".join(f"{_attribute(k)} AS _v_{k}" for k in numeric)
    numbers = ", ".join(f"{duck_number(f'_v_{k}')} AS {k}" for k in numeric)
    # present, not JSON null (minified as `null`), and not a number: ignored, and named
    wrong = ", ".join(
        f"CASE WHEN _v_{k} IS NOT NULL AND _v_{k}::VARCHAR != 'null' AND {k} IS NULL "
        f"THEN '\"{k}\":' || _v_{k} END"
        for k in numeric
    )
    objects = ", ".join(f"{_attribute(k)}::VARCHAR AS {k}" for k in (*OBJECTS, *LAYER_JSON))
    quoted = "'''' || replace(substr(attributes, 1, 40), '''', '''''') || ''''"
    return f"""
SELECT * REPLACE (CASE WHEN _bad IS NOT NULL OR _wrong IS NOT NULL THEN span_id END AS span_id)
FROM (
SELECT trace_id, span_id, level, name, kind, start_ns, end_ns, duration_ns, run_level, idx,
       layer, {", ".join((*RELAY_OFFSET_COLUMNS.values(), *STREAM_RESPONSE_COLUMNS))}, _bad,
       {", ".join(numeric)}, nullif(concat_ws(',', {wrong}), '') AS _wrong, {objects}
FROM (
  SELECT *, {numbers}
  FROM (
    SELECT * EXCLUDE (_bad),
           coalesce(_bad, CASE WHEN attributes IS NOT NULL AND a IS NULL
                               AND NOT json_valid(attributes)
                          THEN 'attributes: not valid JSON (' || {quoted} || ')' END) AS _bad,
           {values}
    FROM (
      SELECT * EXCLUDE (attributes),
             CASE WHEN level IN ('{Level.LAYER}', '{Level.KERNEL}') OR NOT json_valid(attributes)
                  THEN attributes END AS attributes,
             CASE WHEN level = '{Level.LAYER}' THEN try(json_extract(attributes, {layer_paths}))
                  WHEN level = '{Level.KERNEL}' THEN try(json_extract(attributes, {work_paths})) END
               AS a
      FROM batches WHERE _first = 0
    )
  )
)
)
"""


REPORT_DUCKDB = _report_duckdb()


class SpanBatches:
    """The report's spans of one store as Arrow tables, one per batch of about
    `REPORT_BATCH_ROWS` rowids, in rowid order: SQLite's columns, `_bad`, the attribute
    columns (numbers as float64, flags as float64 to be compared with 0, objects and shapes
    as JSON text; the `REPORT_DICTIONARY` columns as categoricals) and `_wrong` (the members
    of a JSON object: the values that are not numbers where one is expected, by key). The
    reads start when it is made (so that they run while the caller reads the traces): one
    reader per core reads the next batches while the caller takes one (unless filtered), so
    that a few batches are held at once, whatever the store's size; the rows and their order
    are those of one reader. Iterate it once; `close()` (or the end of a `with` block) waits
    for the reads under way and drops the rest.
    """

    def __init__(
        self, path: Path, span_checks: str, trace_subquery: str | None, params: Sequence[object]
    ) -> None:
        if trace_subquery:  # the filters' few plain values, as SQL literals
            pieces = trace_subquery.split("?")
            assert len(pieces) == len(params) + 1
            literals = [str(v) if isinstance(v, int) else _sql_text(str(v)) for v in params]
            trace_subquery = "".join(p + q for p, q in zip(pieces, [*literals, ""], strict=True))
        query = report_spans_sql(span_checks, trace_subquery)
        self._path = path
        self._uri = _uri(path, _immutable(path))
        # (a filtered read stays one reader: SQLite then walks the selected traces' index, in
        # its order, where a rowid range would walk the table in another)
        ranges = batch_ranges(path, REPORT_BATCH_ROWS) if trace_subquery is None else [None]
        self._waiting = deque(
            query if r is None else f"{query} AND s.rowid BETWEEN {int(r[0])} AND {int(r[1])}"
            for r in ranges
        )
        single = len(ranges) == 1
        readers = 1 if single else min(len(ranges), os.cpu_count() or 1)
        self._duckdb = _reader_database(None if single else 1)  # one alone may use every core
        self._pool = ThreadPoolExecutor(readers)  # ADBC and DuckDB run without the GIL
        self._reading: deque[Any] = deque(self._submit() for _ in range(readers))

    @classmethod
    def started(cls, path: Path, flt: TraceFilter) -> SpanBatches | None:
        """The report's span reads of `path` under `flt`, started now; None where they cannot
        start (no such store, not a trace store: the loader then says why)."""
        from analysis.load import trace_filter

        sub, params = trace_filter.selection(flt) or (None, ())
        try:
            return cls(path, trace_filter.span_checks(False), sub, params)
        except (TraceDatabaseError, sqlite3.Error, OSError):
            return None

    def _submit(self) -> Any:
        query = self._waiting.popleft()
        return self._pool.submit(_report_part, self._path, self._uri, query, self._duckdb)

    def __iter__(self) -> Iterator[Any]:
        try:
            while self._reading:
                table = self._reading.popleft().result()
                if self._waiting:
                    self._reading.append(self._submit())
                yield table
                del table
        finally:
            self.close()

    def close(self) -> None:
        self._waiting.clear()
        self._reading.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._duckdb.close()

    def __enter__(self) -> SpanBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pandas(table: Any) -> Any:
    """A batch's Arrow table as a pandas frame (its dictionary columns categoricals)."""
    return table.to_pandas(self_destruct=True, split_blocks=True)


def batch_ranges(db: str | Path, rows: int) -> list[tuple[int, int] | None]:
    """The spans table cut into rowid ranges of `rows` rowids (`[None]`: one range for all),
    bounded by two rowid lookups, not a scan."""
    low, high = _rowid_bounds(db)
    if low is None or high is None or high - low + 1 <= rows:
        return [None]
    return [(a, min(high, a + rows - 1)) for a in range(low, high + 1, rows)]


# The report's string columns of few distinct values, handed over dictionary-encoded (each
# distinct string once per batch, an integer code per row): pandas makes categoricals of them,
# with no Python object per row.
REPORT_DICTIONARY = ("trace_id", "level", "name", "kind", "run_level", "layer", *OBJECTS,
                     *LAYER_JSON)  # fmt: skip


def _dictionary_encoded(table: Any) -> Any:
    """`table` with its `REPORT_DICTIONARY` columns dictionary-encoded (in the reader's
    thread, without the GIL)."""
    import pyarrow.compute as pc

    for name in REPORT_DICTIONARY:
        at = table.schema.get_field_index(name)
        table = table.set_column(at, name, pc.dictionary_encode(table.column(at)))
    return table


def _reader_database(threads: int | None) -> Any:
    """The readers' DuckDB database (each batch a connection of its own to it: a database
    costs 11 ms to make, a connection to it nothing)."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    return con


def _report_part(path: Path, uri: str, query: str, database: Any) -> Any:
    """One reader: SQLite's rows of `query` through `REPORT_DUCKDB` (on a connection to
    `database`), as an Arrow table (its `REPORT_DICTIONARY` columns dictionary-encoded)."""
    with sqlite_reader(path, uri, query) as reader:
        con = database.cursor()  # closed before the ADBC stream it reads
        try:
            con.register("batches", reader)
            rel = con.sql(REPORT_DUCKDB)
            table = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()
            return _dictionary_encoded(table)
        finally:
            con.close()


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
