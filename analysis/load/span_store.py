"""The kernel- and layer-level spans in DuckDB as the loader reads them: `SpanStore`.

The kernel and layer levels are nearly all of a store's spans. The loader does not hold them
as a pandas frame: it hands each batch's rows of those levels to `SpanStore`, a DuckDB
database in memory up to `MEMORY_LIMIT` (`analysis.tuning`), past which it writes to a
temporary folder, so that the report's memory does not grow with the store. The relations
the analyses read (`analysis.relations.kernel_rows`) are tables of the store's second
database (`RELATIONS`).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Collection
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from analysis.load.layer_type import layer_type
from analysis.tuning import INSERT_ROWS, MEMORY_LIMIT, THREADS
from sidecar.trace import schema

LEVELS = ("kernel", "layer")  # the levels held here, not in `TraceData.spans`
CATALOG = "spans"  # the database the spans are in
# the database of the relations (a schema per `KernelRows`): in memory, not compressed (as
# DuckDB's temporary tables are: made 2-8 times faster than in the spans' database), spilled
# to the same folder past the same limit
RELATIONS = "relations"
# the columns of each level's spans as the loader stores them
STORED = {
    "kernel": {"row": "BIGINT", "tkey": "BIGINT", "run_level": "VARCHAR", "layer": "VARCHAR",
               "idx": "BIGINT", "name": "VARCHAR", "kind": "VARCHAR", "start_ns": "BIGINT",
               "end_ns": "BIGINT", "duration_ns": "BIGINT", schema.FLOPS: "DOUBLE",
               schema.DRAM_READ_BYTES: "DOUBLE", schema.DRAM_WRITE_BYTES: "DOUBLE",
               schema.ACHIEVED_OCCUPANCY: "DOUBLE", schema.METRICS_ESTIMATED: "BOOLEAN"},
    "layer": {"row": "BIGINT", "tkey": "BIGINT", "run_level": "VARCHAR", "name": "VARCHAR",
              "kind": "VARCHAR", "idx": "BIGINT", "start_ns": "BIGINT", "end_ns": "BIGINT",
              "duration_ns": "BIGINT", schema.ALLOCATED_BYTES: "DOUBLE", schema.LEAF: "DOUBLE",
              schema.FLOPS: "DOUBLE", schema.DRAM_READ_BYTES: "DOUBLE",
              schema.DRAM_WRITE_BYTES: "DOUBLE",
              schema.FLOPS_ESTIMATED: "BOOLEAN", schema.BYTES_ESTIMATED: "BOOLEAN",
              schema.OUTSIDE_LAYERS: "BOOLEAN", schema.OP_TYPE: "VARCHAR", "type": "VARCHAR",
              schema.ORIGINAL_NODES: "VARCHAR", schema.INPUT_SHAPES: "VARCHAR",
              schema.OUTPUT_SHAPES: "VARCHAR"},
}  # fmt: skip
JSON_TEXT = (schema.ORIGINAL_NODES,)  # layer attributes kept as the stored JSON text


class SpanStore:
    """The kernel- and layer-level spans the loader read (`add`, batch by batch), in
    DuckDB; `restricted` to some traces for a subset of them (`TraceData.subset`)."""

    def __init__(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="xsp-spans-"))
        self._con = duckdb.connect()
        for setting in (
            f"SET memory_limit = '{MEMORY_LIMIT}'",
            f"SET temp_directory = '{self._folder}'",  # where it spills past its limit
            "SET enable_progress_bar = false",
            "SET preserve_insertion_order = false",  # (`row` holds the order; less to hold)
            f"SET threads = {THREADS}",
            # in memory, compressed as on disk (a third of the size for spans, and less to
            # spill): the spans' strings repeat (names, kinds, shapes)
            f"ATTACH ':memory:' AS {CATALOG} (COMPRESS)",
            f"ATTACH ':memory:' AS {RELATIONS}",
            f"USE {CATALOG}",
        ):
            self._con.execute(setting)
        for level, columns in STORED.items():
            cols = ", ".join(f'"{c}" {t}' for c, t in columns.items())
            self._con.execute(f"CREATE TABLE {level}_spans ({cols})")
        self.tkeys: frozenset[int] | None = None  # None: every trace's
        self._read = 0  # rows read so far (`positions`)
        self._pending: dict[str, list[Any]] = {}  # level -> Arrow tables not yet inserted
        self._closer = weakref.finalize(self, _remove, self._con, self._folder)

    @classmethod
    def from_frame(cls, spans: pd.DataFrame) -> SpanStore:
        """The kernel- and layer-level rows of a frame of spans (data made in memory), their
        list attributes written as JSON."""
        out = cls()
        for level in LEVELS:
            rows = spans[spans["level"] == level]
            if level == "layer":
                json_text = {c: _json(rows[c]) for c in JSON_TEXT if c in rows}
                rows = rows.assign(type=layer_type(rows), **json_text)
            out.add(level, rows.assign(row=np.arange(len(rows), dtype="int64")))
        return out

    def positions(self, n: int) -> np.ndarray:
        """The next `n` positions in the loader's order (over every store loaded)."""
        out = np.arange(self._read, self._read + n, dtype="int64")
        self._read += n
        return out

    def add(self, level: str, spans: pd.DataFrame) -> None:
        """Spans of `level` (the loader's typed columns, with `tkey` and `row`, their
        position in the loader's order; a layer's `type` (`layer_type`) and its `JSON_TEXT`
        attributes as JSON text)."""
        if spans.empty:
            return
        frame = pd.DataFrame({c: _column(spans, c) for c in STORED[level]})
        self._insert(level, frame, {})

    def add_arrow(self, level: str, table: Any) -> None:
        """Spans of `level` as the reader hands them over (`arrow_spans`: its columns, with
        `tkey`, `_pos` for `row`, a layer's decoded `op_type` and its `type`). Kernels are
        inserted a row group at a time (`flush` inserts the rest): DuckDB compresses each
        insert's row group anew, so smaller inserts cost more."""
        pending = self._pending.setdefault(level, [])
        pending.append(table)
        if sum(t.num_rows for t in pending) >= INSERT_ROWS[level]:
            self._flush(level)

    def flush(self) -> None:
        """Insert the spans `add_arrow` still holds."""
        for level in list(self._pending):
            self._flush(level)

    def _flush(self, level: str) -> None:
        import pyarrow as pa

        tables = self._pending.pop(level, [])
        if not tables:
            return
        table = pa.concat_tables(tables, promote_options="permissive")
        flags = [c for c, t in STORED[level].items() if t == "BOOLEAN"]
        self._insert(
            level, table, {"row": '"_pos"'} | {f: f'coalesce("{f}" > 0, false)' for f in flags}
        )

    def _insert(self, level: str, batch: Any, exprs: dict[str, str]) -> None:
        self._con.register("_batch", batch)
        try:
            cols = ", ".join(
                "CAST(" + exprs.get(c, f'"{c}"') + f" AS {t})" for c, t in STORED[level].items()
            )
            self._con.execute(f"INSERT INTO {level}_spans SELECT {cols} FROM _batch")
        finally:
            self._con.unregister("_batch")

    def restricted(self, tkeys: Collection[int]) -> SpanStore:
        """The same spans, of the traces `tkeys` only (views of this store's tables)."""
        self.flush()
        out = object.__new__(SpanStore)
        out.__dict__.update(self.__dict__)
        keys = frozenset(int(k) for k in tkeys)
        out.tkeys = keys if self.tkeys is None else keys & self.tkeys
        return out

    def table(self, level: str) -> str:
        """SQL for the stored spans of `level` (of the traces kept), from any schema."""
        name = f"{CATALOG}.main.{level}_spans"
        if self.tkeys is None:
            return name
        keys = ", ".join(str(k) for k in sorted(self.tkeys)) or "NULL"
        return f"(SELECT * FROM {name} WHERE tkey IN ({keys}))"

    def count(self, level: str) -> int:
        """The spans of `level` held (from any thread: on a connection of its own; the
        store's own refuses a second caller while it is busy)."""
        con = self.cursor()
        try:
            rows = con.execute(f"SELECT count(*) FROM {self.table(level)}").fetchall()
        finally:
            con.close()
        return int(rows[0][0])

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of its own to the spans' database (its own registered frames)."""
        self.flush()
        con = self._con.cursor()
        con.execute(f"USE {CATALOG}")
        return con

    def close(self) -> None:
        self._closer()


def _remove(con: duckdb.DuckDBPyConnection, folder: Path) -> None:
    con.close()
    shutil.rmtree(folder, ignore_errors=True)


def _column(spans: pd.DataFrame, name: str) -> Any:
    values = spans[name]
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.array
    if isinstance(values.dtype, pd.SparseDtype):
        return values.sparse.to_dense().to_numpy()
    return values.to_numpy()


def _json(values: pd.Series) -> list[str | None]:
    import json

    return [None if v is None or v is np.nan else json.dumps(v) for v in values]
