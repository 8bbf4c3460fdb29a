"""The loader keeps each level's spans together (`LevelRows`, batch by batch), so that
`Frames.at` slices them; a frame in any other order is split by `groupby`, with the same
rows, order and index labels."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.common import _level_slices
from analysis.load.level_rows import LevelRows


def _spans() -> pd.DataFrame:
    levels = ["model", "layer", "kernel", "layer", "kernel", "kernel", None, "model", "layer"]
    return pd.DataFrame({"level": levels, "n": np.arange(len(levels))}, index=np.arange(9) * 10)


def _by_groupby(spans: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {str(k): g for k, g in spans.groupby("level", sort=False)}


def test_levels_gathered_batch_by_batch_are_the_groupby_split() -> None:
    spans = _spans()
    rows = LevelRows()
    for batch in (spans.iloc[:4], spans.iloc[4:4], spans.iloc[4:7], spans.iloc[7:]):
        rows.add(batch)
    ordered = rows.frame()
    assert list(ordered["level"]) == ["model"] * 2 + ["layer"] * 3 + ["kernel"] * 3 + [None]
    assert list(ordered.loc[ordered["level"] == "layer", "n"]) == [1, 3, 8]
    assert list(ordered.index) == [0, 7, 1, 3, 8, 2, 4, 5, 6]  # each row's position
    spans = spans.reset_index(drop=True)
    got, want = _level_slices(ordered), _by_groupby(spans)
    assert got.keys() == want.keys()
    for level, frame in want.items():
        pd.testing.assert_frame_equal(got[level], frame)
    # slices of the loaded frame, not copies
    assert np.shares_memory(got["layer"]["n"].to_numpy(), ordered["n"].to_numpy())


def test_interleaved_levels_are_split_by_groupby() -> None:
    spans = _spans()
    got, want = _level_slices(spans), _by_groupby(spans)
    assert got.keys() == want.keys() == {"model", "layer", "kernel"}
    for level, frame in want.items():
        pd.testing.assert_frame_equal(got[level], frame)
    assert _level_slices(spans.iloc[:0]) == {}


def test_missing_levels_are_one_level_and_no_rows_keep_the_columns() -> None:
    rows = LevelRows()
    rows.add(pd.DataFrame({"level": ["a", None], "n": [0, 1]}))
    rows.add(pd.DataFrame({"level": [np.nan, "a"], "n": [2, 3]}))
    assert list(rows.frame()["n"]) == [0, 3, 1, 2]
    none = LevelRows()
    none.add(pd.DataFrame({"level": pd.Series([], dtype=object), "n": pd.Series([], dtype=int)}))
    assert list(none.frame().columns) == ["level", "n"]


def test_coded_columns_are_categoricals_of_the_strings_sorted_across_batches() -> None:
    """Columns named in `coded` come back as categoricals (sorted categories, one set per
    group of columns), with the values, order and missing values of the object columns."""
    spans = pd.DataFrame(
        {
            "level": ["model", "layer", "kernel", "layer", None, "kernel"],
            "name": ["m", "conv", "k2", "relu", "x", np.nan],
            "layer": [None, None, "relu", None, None, "conv"],
            "n": np.arange(6),
        }
    )
    plain, coded = LevelRows(), LevelRows([["level", "name", "layer"]])
    for rows in (plain, coded):
        rows.add(spans.iloc[:3])
        rows.add(spans.iloc[3:])
    want, got = plain.frame(), coded.frame()
    for col in ("level", "name", "layer"):
        assert isinstance(got[col].dtype, pd.CategoricalDtype)
        assert list(got[col].cat.categories) == sorted(
            {v for c in ("level", "name", "layer") for v in spans[c] if isinstance(v, str)}
        )
        pd.testing.assert_series_equal(got[col].astype(object), want[col].fillna(np.nan))
    assert got["name"].dtype == got["layer"].dtype  # one group: merged one on the other
    pd.testing.assert_series_equal(got["n"], want["n"])
    empty = LevelRows([["level"]])
    empty.add(spans.iloc[:0])
    assert isinstance(empty.frame()["level"].dtype, pd.CategoricalDtype)


def test_coded_columns_take_strings_only() -> None:
    rows = LevelRows([["name"]])
    with pytest.raises(TypeError, match="strings"):
        rows.add(pd.DataFrame({"level": ["a"], "name": [3]}))
