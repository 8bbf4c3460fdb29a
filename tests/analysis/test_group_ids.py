"""`group_ids` numbers rows as pandas' `groupby(..., dropna=False, sort=True,
observed=True).ngroup()` does: categorical, nullable integer, float and object keys with
missing values, and keys pandas must number itself (mixed types)."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.common import across_traces
from analysis.analyses.group_ids import group_ids


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = random.Random(seed)
    names = ["conv", "relu", "gemm", "add", None]
    return pd.DataFrame(
        {
            "cat": pd.Categorical(
                [rng.choice(names) for _ in range(n)], categories=["relu", "add", "conv", "gemm"]
            ),
            "obj": np.array([rng.choice(names) for _ in range(n)], dtype=object),
            "batch": pd.array([rng.choice([1, 8, 2, None]) for _ in range(n)], dtype="Int64"),
            "x": [rng.choice([0.5, -1.0, np.nan]) for _ in range(n)],
            "i": [rng.randrange(7) for _ in range(n)],
        }
    )


@pytest.mark.parametrize(
    "keys", [["cat"], ["obj", "batch"], ["batch", "cat", "x", "i"], ["i"], ["x", "obj"]]
)
def test_numbers_groups_as_pandas_does(keys: list[str]) -> None:
    df = _frame(500, len(keys))
    want = df.groupby(keys, dropna=False, sort=True, observed=True).ngroup().to_numpy()
    gid, first = group_ids(df, keys)
    np.testing.assert_array_equal(gid, want)
    np.testing.assert_array_equal(first, np.unique(want, return_index=True)[1])


def test_keys_that_cannot_be_sorted_are_left_to_pandas() -> None:
    df = pd.DataFrame({"k": np.array(["b", 1, "a", 1, None], dtype=object), "i": range(5)})
    want = df.groupby(["k"], dropna=False, sort=True, observed=True).ngroup().to_numpy()
    np.testing.assert_array_equal(group_ids(df, ["k"])[0], want)


@pytest.mark.parametrize("share", [0.0, 0.3, 0.9, 1.0])
def test_rows_taken_by_mask_are_the_filtered_frames(share: float) -> None:
    """`across_traces(df, ..., rows=mask)` is `across_traces(df[mask], ...)`, bit for bit."""
    df = _frame(600, 3).assign(
        tkey=lambda d: np.arange(len(d)) % 17, v=np.random.default_rng(1).normal(size=600)
    )
    mask = np.random.default_rng(2).random(len(df)) < share
    keys, values = ["cat", "batch", "i"], ["v", "x"]
    want = across_traces(df[mask], keys, values, first=["obj"])
    got = across_traces(df, keys, values, first=["obj"], rows=mask)
    pd.testing.assert_frame_equal(got, want, check_dtype=share > 0)
