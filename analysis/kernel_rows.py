"""The selected traces' kernel-level spans in DuckDB, for the kernel analyses.

The kernel level is most of a store's spans. The loader does not hold it as a pandas frame:
it hands each batch's kernel-level rows to `KernelSpans`, a DuckDB database in a temporary
folder whose memory is bounded (`MEMORY_LIMIT`; what does not fit is written to disk). The
kernel analyses (A8-A15's kernel parts, `time_breakdown`) read it through SQL over the
relation `kernels` of `kernel_rows(fr)`, one row per kernel-level span the loader kept
(work and the API records kept), with these columns:

    row                 BIGINT   position in the loader's order (for "the first row" rules)
    tkey                BIGINT   the trace (`TraceData.traces["tkey"]`)
    model, batch_size   VARCHAR, BIGINT   the trace's group
    run_level           VARCHAR  the leveled run the span came from
    layer               VARCHAR  the layer call it ran under, or NULL: the stored layer (its
                                 parent's, or its launch's parent's, name); where the run
                                 called that module more than once, the last call of that
                                 name to start at or before the kernel (`common.call_names`)
    layer_type          VARCHAR  that layer's type (`common.layer_type`), or NULL
    idx                 BIGINT
    name, kind          VARCHAR
    start_ns, end_ns, duration_ns   BIGINT
    flops, dram_read_bytes, dram_write_bytes, achieved_occupancy   DOUBLE (NULL: not recorded)
    metrics_estimated   BOOLEAN

Results come back as pandas DataFrames of what the SQL aggregated, not of the spans.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import weakref
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from analysis.common import Frames

RELATION = "kernels"
MEMORY_LIMIT = "128MB"  # DuckDB's buffer for the kernel spans; the rest goes to disk
# the columns of a kernel-level span as the loader stores them (`layer`: the stored name)
STORED = {"row": "BIGINT", "tkey": "BIGINT", "run_level": "VARCHAR", "layer": "VARCHAR",
          "idx": "BIGINT", "name": "VARCHAR", "kind": "VARCHAR", "start_ns": "BIGINT",
          "end_ns": "BIGINT", "duration_ns": "BIGINT", "flops": "DOUBLE",
          "dram_read_bytes": "DOUBLE", "dram_write_bytes": "DOUBLE",
          "achieved_occupancy": "DOUBLE", "metrics_estimated": "BOOLEAN"}  # fmt: skip
COLUMNS = ("row", "tkey", "model", "batch_size", "run_level", "layer", "layer_type", "idx",
           "name", "kind", "start_ns", "end_ns", "duration_ns", "flops", "dram_read_bytes",
           "dram_write_bytes", "achieved_occupancy", "metrics_estimated")  # fmt: skip
_names = itertools.count()


class KernelSpans:
    """The kernel-level spans the loader read (`add`, batch by batch), stored in DuckDB;
    `restricted` to some traces for a subset of them (`TraceData.subset`)."""

    def __init__(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="xsp-kernels-"))
        self._con = duckdb.connect()  # in memory, spilling to the folder past its limit
        for setting in (
            f"SET memory_limit = '{MEMORY_LIMIT}'",
            f"SET temp_directory = '{self._folder / 'spill'}'",
            "SET enable_progress_bar = false",
            "SET preserve_insertion_order = true",
        ):
            self._con.execute(setting)
        cols = ", ".join(f'"{c}" {t}' for c, t in STORED.items())
        self._con.execute(f"CREATE TABLE kernel_spans ({cols})")
        self._rows = 0
        self.table = "kernel_spans"
        self.tkeys: frozenset[int] | None = None  # None: every trace's
        self._closer = weakref.finalize(self, _remove, self._con, self._folder)

    @classmethod
    def from_frame(cls, spans: pd.DataFrame) -> KernelSpans:
        """The kernel-level rows of a frame of spans (a `TraceData` made in memory)."""
        out = cls()
        out.add(spans[spans["level"] == "kernel"])
        return out

    def add(self, spans: pd.DataFrame) -> None:
        """Kernel-level spans (the loader's typed columns, with `tkey`), in the loader's order."""
        if spans.empty:
            return
        frame = pd.DataFrame(
            {c: _column(spans, c) for c in STORED if c != "row"},
        )
        frame.insert(0, "row", np.arange(self._rows, self._rows + len(frame), dtype="int64"))
        self._rows += len(frame)
        self._con.register("_batch", frame)
        try:
            cols = ", ".join(f'CAST("{c}" AS {t})' for c, t in STORED.items())
            self._con.execute(f"INSERT INTO kernel_spans SELECT {cols} FROM _batch")
        finally:
            self._con.unregister("_batch")

    def restricted(self, tkeys: Collection[int]) -> KernelSpans:
        """The same spans, of the traces `tkeys` only (a view of this store's table)."""
        out = object.__new__(KernelSpans)
        out.__dict__.update(self.__dict__)
        out.tkeys = frozenset(int(k) for k in tkeys) & (self.tkeys or frozenset(tkeys))
        return out

    def count(self) -> int:
        where = self._where()
        (n,) = self._con.execute(f"SELECT count(*) FROM kernel_spans{where}").fetchone() or (0,)
        return int(n)

    def _where(self) -> str:
        if self.tkeys is None:
            return ""
        keys = ", ".join(str(k) for k in sorted(self.tkeys)) or "NULL"
        return f" WHERE tkey IN ({keys})"

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of its own to the spans' database (its own registered frames)."""
        return self._con.cursor()

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


class KernelRows:
    """A DuckDB connection holding the relation `kernels` (see the module's docstring)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, table: str | None = None) -> None:
        self._con = con
        self._table = table

    @classmethod
    def of(cls, spans: KernelSpans, calls: pd.DataFrame, meta: pd.DataFrame) -> KernelRows:
        """`kernels` over `spans`, each kernel's layer moved to its call and typed from
        `calls` (tkey, run_level, module, name: the call's name, start_ns, layer_type; every
        layer span), its group from `meta` (tkey, model, batch_size)."""
        con = spans.cursor()
        keys = ["tkey", "run_level", "module"]
        repeated = calls[calls.duplicated(keys, keep=False)]
        con.register("_repeated", repeated[[*keys, "start_ns", "name"]].astype(object))
        types = calls[["tkey", "name", "layer_type"]].drop_duplicates(["tkey", "name"])
        con.register("_types", types.astype({"name": object, "layer_type": object}))
        con.register("_meta", meta.astype({"model": object}))
        table = f"kernels_{next(_names)}"
        con.execute(
            f"""
            CREATE TABLE {table} AS
            SELECT k.row, k.tkey, m.model::VARCHAR AS model, m.batch_size::BIGINT AS batch_size,
                   k.run_level, coalesce(c.name::VARCHAR, k.layer) AS layer,
                   t.layer_type::VARCHAR AS layer_type, k.idx, k.name, k.kind, k.start_ns,
                   k.end_ns, k.duration_ns, k.flops, k.dram_read_bytes, k.dram_write_bytes,
                   k.achieved_occupancy, k.metrics_estimated
            FROM (SELECT * FROM {spans.table}{spans._where()}) k
            ASOF LEFT JOIN _repeated c
              ON c.tkey = k.tkey AND c.run_level = k.run_level AND c.module = k.layer
             AND k.start_ns >= c.start_ns
            LEFT JOIN _types t ON t.tkey = k.tkey AND t.name = coalesce(c.name::VARCHAR, k.layer)
            LEFT JOIN _meta m ON m.tkey = k.tkey
            ORDER BY k.row
            """
        )
        for name in ("_repeated", "_types", "_meta"):
            con.unregister(name)
        con.execute(f"CREATE TEMP VIEW {RELATION} AS SELECT * FROM {table}")
        return cls(con, table)

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pd.DataFrame:
        """`sql` (over the relation `kernels`) run, its result as a DataFrame."""
        return self._con.execute(sql, params).df()

    def scalar(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> Any:
        """The first value of the first row of `sql`'s result."""
        row = self._con.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def register(self, name: str, frame: pd.DataFrame) -> None:
        """A pandas frame as a relation `name` beside `kernels` (small frames: per trace or
        per layer, to join with)."""
        self._con.register(name, frame)

    def unregister(self, name: str) -> None:
        self._con.unregister(name)

    def close(self) -> None:
        if self._table is not None:
            self._con.execute(f"DROP TABLE IF EXISTS {self._table}")
        self._con.close()


def kernel_rows(fr: Frames) -> KernelRows:
    """`fr`'s kernels as a relation, made once per `Frames`."""
    return fr.memo("kernel_rows", lambda: _make(fr))


def _make(fr: Frames) -> KernelRows:
    from analysis.common import layer_type

    calls = fr.layer_calls
    calls = calls.assign(layer_type=layer_type(calls))[
        ["tkey", "run_level", "module", "name", "start_ns", "layer_type"]
    ]
    meta = fr.meta[["tkey", "model", "batch_size"]]
    return KernelRows.of(fr.data.kernel_spans(), calls, meta)
