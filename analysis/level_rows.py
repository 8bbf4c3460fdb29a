"""Spans gathered batch by batch into one frame with each level's rows together.

The loader reads a store's spans in batches (`columnar.report_span_batches`) and keeps, of
each, only the sound rows of the selected traces. `LevelRows` collects those rows as they
come and builds the frame the analyses take (`Frames.at` slices it by level) once, at the
end: the rows of the first level to appear, then the next, each level's rows in the order
they were read, each row labelled with its position among all rows read (as one reader's
frame, sorted stably by level, would be). So no batch is kept whole, and the spans are not
copied a second time to be sorted.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd


class LevelRows:
    """Rows added batch by batch (`add`), returned by level (`frame`)."""

    def __init__(self) -> None:
        self._pieces: dict[Any, list[pd.DataFrame]] = {}  # level -> its slices, in order
        self._rows = 0  # rows added so far: the next row's label
        self._empty: pd.DataFrame | None = None  # the columns, where no row is added

    def add(self, batch: pd.DataFrame) -> None:
        """Append the rows of `batch` (its index is replaced by the rows' positions)."""
        if self._empty is None:
            self._empty = batch.iloc[:0].reset_index(drop=True)
        if batch.empty:
            return
        labels = pd.RangeIndex(self._rows, self._rows + len(batch))
        self._rows += len(batch)
        batch = batch.set_axis(labels, axis=0)
        codes, levels = pd.factorize(batch["level"], use_na_sentinel=False)
        if len(levels) == 1:
            self._pieces.setdefault(_key(levels[0]), []).append(batch)
            return
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(levels) + 1))
        for code, level in enumerate(levels):
            rows = order[bounds[code] : bounds[code + 1]]
            self._pieces.setdefault(_key(level), []).append(batch.take(rows))

    def frame(self) -> pd.DataFrame:
        """Every row added, each level's together; empty (with the columns) if none."""
        pieces = [p for level in self._pieces.values() for p in level]
        self._pieces = {}
        if not pieces:
            return self._empty if self._empty is not None else pd.DataFrame()
        if len(pieces) == 1:
            return pieces[0]
        first = pieces[0]
        if all(_same_columns(p, first) for p in pieces[1:]):
            # one column at a time (pandas' concat would look for all-NA object columns
            # value by value), each the pieces' arrays joined once and not copied again
            columns = {c: np.concatenate([p[c].to_numpy() for p in pieces]) for c in first}
            index = pd.Index(np.concatenate([p.index.to_numpy() for p in pieces]))
            return pd.DataFrame(columns, index=index, copy=False)
        with warnings.catch_warnings():  # all-NA attribute columns in one batch are expected
            warnings.simplefilter("ignore", FutureWarning)
            return pd.concat(pieces)


def _same_columns(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """The same columns of the same numpy dtypes (as the loader's batches have)."""
    return (
        a.columns.equals(b.columns)
        and not a.columns.has_duplicates
        and all(isinstance(t, np.dtype) for t in a.dtypes)
        and a.dtypes.equals(b.dtypes)
    )


def _key(level: object) -> object:
    """One key for every missing level (None and NaN alike, as `factorize` counts them)."""
    return None if level is None or (isinstance(level, float) and np.isnan(level)) else level
