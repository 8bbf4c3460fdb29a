"""`analysis.analyses.common.records`: a frame's rows as JSON-safe dicts, column by column."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.analyses.common import records


def test_every_dtype_becomes_plain_python() -> None:
    df = pd.DataFrame(
        {
            "i": np.array([1, 2, 3], dtype="int64"),
            "u": np.array([1, 2, 3], dtype="uint8"),
            "b": [True, False, True],
            "f": [1.5, math.nan, math.inf],
            "f32": np.array([0.25, -math.inf, 2.0], dtype="float32"),
            "nullable": pd.array([1, None, 3], dtype="Int64"),
            "obj": ["a", None, np.float64(math.nan)],
            "nested": [{"k": np.int64(4), 5: (1.0, math.nan)}, [np.bool_(True)], pd.NA],
            "when": pd.to_datetime(["2026-11-25", None, "2026-11-26"]),
            7: ["x", "y", "z"],
        }
    )
    rows = records(df)
    assert rows[0] == {
        "i": 1,
        "u": 1,
        "b": True,
        "f": 1.5,
        "f32": 0.25,
        "nullable": 1,
        "obj": "a",
        "nested": {"k": 4, "5": [1.0, None]},
        "when": pd.Timestamp("2026-11-25"),
        "7": "x",
    }
    assert [r["f"] for r in rows] == [1.5, None, None]
    assert [r["f32"] for r in rows] == [0.25, None, 2.0]
    assert [r["nullable"] for r in rows] == [1, None, 3]
    assert [r["obj"] for r in rows] == ["a", None, None]
    assert rows[1]["nested"] == [True] and rows[2]["nested"] is None
    assert rows[1]["when"] is None
    types = {k: type(v) for k, v in rows[0].items() if k not in ("nested", "when")}
    assert types == {
        "i": int, "u": int, "b": bool, "f": float, "f32": float, "nullable": int, "obj": str,
        "7": str,
    }  # fmt: skip


def test_frames_without_rows_or_columns() -> None:
    assert records(pd.DataFrame({"a": []})) == []
    assert records(pd.DataFrame(index=range(2))) == [{}, {}]
