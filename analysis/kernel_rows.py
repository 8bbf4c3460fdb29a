"""The selected traces' kernel-level spans as a DuckDB relation, for the kernel analyses.

The kernel level is most of a store's spans. The kernel analyses (A8-A15's kernel parts,
`time_breakdown`) read it through SQL over the relation `kernels`, one row per kernel-level
span that is work or an API call the loader kept, with these columns:

    row                 BIGINT   position in the loader's order (for "the first row" rules)
    tkey                BIGINT   the trace (`TraceData.traces["tkey"]`)
    model, batch_size   VARCHAR, BIGINT   the trace's group
    run_level           VARCHAR  the leveled run the span came from
    layer               VARCHAR  the layer call it ran under (`Frames.kernels`' rule), or NULL
    layer_type          VARCHAR  that layer's type, or NULL
    idx                 BIGINT
    name, kind          VARCHAR
    start_ns, end_ns, duration_ns   BIGINT
    flops, dram_read_bytes, dram_write_bytes, achieved_occupancy   DOUBLE (NULL: not recorded)
    metrics_estimated   BOOLEAN

The same connection holds the relation `layers`, the layer spans as the layer analyses
take them (`Frames.layers`: one run per trace, the L run where there is one; one row per
call; Keras ops outside layers left out), sorted by tkey, idx, start_ns:

    row                 BIGINT   position in that order (for "the first row" rules)
    tkey, model, batch_size, run_level   as above
    module              VARCHAR  the name the span was stored under
    name                VARCHAR  the call's name (`common.call_names`: `#n` for the n-th repeat)
    kind, op_type, type VARCHAR  (`type`: `common.layer_type`)
    idx                 BIGINT
    container           BOOLEAN  (`common.is_container`)
    start_ns, end_ns, duration_ns   BIGINT
    allocated_bytes, flops, dram_read_bytes, dram_write_bytes, leaf   DOUBLE (NULL: not recorded)
    flops_estimated, bytes_estimated   BOOLEAN
    original_nodes      VARCHAR  JSON text of the list (NULL where not recorded)
    input_shapes, output_shapes   VARCHAR  JSON text as stored

Results come back as pandas DataFrames of what the SQL aggregated, not of the spans.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from analysis.common import Frames

RELATION = "kernels"
COLUMNS = ("row", "tkey", "model", "batch_size", "run_level", "layer", "layer_type", "idx",
           "name", "kind", "start_ns", "end_ns", "duration_ns", "flops", "dram_read_bytes",
           "dram_write_bytes", "achieved_occupancy", "metrics_estimated")  # fmt: skip
_TYPES = {"row": "BIGINT", "tkey": "BIGINT", "model": "VARCHAR", "batch_size": "BIGINT",
          "run_level": "VARCHAR", "layer": "VARCHAR", "layer_type": "VARCHAR", "idx": "BIGINT",
          "name": "VARCHAR", "kind": "VARCHAR", "start_ns": "BIGINT", "end_ns": "BIGINT",
          "duration_ns": "BIGINT", "flops": "DOUBLE", "dram_read_bytes": "DOUBLE",
          "dram_write_bytes": "DOUBLE", "achieved_occupancy": "DOUBLE",
          "metrics_estimated": "BOOLEAN"}  # fmt: skip


LAYERS = "layers"
LAYER_TYPES = {"row": "BIGINT", "tkey": "BIGINT", "model": "VARCHAR", "batch_size": "BIGINT",
               "run_level": "VARCHAR", "module": "VARCHAR", "name": "VARCHAR",
               "kind": "VARCHAR", "op_type": "VARCHAR", "type": "VARCHAR", "idx": "BIGINT",
               "container": "BOOLEAN", "start_ns": "BIGINT", "end_ns": "BIGINT",
               "duration_ns": "BIGINT", "allocated_bytes": "DOUBLE", "flops": "DOUBLE",
               "dram_read_bytes": "DOUBLE", "dram_write_bytes": "DOUBLE", "leaf": "DOUBLE",
               "flops_estimated": "BOOLEAN", "bytes_estimated": "BOOLEAN",
               "original_nodes": "VARCHAR", "input_shapes": "VARCHAR",
               "output_shapes": "VARCHAR"}  # fmt: skip


def _json_or_none(value: object) -> str | None:
    return json.dumps(value) if isinstance(value, list | tuple | dict) else None


class KernelRows:
    """A DuckDB connection holding the relation `kernels` (see the module's docstring)."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self._con = con

    @classmethod
    def from_frame(cls, kernels: pd.DataFrame) -> KernelRows:
        """The relation over a pandas frame of kernel spans (`Frames.kernels`' columns and
        `end_ns`), in its row order."""
        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")
        frame = kernels.assign(row=np.arange(len(kernels), dtype="int64"))
        con.register("_kernel_frame", frame)
        cols = ", ".join(f'CAST("{c}" AS {_TYPES[c]}) AS "{c}"' for c in COLUMNS)
        con.execute(f"CREATE VIEW {RELATION} AS SELECT {cols} FROM _kernel_frame")
        return cls(con)

    def add_layers(self, layers: pd.DataFrame) -> None:
        """The relation `layers` over a pandas frame of `Frames.layers`, in its row order."""
        frame = layers.assign(
            row=np.arange(len(layers), dtype="int64"),
            original_nodes=[_json_or_none(v) for v in layers["original_nodes"]],
        )
        frame = frame[[c for c in LAYER_TYPES if c in frame.columns]]
        for col in frame.columns:
            if isinstance(frame[col].dtype, pd.CategoricalDtype):
                frame[col] = frame[col].astype(object)
        self._con.register("_layer_frame", frame)
        cols = ", ".join(
            f'CAST("{c}" AS {t}) AS "{c}"' if c in frame.columns else f'NULL::{t} AS "{c}"'
            for c, t in LAYER_TYPES.items()
        )
        self._con.execute(f"CREATE VIEW {LAYERS} AS SELECT {cols} FROM _layer_frame")

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

    def close(self) -> None:
        self._con.close()


def kernel_rows(fr: Frames) -> KernelRows:
    """`fr`'s kernels as a relation, made once per `Frames`."""
    return fr.memo("kernel_rows", lambda: _make(fr))


def _make(fr: Frames) -> KernelRows:
    out = KernelRows.from_frame(fr.kernels)
    out.add_layers(fr.layers)
    return out
