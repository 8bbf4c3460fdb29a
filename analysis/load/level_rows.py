"""Spans gathered batch by batch into one frame with each level's rows together.

The loader reads a store's spans in batches (`columnar.SpanBatches`) and keeps, of
each, only the sound rows of the selected traces. `LevelRows` collects those rows as they
come and builds the frame the analyses take (`Frames.at` slices it by level) once, at the
end: the rows of the first level to appear, then the next, each level's rows in the order
they were read, each row labelled with its position among all rows read (as one reader's
frame, sorted stably by level, would be). No batch is kept whole, the spans are not copied
a second time to be sorted, and the frame is built a column at a time, each column's pieces
let go as they are copied into it (and their pages handed back: `heap.trim`). String
columns named in `coded` are held as integer codes, batch by batch, and made categoricals
with sorted categories at the end (`string_codes.StringCodes`); the columns of one group
share their categories (so that merging one on another matches their strings). Columns named
in `sparse` are made sparse arrays (`sparse_columns`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.load import heap, sparse_columns
from analysis.load.string_codes import StringCodes
from analysis.tuning import TRIM_BYTES

Piece = dict[str, np.ndarray]  # one level's rows of one batch: its columns, and "" its labels


class LevelRows:
    """Rows added batch by batch (`add`), returned by level (`frame`)."""

    def __init__(self, coded: Sequence[Sequence[str]] = (), sparse: Collection[str] = ()) -> None:
        self._sparse = frozenset(sparse)
        # string columns held as codes: each group's columns share one dictionary
        self._codes = {str(c): codes for group in coded for codes in [StringCodes()] for c in group}
        self._pieces: dict[Any, list[Piece]] = {}  # level -> its rows of each batch, in order
        self._rows = 0  # rows added so far: the next row's label
        self._empty: pd.DataFrame | None = None  # the columns and their dtypes

    def add(self, batch: pd.DataFrame) -> None:
        """Append the rows of `batch` (its index is replaced by the rows' positions). Every
        batch has the first one's columns and numpy dtypes (the loader types each column
        the same way whatever values a batch holds)."""
        # a coded column: strings or their categorical; a categorical not coded: its objects
        dtypes = batch.dtypes.astype(object)
        objects = [
            isinstance(t, pd.CategoricalDtype) or c in self._codes for c, t in dtypes.items()
        ]
        dtypes[objects] = np.dtype(object)
        if self._empty is None:
            if batch.columns.has_duplicates or not all(isinstance(t, np.dtype) for t in dtypes):
                raise TypeError("LevelRows takes uniquely named columns of numpy dtypes")
            self._empty = batch.iloc[:0].reset_index(drop=True).astype(dict(dtypes))
        elif not dtypes.equals(self._empty.dtypes.astype(object)):
            raise TypeError(
                f"a batch's columns {dict(batch.dtypes)} differ from the first batch's "
                f"{dict(self._empty.dtypes)}"
            )
        if batch.empty:
            return
        labels = np.arange(self._rows, self._rows + len(batch))
        self._rows += len(batch)
        columns = {
            str(c): self._codes[c].codes(batch[c])
            if c in self._codes
            else batch[c].to_numpy(
                object if isinstance(batch[c].dtype, pd.CategoricalDtype) else None
            )
            for c in batch.columns
        }
        codes, levels = pd.factorize(batch["level"], use_na_sentinel=False)
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(levels) + 1))
        present = {c: pd.notna(columns[c]) for c in self._sparse if c in columns}
        for code, level in enumerate(levels):
            rows = order[bounds[code] : bounds[code + 1]]
            # own arrays, no view; a sparse column that is all missing here is left out
            piece = {
                c: values[rows]
                for c, values in columns.items()
                if c not in present or present[c][rows].any()
            }
            piece[""] = labels[rows]
            self._pieces.setdefault(_key(level), []).append(piece)

    def _dtype(self, name: str) -> np.dtype:
        """The dtype of column `name` in the pieces ("": the labels)."""
        if name == "":
            return np.dtype(np.int64)
        if name in self._codes:
            return np.dtype(np.int32)
        assert self._empty is not None
        dtype: np.dtype = self._empty[name].dtype
        return dtype

    def frame(self) -> pd.DataFrame:
        """Every row added, each level's together; empty (with the columns) if none."""
        pieces = [p for level in self._pieces.values() for p in level]
        self._pieces = {}
        if self._empty is None:
            return pd.DataFrame()
        if not pieces:
            empty = self._empty.assign(
                **{c: codes.categorical(np.empty(0, np.int32)) for c, codes in self._codes.items()}
            )
            held = [c for c in self._sparse if c in empty.columns]
            return empty.assign(**{c: sparse_columns.sparse(empty[c].to_numpy()) for c in held})
        lengths = [len(p[""]) for p in pieces]
        total = sum(lengths)
        columns: dict[str, Any] = {}
        let_go = 0  # bytes of pieces let go since the last trim
        for name in ["", *map(str, self._empty.columns)]:
            column = np.empty(total, dtype=self._dtype(name))
            at = 0
            for piece, rows in zip(pieces, lengths, strict=True):  # each let go once copied
                values = piece.pop(name, None)  # (None: a sparse column all missing)
                column[at : at + rows] = np.nan if values is None else values
                at += rows
            let_go += column.nbytes
            columns[name] = column
            if name in self._codes:
                columns[name] = self._codes[name].categorical(column)
            elif name in self._sparse:
                columns[name] = sparse_columns.sparse(column)
            del column
            if let_go >= TRIM_BYTES:  # so that the next columns reuse the pieces' pages
                heap.trim()
                let_go = 0
        index = pd.Index(columns.pop(""))
        return pd.DataFrame(columns, index=index, columns=self._empty.columns, copy=False)


def _key(level: object) -> object:
    """One key for every missing level (None and NaN alike, as `factorize` counts them)."""
    return None if level is None or (isinstance(level, float) and np.isnan(level)) else level
