"""Group numbers of a frame's rows by integer codes, as `groupby(keys, dropna=False,
sort=True, observed=True).ngroup()` numbers them, with fewer temporaries.

pandas factorizes each key into `int64` codes and then compresses them, several arrays of
eight bytes per row at once; over the kernel spans of a large store (most of its spans) that
set the analyses' peak. Here a categorical key gives its own (narrow) codes, any other key
is factorized in sorted order, missing values last; the codes are combined into one number
per row and numbered by `np.unique`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

_LIMIT = 1 << 62  # combined codes beyond this would overflow int64: pandas numbers them


def group_ids(
    df: pd.DataFrame, keys: Sequence[str], rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per row (of those `rows` marks, if given): its group's number (0.., in the keys'
    sorted order, missing values last); and per group, the position of its first row among
    those rows."""
    combined: np.ndarray | None = None
    size = 1
    for key in keys:
        codes, n = _sorted_codes(df[key], rows)
        if codes is None or size * n >= _LIMIT:
            taken = df if rows is None else df[list(keys)][rows]
            gid = taken.groupby(list(keys), dropna=False, sort=True, observed=True).ngroup()
            _, first = np.unique(gid.to_numpy(), return_index=True)
            return gid.to_numpy(np.int64), first
        combined = codes if combined is None else combined * n + codes
        size *= n
    if combined is None:
        combined = np.zeros(len(df) if rows is None else int(rows.sum()), dtype=np.int64)
    _, first, inverse = np.unique(combined, return_index=True, return_inverse=True)
    return inverse.reshape(-1), first


def _sorted_codes(values: pd.Series, rows: np.ndarray | None) -> tuple[np.ndarray | None, int]:
    """`int64` codes of `values` (of those `rows` marks) in the order groupby sorts them (a
    categorical's categories, else the values sorted), a missing value the last code; None
    where the values cannot be sorted (mixed types: pandas then decides). The rows are taken
    from the arrays, not the Series (whose index a filter would materialize and keep)."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        codes = values.cat.codes.to_numpy()
        codes = (codes if rows is None else codes[rows]).astype(np.int64)
        n = len(values.cat.categories) + 1
    else:
        array = values.to_numpy() if isinstance(values.dtype, np.dtype) else values.array
        array = array if rows is None else array[rows]
        try:
            codes, uniques = pd.factorize(array, sort=True, use_na_sentinel=True)
        except TypeError:
            return None, 0
        codes = codes.astype(np.int64, copy=False)
        n = len(uniques) + 1
    codes[codes < 0] = n - 1
    return codes, n
