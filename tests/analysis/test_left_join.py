"""`common.left_join` is pandas' left merge on unique right keys (without copying the left
frame's columns): the same frame, dtypes and fill, for matched, missing and NaN keys."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.common import left_join


def _left() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "tkey": [2, 0, 1, 2, 5, 0],
            "layer": ["a", "b", None, "a", "a", "c"],
            "v": np.arange(6.0),
        },
        index=[10, 11, 12, 13, 14, 15],
    )


def _right() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "tkey": [0, 1, 2, 0],
            "layer": ["b", None, "a", "c"],
            "batch_size": pd.array([1, 2, 4, 8], dtype="Int64"),
            "n": [1, 2, 3, 4],
            "flag": [True, False, True, True],
            "name": ["x", "y", "z", "w"],
        }
    )


@pytest.mark.parametrize("on", [["tkey", "layer"], ["tkey"]])
def test_left_join_is_the_left_merge(on: list[str]) -> None:
    left, right = _left(), _right()
    if on == ["tkey"]:
        right = right.drop_duplicates("tkey").drop(columns="layer")
    pd.testing.assert_frame_equal(left_join(left, right, on), left.merge(right, on=on, how="left"))


def test_all_matched_keeps_the_dtypes() -> None:
    left = _left()[_left()["tkey"] != 5]
    right = _right().drop_duplicates("tkey").drop(columns="layer")
    got = left_join(left, right, ["tkey"])
    pd.testing.assert_frame_equal(got, left.merge(right, on="tkey", how="left"))
    assert got["n"].dtype == np.int64 and got["flag"].dtype == bool


def test_repeated_right_keys_fall_back_to_merge() -> None:
    left, right = _left(), _right().drop(columns="layer")
    pd.testing.assert_frame_equal(
        left_join(left, right, ["tkey"]), left.merge(right, on="tkey", how="left")
    )
