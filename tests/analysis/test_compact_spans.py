"""The loaded spans are held compact (string columns as categoricals, one level's columns
sparse: `analysis.load.string_codes`, `analysis.load.sparse_columns`), and the analyses see each
level's rows as the plain loader made them, the kernel and layer levels (in DuckDB) included. Real
SQLite, the checked-in stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.common import Frames
from analysis.load import columnar, sparse_columns, tracedb
from analysis.load.tracedb import load_traces
from analysis.relations.kernel_rows import kernel_rows
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB
from tests.analysis.test_stream_responses import store as stream_store


def _plain(stores: list[Path], monkeypatch: pytest.MonkeyPatch) -> tracedb.TraceData:
    """The stores loaded with every column dense and every string an object."""
    with monkeypatch.context() as m:
        m.setattr(sparse_columns, "HELD_SPARSE", frozenset())
        m.setattr(tracedb, "SPAN_CODED", ())
        m.setattr(columnar, "REPORT_DICTIONARY", ())
        return load_traces(stores)


def test_each_level_is_the_plain_loaders_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stores = [GPU_DB, CPU_DB, LIVE_DB, stream_store(tmp_path)[0]]
    compact, plain = load_traces(stores), _plain(stores, monkeypatch)
    for col in sparse_columns.HELD_SPARSE:
        assert isinstance(compact.spans[col].dtype, pd.SparseDtype), col
    for group in tracedb.SPAN_CODED:
        for col in group:
            assert isinstance(compact.spans[col].dtype, pd.CategoricalDtype), col
    a, b = Frames(compact), Frames(plain)
    levels = set(plain.spans["level"].dropna())
    assert "request" in levels and not levels & {"layer", "kernel"}  # (those: in DuckDB)
    for relation in ("kernels", "layers", "layer_calls"):
        sql = f"SELECT * FROM {relation} ORDER BY row"
        got, want = kernel_rows(a).query(sql), kernel_rows(b).query(sql)
        assert len(got) > 0
        pd.testing.assert_frame_equal(got, want, obj=relation)
    for level in levels:
        got, want = a.at(level), b.at(level)
        assert len(got) > 0
        own = sparse_columns.LEVEL_ONLY.get(level, ())
        for col in got.columns:
            values = got[col]
            if isinstance(values.dtype, pd.CategoricalDtype):
                values = values.astype(object).where(values.notna(), None)
            elif col not in own and isinstance(values.dtype, pd.SparseDtype):
                assert values.isna().all(), (level, col)  # another level's column: missing
                continue
            pd.testing.assert_series_equal(values, want[col], check_names=False, obj=col)
    # the values of a level's own columns are there, dense
    for col in sparse_columns.LEVEL_ONLY["request"]:
        assert a.at("request")[col].notna().any(), col


def test_dense_restores_missing_objects_as_none() -> None:
    values = np.array([None, ["Conv", "Relu"], None, "Gemm"], dtype=object)
    numbers = np.array([np.nan, 1.5, np.nan, 0.0])
    frame = pd.DataFrame(
        {"op_type": sparse_columns.sparse(values), "leaf": sparse_columns.sparse(numbers)}
    )
    got = sparse_columns.dense(frame, "layer")
    assert got["op_type"].tolist() == [None, ["Conv", "Relu"], None, "Gemm"]
    np.testing.assert_array_equal(got["leaf"].to_numpy(), numbers)
    assert isinstance(sparse_columns.dense(frame, "kernel")["leaf"].dtype, pd.SparseDtype)
