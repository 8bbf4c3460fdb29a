"""A string column coded batch by batch: integer codes per row, one dictionary for all.

The loader takes a store's spans in batches; a span's names, levels, kinds and trace ids are
a few thousand distinct strings over millions of rows. Held as Python objects each row costs
a pointer and each batch its own string objects; `StringCodes` keeps, per batch, an `int32`
code per row and, once, each distinct string, and makes the whole column a pandas
categorical with the categories sorted (so that sorting and grouping by it order the rows as
the strings themselves would).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

MISSING = -1  # the code of a missing value (None or NaN), as pandas' categoricals have it


class StringCodes:
    """Codes of one column's values, batch after batch (`codes`); `categorical` makes a
    column of codes (in any order of the batches' rows) a categorical."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}  # each distinct string -> its code, in order seen

    def codes(self, values: np.ndarray | pd.Series) -> np.ndarray:
        """The code of each value (`MISSING` where it is missing), `int16` while the
        strings seen number fewer than 2**15, else `int32`; values other than strings and
        missing ones are refused (`TypeError`). A categorical's codes are taken as they are
        (its categories looked up once each), others' values factorized."""
        if isinstance(values, pd.Series) and isinstance(values.dtype, pd.CategoricalDtype):
            local, uniques = values.cat.codes.to_numpy(), values.cat.categories.to_numpy(object)
        else:
            local, uniques = pd.factorize(np.asarray(values), use_na_sentinel=True)
        if not all(type(u) is str for u in uniques):
            raise TypeError("StringCodes takes strings and missing values only")
        ids = self._ids
        mapping = np.array([ids.setdefault(u, len(ids)) for u in uniques] + [MISSING], np.int32)
        if len(ids) < 1 << 15:
            mapping = mapping.astype(np.int16)
        return mapping[local]  # (local code -1 takes the last entry: MISSING)

    def categorical(self, codes: np.ndarray) -> pd.Categorical:
        """`codes` (from `codes`) as a categorical whose categories are the strings sorted,
        its codes as narrow as their number allows."""
        seen = np.array(list(self._ids), dtype=object)
        order = np.argsort(seen, kind="stable")
        new = np.empty(len(seen) + 1, dtype=np.int32)
        new[order] = np.arange(len(seen), dtype=np.int32)
        new[-1] = MISSING  # (code -1 takes the last entry)
        categories = pd.Index(seen[order], dtype=object)
        return pd.Categorical.from_codes(new[codes], dtype=pd.CategoricalDtype(categories))
