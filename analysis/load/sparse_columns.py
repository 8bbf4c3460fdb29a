"""Span columns that hold values on one level's spans only, held sparse in the loaded spans.

The relay's marks and a stream message's responses are read for request spans alone, a
layer's memory, leaf flag, op type and fused nodes for layer spans alone (the loader's
queries give every other span NULL there). Held dense, each such column costs 8 bytes on
every span, most of them kernels; held as a pandas `SparseArray`, only its values.
`Frames.at` hands the analyses each level's rows with its own columns dense again (missing
values NaN in numbers, None in objects, as the loader makes them); on the other levels they
stay sparse and all missing.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.load.store_file import RELAY_OFFSET_COLUMNS, STREAM_RESPONSE_COLUMNS
from sidecar.trace import schema

LEVEL_ONLY: dict[str, tuple[str, ...]] = {
    "request": (*RELAY_OFFSET_COLUMNS.values(), *STREAM_RESPONSE_COLUMNS),
    "layer": (
        schema.ALLOCATED_BYTES,
        schema.LEAF,
        schema.OP_TYPE,
        schema.ORIGINAL_NODES,
        schema.ORIGINAL_OP_TYPES,
    ),
}
HELD_SPARSE = frozenset(c for columns in LEVEL_ONLY.values() for c in columns)


def sparse(values: np.ndarray) -> pd.arrays.SparseArray:
    """`values` (float64 with NaN, or objects with None where missing) as a sparse array."""
    return pd.arrays.SparseArray(values, fill_value=np.nan)


def dense(frame: pd.DataFrame, level: str) -> pd.DataFrame:
    """`frame` (rows of `level`) with the sparse columns that `level` owns made dense."""
    own = [
        c
        for c in LEVEL_ONLY.get(level, ())
        if c in frame.columns and isinstance(frame[c].dtype, pd.SparseDtype)
    ]
    if not own:
        return frame
    columns = {}
    for c in own:
        held: pd.arrays.SparseArray = frame[c].array
        if held.dtype.subtype == np.dtype(object):
            values = np.full(len(held), None, dtype=object)
            values[held.sp_index.indices] = held.sp_values
        else:
            values = held.to_dense()
        columns[c] = values
    return frame.assign(**columns)
