"""`analysis.relations.kernel_rows`: the kernel-level spans go to DuckDB, not to the pandas spans,
and the relation `kernels` holds each of them once, with its layer call, type and group. The
checked-in GPU store (real SQLite, real DuckDB)."""

from __future__ import annotations

import gc
import sqlite3

import numpy as np
import pandas as pd
import pyarrow as pa

from analysis.analyses.common import Frames
from analysis.load.arrow_spans import POSITION, store_plain
from analysis.load.span_store import SpanStore
from analysis.load.tracedb import TraceData, load_traces
from analysis.relations.kernel_rows import COLUMNS, LAYER_COLUMNS, kernel_rows
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
    assert not data.spans["level"].isin(["kernel", "layer"]).any()
    kernels = _kernels(data)
    assert tuple(kernels.columns) == COLUMNS
    (stored,) = _store(
        "SELECT count(*) FROM spans WHERE level = 'kernel' AND kind NOT IN ('runtime', 'driver')"
    )[0]
    assert len(kernels) == stored == data.span_store().count("kernel")
    assert kernels["row"].is_monotonic_increasing and kernels["row"].is_unique
    (layers,) = _store("SELECT count(*) FROM spans WHERE level = 'layer'")[0]
    assert data.span_store().count("layer") == layers
    assert data.span_count() == len(data.spans) + stored + layers
    assert {"kernel", "layer", "model"} <= set(data.levels())
    kr = kernel_rows(Frames(data))
    relation = kr.query("SELECT * FROM layers ORDER BY row")
    assert tuple(relation.columns) == LAYER_COLUMNS
    by_keys = kr.query("SELECT * FROM layers ORDER BY tkey, idx, start_ns")
    pd.testing.assert_frame_equal(relation, by_keys)  # `row` orders them so


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
    assert part.span_store().count("kernel") == int(every["tkey"].isin(keys).sum())
    pd.testing.assert_frame_equal(_kernels(data), every)  # the whole is left as it was


def test_a_store_without_kernels_has_an_empty_relation() -> None:
    data = load_traces([CPU_DB])
    assert _kernels(data).empty
    assert "kernel" not in data.levels()


def test_the_spill_folder_goes_with_the_store() -> None:
    spans = SpanStore()
    folder = spans._folder
    assert folder.is_dir()
    spans.close()
    assert not folder.exists()
    spans = SpanStore()
    folder = spans._folder
    del spans
    gc.collect()
    assert not folder.exists()


def _layer(tkey: int, run: str, name: str, start: int, **attrs: object) -> dict[str, object]:
    row: dict[str, object] = {
        "level": "layer", "tkey": tkey, "run_level": run, "name": name, "kind": "Conv",
        "idx": start // 100, "start_ns": start, "end_ns": start + 50, "duration_ns": 50,
        "allocated_bytes": np.nan, "leaf": np.nan, "flops": np.nan, "dram_read_bytes": np.nan,
        "dram_write_bytes": np.nan, "achieved_occupancy": np.nan, "flops_estimated": False,
        "bytes_estimated": False, "metrics_estimated": False, "outside_layers": False,
        "op_type": None, "original_nodes": None, "original_op_types": None,
        "input_shapes": None, "output_shapes": None, "layer": None,
    }  # fmt: skip
    return {**row, **attrs}


def _kernel(tkey: int, run: str, layer: str, start: int) -> dict[str, object]:
    return _layer(tkey, run, f"k{start}", start, level="kernel", kind="kernel", layer=layer)


def test_layers_take_one_run_per_trace_and_name_each_call() -> None:
    """Made in memory: the L run where a trace has one (else the first run by name), a
    module called twice named `blk` and `blk#1` by start, its kernels moved to the call they
    ran in, Keras ops outside layers left out of `layers` (kept in `layer_calls`), the type
    a fused layer computes, a container."""
    spans = pd.DataFrame(
        [
            _layer(0, "layer", "blk", 100, op_type="Conv"),
            _layer(0, "layer", "blk", 300, op_type="Conv"),
            _layer(0, "layer", "fused", 500, original_op_types=["Conv", "Relu"]),
            _layer(0, "layer", "outer", 600, leaf=0.0),
            _layer(0, "layer", "arg", 700, outside_layers=True),
            _layer(0, "kernel", "blk", 100),
            _layer(0, "kernel", "blk", 300),
            _kernel(0, "kernel", "blk", 150),
            _kernel(0, "kernel", "blk", 350),
            _kernel(0, "kernel", None, 400),  # type: ignore[arg-type]
            _layer(1, "model", "m", 100),
            _layer(1, "kernel", "k", 100),
        ]
    )
    traces = pd.DataFrame(
        {"tkey": [0, 1], "model": ["net", "net"], "batch_size": pd.array([1, 2], "Int64")}
    )
    data = TraceData(traces, spans, pd.DataFrame())
    fr = Frames(data)
    fr.memo("meta", lambda: traces)  # (the columns of `Frames.meta` that the relations read)
    kr = kernel_rows(fr)
    layers = kr.query(
        "SELECT tkey, run_level, module, name, type, container FROM layers ORDER BY row"
    )
    assert layers.values.tolist() == [
        [0, "layer", "blk", "blk", "Conv", False],
        [0, "layer", "blk", "blk#1", "Conv", False],
        [0, "layer", "fused", "fused", "Conv+Relu", False],
        [0, "layer", "outer", "outer", "Conv", True],
        [1, "kernel", "k", "k", "Conv", False],
    ]
    calls = kr.query("SELECT tkey, run_level, name FROM layer_calls ORDER BY row")
    assert [0, "layer", "arg"] in calls.values.tolist()
    assert [0, "kernel", "blk#1"] in calls.values.tolist()
    kernels = kr.query(
        "SELECT start_ns, layer, layer_type, model, batch_size FROM kernels ORDER BY row"
    )
    assert kernels.values.tolist() == [
        [150, "blk", "Conv", "net", 1],
        [350, "blk#1", "Conv", "net", 1],
        [400, None, None, "net", 1],
    ]


def test_a_scalar_leaves_the_connection_free_for_a_frame() -> None:
    """A scalar of a many-row result (an A15-like check, then its per-trace frame) must not
    leave the result open: DuckDB refuses to register a frame on a connection that has one."""
    data = load_traces([GPU_DB])
    kr = kernel_rows(Frames(data))
    assert kr.scalar("SELECT tkey FROM kernels ORDER BY tkey") == 0
    assert data.span_store().count("kernel") > 1
    kr.register("some_traces", pd.DataFrame({"tkey": [0]}))
    assert kr.scalar("SELECT count(*) FROM some_traces") == 1


def test_the_rows_left_to_pandas_keep_the_batchs_columns() -> None:
    """`arrow_spans.store_plain` hands back the rows it did not store with the batch's own
    columns, whether it stored some rows of the batch or none."""
    keys = pd.Series([0], index=["t0"])
    model = {"level": "model", "trace_id": "t0", "_bad": None, "_wrong": None}
    store = SpanStore()
    for rows in ([model], [model, {**model, "level": "other", "_bad": "duration_ns: NULL"}]):
        table = pa.Table.from_pylist(rows).append_column(POSITION, pa.array(range(len(rows))))
        left = store_plain(table, keys, store)
        assert left.column_names == table.column_names and left.num_rows == len(rows)
    store.close()
