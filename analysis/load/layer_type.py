"""A layer's type (`layer_type`), as the loader stores it with each layer span."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sidecar.trace import schema


def layer_type(layers: pd.DataFrame) -> pd.Series:
    """A layer's type as it is: what it fused where it computes two or more graph nodes
    (`Conv+Relu` from `original_op_types`, as the runner records for new traces and older
    stores lack), else its `op_type`, else the span's kind."""
    runtime = layers[schema.OP_TYPE].fillna(layers["kind"]).astype(str)
    if schema.ORIGINAL_OP_TYPES not in layers.columns:
        return runtime
    # once per distinct object: the loader's rows share one list per distinct JSON text
    values = layers[schema.ORIGINAL_OP_TYPES].to_numpy(object)
    ids = np.fromiter(map(id, values), dtype=np.uint64, count=len(values))
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    types = np.empty(len(first), dtype=object)
    types[:] = [fused(values[i]) for i in first.tolist()]
    return pd.Series(types[inverse], index=layers.index, dtype=object).fillna(runtime).astype(str)


def fused(types: Any) -> str | None:
    """What a layer computing the graph nodes of `types` fused (`Conv+Relu`), where it is
    two or more."""
    return "+".join(str(t) for t in types) if isinstance(types, list) and len(types) > 1 else None
