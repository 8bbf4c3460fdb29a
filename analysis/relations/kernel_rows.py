"""The relations the kernel and layer analyses read, made once per set of traces over the
loaded spans (`analysis.load.span_store.SpanStore`).

The analyses read the kernel- and layer-level spans through SQL over the relations of
`kernel_rows(fr)` (one per `Frames`), which come back as pandas
DataFrames of what the SQL aggregated, not of the spans. The relations are tables that any
thread reads, each through a connection of its own (the report runs two analyses at a time:
`TraceAnalysis.prefetch`).

`kernels`: one row per kernel-level span the loader kept (work and the API records kept):

    row                 BIGINT   position in the loader's order (for "the first row" rules)
    tkey                BIGINT   the trace (`TraceData.traces["tkey"]`)
    model, batch_size   VARCHAR, BIGINT   the trace's group
    run_level           VARCHAR  the leveled run the span came from
    layer               VARCHAR  the layer call it ran under, or NULL: the stored layer (its
                                 parent's, or its launch's parent's, name); where the run
                                 called that module more than once, the last call of that
                                 name to start at or before the kernel
    layer_type          VARCHAR  that layer's type, or NULL
    idx                 BIGINT
    name, kind          VARCHAR
    start_ns, end_ns, duration_ns   BIGINT
    flops, dram_read_bytes, dram_write_bytes, achieved_occupancy   DOUBLE (NULL: not recorded)
    metrics_estimated   BOOLEAN

`layer_calls`: every layer span, one row per call: `row` (the loader's order), tkey,
run_level, `module` (the name it was stored under), `name` (the call's name: `module`, plus
`#n` for the n-th repeat of that name in its trace's run, by start), `type` (what it fused
where it computes two or more graph nodes, `Conv+Relu` from `original_op_types`, else its
`op_type`, else its kind), idx, start_ns and `outside_layers` (a TensorFlow op outside every
Keras layer).

`layers`: the layer spans as the layer analyses take them: of `layer_calls`, one run per trace
(the L run where there is one, else the first run by name), Keras ops outside layers left out,
sorted by tkey, idx, start_ns:

    row                 STRUCT   the span's key in that order (tkey, idx, start_ns and its
                                 position in the loader's order: for "the first row" rules)
    tkey, model, batch_size, run_level   as above
    module, name        VARCHAR  (as in `layer_calls`)
    kind, op_type, type VARCHAR
    idx                 BIGINT
    container           BOOLEAN  a module call enclosing other layers (`leaf` recorded 0)
    start_ns, end_ns, duration_ns   BIGINT
    allocated_bytes, flops, dram_read_bytes, dram_write_bytes, leaf   DOUBLE (NULL: not recorded)
    flops_estimated, bytes_estimated   BOOLEAN
    original_nodes      VARCHAR  JSON text of the list (NULL where not recorded)
    input_shapes, output_shapes   VARCHAR  JSON text as stored
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import duckdb
import numpy as np
import pandas as pd

from analysis.load.span_store import RELATIONS, STORED, SpanStore
from sidecar.trace import schema
from sidecar.trace.schema import Level

T = TypeVar("T")


class SpanFrames(Protocol):
    """What `kernel_rows` needs of an `analysis.analyses.common.Frames` (not imported: common
    imports this module)."""

    @property
    def data(self) -> Any: ...  # a `TraceData`

    @property
    def meta(self) -> pd.DataFrame: ...

    def memo(self, key: str, build: Callable[[], T]) -> T: ...


_SCHEMAS = itertools.count(1)  # numbers the schemas of `KernelRows.of`
COLUMNS = ("row", "tkey", "model", "batch_size", "run_level", "layer", "layer_type", "idx",
           "name", "kind", "start_ns", "end_ns", "duration_ns", schema.FLOPS,
           schema.DRAM_READ_BYTES, schema.DRAM_WRITE_BYTES, schema.ACHIEVED_OCCUPANCY,
           schema.METRICS_ESTIMATED)  # fmt: skip
LAYER_COLUMNS = ("row", "tkey", "model", "batch_size", "run_level", "module", "name", "kind",
                 schema.OP_TYPE, "type", "idx", "container", "start_ns", "end_ns", "duration_ns",
                 schema.ALLOCATED_BYTES, schema.FLOPS, schema.DRAM_READ_BYTES,
                 schema.DRAM_WRITE_BYTES, schema.LEAF, schema.FLOPS_ESTIMATED,
                 schema.BYTES_ESTIMATED, schema.ORIGINAL_NODES, schema.INPUT_SHAPES,
                 schema.OUTPUT_SHAPES)  # fmt: skip


def _drop_schema(con: duckdb.DuckDBPyConnection, schema: str) -> None:
    # (where the store closed first, its database went with it)
    with contextlib.suppress(duckdb.Error):
        con.execute(f"DROP SCHEMA IF EXISTS {RELATIONS}.{schema} CASCADE")


class KernelRows:
    """The relations `kernels`, `layer_calls` and `layers` of one `Frames` (see the module's
    docstring), queried by any thread: made by `of`, they are tables of a schema of their
    own in the relations' database beside the spans', and each thread queries them through
    a connection of its own (DuckDB's connections are not shared between threads), in which
    it registers its frames and makes its temporary tables."""

    def __init__(self, con: duckdb.DuckDBPyConnection, schema: str | None = None) -> None:
        self._con = con  # the connection that made them
        self._schema = schema  # None: views over frames registered on `con`, one thread's
        self._local = threading.local()
        self._local.con = con
        if schema is not None:  # its tables go with it
            weakref.finalize(self, _drop_schema, con, schema)

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """The calling thread's connection (the relations' schema its default)."""
        con: duckdb.DuckDBPyConnection | None = getattr(self._local, "con", None)
        if con is None:
            if self._schema is None:
                raise RuntimeError("relations made over frames are one thread's")
            con = self._con.cursor()
            con.execute(f"USE {RELATIONS}.{self._schema}")
            self._local.con = con
        return con

    @classmethod
    def from_frame(cls, kernels: pd.DataFrame) -> KernelRows:
        """The relation `kernels` alone, over a frame with its columns (`COLUMNS`; `row`
        where missing: the frame's order), in a connection of its own."""
        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")
        if "row" not in kernels.columns:
            kernels = kernels.assign(row=np.arange(len(kernels), dtype="int64"))
        con.register("_kernel_frame", kernels)
        types = {**STORED["kernel"], "model": "VARCHAR", "batch_size": "BIGINT",
                 "layer_type": "VARCHAR"}  # fmt: skip
        cols = ", ".join(f'CAST("{c}" AS {types[c]}) AS "{c}"' for c in COLUMNS)
        con.execute(f"CREATE VIEW kernels AS SELECT {cols} FROM _kernel_frame")
        return cls(con)

    def add_layers(self, layers: pd.DataFrame) -> None:
        """The relation `layers` beside `kernels` of `from_frame`, over a frame with (some
        of) its columns (`LAYER_COLUMNS`; the others NULL; `row` where missing: the frame's
        order)."""
        if "row" not in layers.columns:
            layers = layers.assign(row=np.arange(len(layers), dtype="int64"))
        self._con.register("_layer_frame", layers)
        types = {**STORED["layer"], "model": "VARCHAR", "batch_size": "BIGINT",
                 "module": "VARCHAR", "container": "BOOLEAN"}  # fmt: skip
        cols = ", ".join(
            f'CAST("{c}" AS {types[c]}) AS "{c}"'
            if c in layers.columns
            else f'NULL::{types[c]} AS "{c}"'
            for c in LAYER_COLUMNS
        )
        self._con.execute(f"CREATE VIEW layers AS SELECT {cols} FROM _layer_frame")

    @classmethod
    def of(cls, store: SpanStore, meta: pd.DataFrame) -> KernelRows:
        """The relations over `store`, each span's group from `meta` (tkey, model,
        batch_size)."""
        con = store.cursor()
        schema = f"frames_{next(_SCHEMAS)}"  # one per `Frames`
        con.execute(f"CREATE SCHEMA {RELATIONS}.{schema}")
        con.execute(f"USE {RELATIONS}.{schema}")
        frame = meta.astype({"model": object})
        con.register("_meta", frame)
        calls, layers, kernels = "layer_calls", "layers", "kernels"
        # the (trace, run, name)s stored more than once: only their calls are numbered
        con.execute(
            f"CREATE TEMP TABLE _repeats AS SELECT tkey, run_level, name "
            f"FROM {store.table('layer')} GROUP BY ALL HAVING count(*) > 1"
        )
        same = " AND ".join(
            f"r.{c} IS NOT DISTINCT FROM s.{c}" for c in ("tkey", "run_level", "name")
        )
        con.execute(
            f"""
            CREATE TABLE {calls} AS
            WITH flagged AS (
                SELECT s.row, s.tkey, s.run_level, s.name, s.type, s.idx, s.start_ns,
                       s.outside_layers, r.tkey IS NOT NULL AS repeated
                FROM {store.table("layer")} s LEFT JOIN _repeats r ON {same}
            )
            SELECT row, tkey, run_level, name AS module, name, type, idx, start_ns,
                   outside_layers, repeated
            FROM flagged WHERE NOT repeated
            UNION ALL
            SELECT row, tkey, run_level, name AS module,
                   CASE WHEN _n > 0 THEN name || '#' || _n ELSE name END AS name,
                   type, idx, start_ns, outside_layers, repeated
            FROM (
                SELECT *, row_number() OVER (PARTITION BY tkey, run_level, name
                                             ORDER BY start_ns, idx, row) - 1 AS _n
                FROM flagged WHERE repeated
            )
            """
        )
        con.execute("DROP TABLE _repeats")
        layers_sql = f"""
            CREATE TABLE {layers} AS
            WITH keras AS (
                SELECT * FROM {calls} WHERE outside_layers IS DISTINCT FROM true
            ), runs AS (
                SELECT tkey, first(run_level ORDER BY run_level IS DISTINCT FROM '{Level.LAYER}',
                                   run_level NULLS LAST) AS run_level
                FROM keras GROUP BY tkey
            )
            SELECT struct_pack(t := k.tkey, i := k.idx, s := k.start_ns, r := k.row) AS row,
                   k.tkey, m.model::VARCHAR AS model, m.batch_size::BIGINT AS batch_size,
                   k.run_level, k.module, k.name, s.kind, s.op_type, k.type, k.idx,
                   coalesce(s.leaf = 0, false) AS container, k.start_ns, s.end_ns,
                   s.duration_ns, s.allocated_bytes, s.flops, s.dram_read_bytes,
                   s.dram_write_bytes, s.leaf, s.flops_estimated, s.bytes_estimated,
                   s.original_nodes, s.input_shapes, s.output_shapes
            FROM keras k
            JOIN runs r ON r.tkey = k.tkey AND r.run_level IS NOT DISTINCT FROM k.run_level
            JOIN {store.table("layer")} s ON s.row = k.row
            LEFT JOIN _meta m ON m.tkey = k.tkey
            """
        kernels_sql = f"""
            CREATE TABLE {kernels} AS
            WITH repeated AS (
                SELECT tkey, run_level, module, start_ns, name FROM {calls} WHERE repeated
            ), modules AS (
                SELECT DISTINCT tkey, run_level, module FROM repeated
            ), moved AS (  -- the kernels of a module called more than once: their call
                SELECT k.row, c.name AS call
                FROM (
                    SELECT k.* FROM {store.table("kernel")} k SEMI JOIN modules m
                    ON m.tkey = k.tkey AND m.run_level = k.run_level AND m.module = k.layer
                ) k
                ASOF JOIN repeated c
                  ON c.tkey = k.tkey AND c.run_level = k.run_level AND c.module = k.layer
                 AND k.start_ns >= c.start_ns
            ), types AS (
                SELECT tkey, name, arg_min(type, row) AS layer_type FROM {calls}
                GROUP BY tkey, name
            )
            SELECT k.row, k.tkey, m.model::VARCHAR AS model, m.batch_size::BIGINT AS batch_size,
                   k.run_level, coalesce(mv.call, k.layer) AS layer, t.layer_type, k.idx,
                   k.name, k.kind, k.start_ns, k.end_ns, k.duration_ns, k.flops,
                   k.dram_read_bytes, k.dram_write_bytes, k.achieved_occupancy,
                   k.metrics_estimated
            FROM {store.table("kernel")} k
            LEFT JOIN moved mv ON mv.row = k.row
            LEFT JOIN types t ON t.tkey = k.tkey AND t.name = coalesce(mv.call, k.layer)
            LEFT JOIN _meta m ON m.tkey = k.tkey
            """
        con.execute(layers_sql)
        con.execute(kernels_sql)
        con.unregister("_meta")
        return cls(con, schema)

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pd.DataFrame:
        """`sql` (over the relations) run, its result as a DataFrame."""
        return self._cursor().execute(sql, params).df()

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> None:
        """`sql` run for its effect (a temporary table of intermediate rows, say: the calling
        thread's; a table the other threads read is made in the relations' schema)."""
        self._cursor().execute(sql, params)

    def scalar(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> Any:
        """The first value of the first row of `sql`'s result."""
        # (every row fetched: a result left open blocks the connection's next `register`)
        rows = self._cursor().execute(sql, params).fetchall()
        return rows[0][0] if rows else None

    def register(self, name: str, frame: pd.DataFrame) -> None:
        """A pandas frame as a relation `name` beside the others (small frames: per trace or
        per group, to join with), for the calling thread's queries."""
        self._cursor().register(name, frame)

    def unregister(self, name: str) -> None:
        self._cursor().unregister(name)


def kernel_rows(fr: SpanFrames) -> KernelRows:
    """`fr`'s spans as relations, made once per `Frames`."""
    return fr.memo("kernel_rows", lambda: _make(fr))


def _make(fr: SpanFrames) -> KernelRows:
    meta = fr.meta[["tkey", "model", "batch_size"]]
    return KernelRows.of(fr.data.span_store(), meta)
