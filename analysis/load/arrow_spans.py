"""A batch's sound kernel- and layer-level spans, from its Arrow table into the `SpanStore`.

Most of a store's spans are kernels and layers with nothing wrong with them. The loader hands
those to DuckDB as they come from the reader (`columnar.SpanBatches`: dictionary-encoded
Arrow), with no pandas frame and no Python object per row: what a row needs that the reader
did not compute (its trace's `tkey`, a layer's type and decoded `op_type`) is worked out once
per distinct value of the batch's dictionaries. The rest of the batch (other levels, damaged
rows, rows with an attribute value ignored) goes the pandas way (`tracedb`), which names
what it skips.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from analysis.load.layer_type import fused
from analysis.load.span_store import LEVELS, SpanStore
from sidecar.trace import schema

POSITION = "_pos"  # a row's position among all rows read (the store's `row`)


def store_plain(table: pa.Table, keys: pd.Series, store: SpanStore) -> pa.Table:
    """Put the sound kernel- and layer-level rows of `table` (which has `POSITION`) that
    belong to the traces of `keys` (trace id -> tkey) into `store`; returns the other rows."""
    level = _codes_of(table, "level", LEVELS)
    plain = pc.and_(pc.is_null(table.column("_bad")), pc.is_null(table.column("_wrong")))
    tkeys = _tkeys(table.column("trace_id"), keys)
    taken = pc.and_(plain, pc.is_valid(tkeys))
    with_tkeys = table.append_column("tkey", tkeys)
    kept = np.zeros(table.num_rows, dtype=bool)
    for name, mask in zip(LEVELS, level, strict=True):
        rows = pc.and_(taken, pa.array(mask)).to_numpy(zero_copy_only=False)
        if rows.any():
            kept |= rows
            part = with_tkeys.filter(pa.array(rows))
            store.add_arrow(name, _layer_columns(part) if name == "layer" else part)
    return table.filter(pa.array(~kept)) if kept.any() else table


def _codes_of(table: pa.Table, column: str, values: tuple[str, ...]) -> list[np.ndarray]:
    """Per value: a mask of the rows whose dictionary-encoded `column` holds it."""
    array = table.column(column).combine_chunks()
    if not pa.types.is_dictionary(array.type):
        text = array.to_numpy(zero_copy_only=False)
        return [text == v for v in values]
    names = array.dictionary.to_pylist()
    codes = array.indices.fill_null(-1).to_numpy(zero_copy_only=False)
    return [codes == names.index(v) if v in names else np.zeros(len(codes), bool) for v in values]


def _tkeys(trace_ids: Any, keys: pd.Series) -> pa.Array:
    """Each row's tkey (null where its trace is not among `keys`), looked up per distinct id."""
    array = trace_ids.combine_chunks()
    if not pa.types.is_dictionary(array.type):
        return pa.array(keys.reindex(array.to_pandas()).to_numpy(), pa.float64()).cast(pa.int64())
    per_id = keys.reindex(array.dictionary.to_pandas()).to_numpy("float64")
    values = pa.array(per_id, mask=np.isnan(per_id)).cast(pa.int64())
    return values.take(array.indices)


def _per_distinct(column: Any, decode: Any) -> pa.Array:
    """A string column made of `decode(text)` of each distinct JSON text of `column`."""
    array = column.combine_chunks()
    if not pa.types.is_dictionary(array.type):
        array = array.dictionary_encode()
    decoded = [None if t is None else decode(json.loads(t)) for t in array.dictionary.to_pylist()]
    return pa.array(decoded, pa.string()).take(array.indices)


def _as_text(value: Any) -> str | None:
    return None if value is None else str(value)


def _layer_columns(part: pa.Table) -> pa.Table:
    """Layer rows with `op_type` decoded and `type` (`layer_type.layer_type`'s rule: what it
    fused, else its op_type, else its kind)."""
    op_type = _per_distinct(part.column(schema.OP_TYPE), _as_text)
    fused_types = _per_distinct(part.column(schema.ORIGINAL_OP_TYPES), fused)
    kind = part.column("kind").combine_chunks().cast(pa.string())
    kind = pc.fill_null(kind, "nan")  # (pandas' text of a missing kind)
    kind_type = pc.coalesce(fused_types, op_type, kind)
    at = part.schema.get_field_index(schema.OP_TYPE)
    return part.set_column(at, schema.OP_TYPE, op_type).append_column("type", kind_type)
