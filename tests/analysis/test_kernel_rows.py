"""`analysis.kernel_rows`: the kernel-level spans go to DuckDB, not to the pandas spans, and
the relation `kernels` holds each of them once, with its layer call, type and group. The
checked-in GPU store (real SQLite, real DuckDB)."""

from __future__ import annotations

import gc
import sqlite3

import pandas as pd

from analysis.common import Frames
from analysis.kernel_rows import COLUMNS, KernelSpans, kernel_rows
from analysis.tracedb import TraceData, load_traces
from tests.analysis.helpers import CPU_DB, GPU_DB


def _store(sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(GPU_DB)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _kernels(data: TraceData) -> pd.DataFrame:
    return kernel_rows(Frames(data)).query("SELECT * FROM kernels ORDER BY row")


def test_the_loader_keeps_the_kernel_level_out_of_the_pandas_spans() -> None:
    data = load_traces([GPU_DB])
    assert not (data.spans["level"] == "kernel").any()
    kernels = _kernels(data)
    assert tuple(kernels.columns) == COLUMNS
    (stored,) = _store(
        "SELECT count(*) FROM spans WHERE level = 'kernel' AND kind NOT IN ('runtime', 'driver')"
    )[0]
    assert len(kernels) == stored == data.kernel_spans().count()
    assert kernels["row"].tolist() == list(range(len(kernels)))
    assert data.span_count() == len(data.spans) + stored
    assert "kernel" in data.levels()


def test_each_kernel_has_its_layer_type_and_group() -> None:
    data = load_traces([GPU_DB])
    kernels = _kernels(data)
    # the stored layer: the parent's name, or the launch's parent's
    layer_of = dict(
        _store(
            "SELECT s.span_id, CASE WHEN p.level = 'layer' THEN p.name "
            "WHEN g.level = 'layer' THEN g.name END FROM spans s "
            "LEFT JOIN spans p ON p.trace_id = s.trace_id AND p.span_id = s.parent_id "
            "LEFT JOIN spans g ON g.trace_id = p.trace_id AND g.span_id = p.parent_id "
            "WHERE s.level = 'kernel' AND s.kind NOT IN ('runtime', 'driver')"
        )
    )
    assert sorted(kernels["layer"].dropna()) == sorted(v for v in layer_of.values() if v)
    typed = kernels[kernels["layer"].notna()]
    assert typed["layer_type"].notna().all()
    groups = data.traces.set_index("tkey")[["model", "batch_size"]]
    expected = groups.loc[kernels["tkey"]].reset_index(drop=True)
    assert kernels["model"].tolist() == expected["model"].astype(str).tolist()
    assert kernels["batch_size"].tolist() == expected["batch_size"].astype(int).tolist()


def test_a_subset_sees_only_its_traces_kernels() -> None:
    data = load_traces([GPU_DB])
    every = _kernels(data)
    keys = data.traces["tkey"].iloc[:2].tolist()
    part = data.subset(keys)
    assert set(_kernels(part)["tkey"]) == set(keys)
    assert part.kernel_spans().count() == int(every["tkey"].isin(keys).sum())
    pd.testing.assert_frame_equal(_kernels(data), every)  # the whole is left as it was


def test_a_store_without_kernels_has_an_empty_relation() -> None:
    data = load_traces([CPU_DB])
    assert _kernels(data).empty
    assert "kernel" not in data.levels()


def test_the_spill_folder_goes_with_the_store() -> None:
    spans = KernelSpans()
    folder = spans._folder
    assert folder.is_dir()
    spans.close()
    assert not folder.exists()
    spans = KernelSpans()
    folder = spans._folder
    del spans
    gc.collect()
    assert not folder.exists()
