"""The loader keeps each level's spans together, so that `Frames.at` slices them; a frame in
any other order is split by `groupby`, with the same rows, order and index labels."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.common import _level_slices
from analysis.tracedb import _by_level


def _spans() -> pd.DataFrame:
    levels = ["model", "layer", "kernel", "layer", "kernel", "kernel", None, "model", "layer"]
    return pd.DataFrame({"level": levels, "n": np.arange(len(levels))}, index=np.arange(9) * 10)


def _by_groupby(spans: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {str(k): g for k, g in spans.groupby("level", sort=False)}


def test_levels_ordered_by_the_loader_are_the_groupby_split() -> None:
    spans = _spans()
    ordered = _by_level(spans)
    assert list(ordered["level"]) == ["model"] * 2 + ["layer"] * 3 + ["kernel"] * 3 + [None]
    assert list(ordered.loc[ordered["level"] == "layer", "n"]) == [1, 3, 8]
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
