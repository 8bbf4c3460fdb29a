"""`common.rows_where`: a row filter that keeps every row hands out the columns it has (no
copy of the kernels of a large store), a new frame either way. `common.sort_rows`: pandas'
stable sort, by numpy's lexsort over integer keys. The checked-in GPU and CPU stores."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.common import rows_where, sort_rows
from analysis.trace_analysis import TraceAnalysis
from analysis.tracedb import load_traces
from tests.analysis.helpers import CPU_DB, GPU_DB


def _kernels() -> pd.DataFrame:
    return TraceAnalysis(load_traces([GPU_DB])).data.spans.query("level == 'kernel'")


def test_a_filter_that_keeps_every_row_shares_the_columns() -> None:
    kn = _kernels()
    kept = rows_where(kn, kn["duration_ns"] >= 0)
    pd.testing.assert_frame_equal(kept, kn[kn["duration_ns"] >= 0])
    assert kept is not kn
    assert np.shares_memory(kept["duration_ns"].to_numpy(), kn["duration_ns"].to_numpy())
    kept["duration_ns"] = 0  # a new frame: the caller's is left as it was
    assert (kn["duration_ns"] > 0).any()


def test_a_filter_that_drops_rows_is_the_filter() -> None:
    kn = _kernels()
    mask = kn["kind"] == "kernel"
    assert 0 < mask.sum() < len(kn)
    pd.testing.assert_frame_equal(rows_where(kn, mask), kn[mask])
    pd.testing.assert_frame_equal(rows_where(kn, mask.to_numpy()), kn[mask])


def test_rows_sorted_by_integer_keys_are_pandas_stable_sort() -> None:
    for db in (GPU_DB, CPU_DB):
        spans = load_traces([db]).spans
        for keys in (["tkey", "start_ns"], ["tkey", "idx", "start_ns"], ["idx"]):
            assert spans.duplicated(keys[:1]).any()  # ties, kept in their order
            expected = spans.sort_values(keys, kind="stable")
            pd.testing.assert_frame_equal(sort_rows(spans, keys), expected)
        # a key that is not an integer column: pandas' own sort
        keys = ["tkey", "run_level", "start_ns"]
        pd.testing.assert_frame_equal(
            sort_rows(spans, keys), spans.sort_values(keys, kind="stable")
        )
