"""`StringCodes`: codes batch by batch, narrow while the strings are few, and a categorical
with the strings sorted whatever the order they came in."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.load.string_codes import StringCodes


def test_codes_widen_past_the_int16_range_and_keep_their_strings() -> None:
    codes = StringCodes()
    first = np.array(["b", None, "a", "b"], dtype=object)
    many = np.array([*(f"s{i:06d}" for i in range(40_000, 0, -1)), np.nan], dtype=object)
    one, two = codes.codes(first), codes.codes(many)
    assert one.dtype == np.int16 and two.dtype == np.int32
    column = codes.categorical(np.concatenate([one, two]))
    assert list(column.categories[:3]) == ["a", "b", "s000001"]
    want = pd.Series(np.concatenate([first, many]), dtype=object)
    assert column.astype(object).tolist()[:4] == ["b", np.nan, "a", "b"]
    pd.testing.assert_series_equal(
        pd.Series(column.astype(object)).fillna(np.nan), want.fillna(np.nan)
    )
