"""The fleet report (DuckDB over a Parquet export) against the single-store report.

The checked-in stores are exported to Parquet; the fleet's per-model numbers must be the
single-store report's on the same data, so the two paths cannot drift apart.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from analysis import report
from analysis.common import GROUP, across_traces
from analysis.fleet import FLEET_ANALYSES, export_parquet, fleet_tables
from analysis.layer_level import layer_frame
from analysis.trace_analysis import TraceAnalysis

DATA = Path(__file__).resolve().parents[1] / "data"
DBS = [str(DATA / name / "traces.sqlite") for name in ("cpu", "gpu", "live")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fleet")
    export_parquet(DBS, out)
    return out


@pytest.fixture(scope="module")
def tables(fleet: Path) -> dict[str, pd.DataFrame]:
    return fleet_tables(fleet, top=3)


@pytest.fixture(scope="module")
def single() -> TraceAnalysis:
    return TraceAnalysis.from_paths(DBS)


def same(fleet_df: pd.DataFrame, store_df: pd.DataFrame, keys: list[str], cols: list[str]) -> None:
    a = fleet_df[[*keys, *cols]].sort_values(keys).reset_index(drop=True)
    b = store_df[[*keys, *cols]].sort_values(keys).reset_index(drop=True)
    for key in keys:
        a[key], b[key] = a[key].astype(str), b[key].astype(str)
    pd.testing.assert_frame_equal(a, b, check_dtype=False, rtol=1e-9)


def test_the_export_round_trips_the_counts(tmp_path: Path) -> None:
    counts = export_parquet(DBS, tmp_path)
    # every trace and level statistic; every span but the CUDA API records (they only place
    # kernels under their layers)
    queries = {
        "traces": "SELECT COUNT(*) FROM traces",
        "spans": "SELECT COUNT(*) FROM spans WHERE kind NOT IN ('runtime', 'driver')",
        "level_stats": "SELECT COUNT(*) FROM level_stats",
    }
    expected = dict.fromkeys(queries, 0)
    for db in DBS:
        with sqlite3.connect(db) as conn:
            for table, query in queries.items():
                expected[table] += conn.execute(query).fetchone()[0]
    assert (counts.traces, counts.spans, counts.level_stats) == tuple(expected.values())
    con = duckdb.connect()
    for table, n in expected.items():
        got = con.execute(f"SELECT count(*) FROM '{tmp_path}/{table}/*.parquet'").fetchone()
        assert got == (n,), table
    ids = con.execute(f"SELECT count(DISTINCT span_id) FROM '{tmp_path}/spans/*.parquet'")
    assert ids.fetchone() == (expected["spans"],)


def test_traces_and_model_latency_per_batch_match_the_single_store_report(
    tables: dict[str, pd.DataFrame], single: TraceAnalysis
) -> None:
    meta = single._frames.meta
    per_model = meta.groupby("model").size().rename("traces").reset_index()
    same(tables["traces"], per_model, ["model"], ["traces"])
    assert tables["traces"]["databases"].tolist() == [1, 2, 1]  # small_cnn: cpu and live
    store = across_traces(single._frames.model_latency, GROUP, ["latency_ns"])
    store["latency_ms"] = store["latency_ns"] / 1e6
    same(tables["model_latency"], store, GROUP, ["latency_ms", "n_traces"])


def test_layer_type_shares_and_top_layers_match(
    tables: dict[str, pd.DataFrame], single: TraceAnalysis
) -> None:
    by_type = single.result("A6").table
    same(tables["layer_types"], by_type, [*GROUP, "type"], ["layers", "latency_ms", "share"])
    frame = layer_frame(single._frames)
    frame = frame.sort_values([*GROUP, "latency_ms", "name"], ascending=[True, True, False, True])
    top = frame.groupby(GROUP).head(3)
    same(
        tables["top_layers"],
        top,
        [*GROUP, "name"],
        ["type", "latency_ms", "latency_share", "n_traces"],
    )


def test_the_live_breakdown_matches(tables: dict[str, pd.DataFrame], single: TraceAnalysis) -> None:
    store = single.result("live_breakdown").table
    cols = ["requests", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "share_of_client"]
    same(tables["live_breakdown"], store, ["model", "phase"], cols)


def test_the_fleet_command_exports_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet"
    assert report.main(["export-parquet", *DBS, "--out", str(out)]) == 0
    assert "47 traces" in capsys.readouterr().err
    assert report.main(["fleet", str(out), "--top", "2"]) == 0
    text = capsys.readouterr().out
    for key in FLEET_ANALYSES:
        assert f"== {key} ==" in text
    assert "tiny_resnet" in text and "compute_infer" in text
    assert report.main(["fleet", str(tmp_path / "nothing")]) == 1


def test_the_live_breakdown_places_spans_as_the_report_does(tmp_path: Path) -> None:
    """With the relay's marks: spans clipped at the response's first byte, work after it apart,
    a trace whose spans start before the request left out, TF ops placed the same way."""
    from sidecar.trace.spans import Level, Source, Span, new_span_id, new_trace_id
    from tests.analysis.helpers import MS, T0, relay_request, server_spans, write_live

    traces = []
    for n, server in enumerate(
        [
            {"request": (0.5, 6.0), "queue": (0.6, 1.0), "compute_infer": (1.5, 5.5)},
            {"request": (0.4, 3.0), "queue": (0.5, 0.9), "compute_infer": (1.0, 2.9)},
            {"request": (-2.0, 3.5), "queue": (0.6, 1.0)},  # left out
        ]
    ):
        tid, rid = new_trace_id(), new_span_id()
        marks = (0, 100_000, (4 - n) * MS, 5 * MS)
        traces.append(
            ("add_sub", [relay_request(tid, rid, marks), *server_spans(tid, rid, server)])
        )
    tid, rid = new_trace_id(), new_span_id()
    ops = [
        Span(tid, new_span_id(), rid, Level.SERVER, f"op{i}", "tf_op", T0 + a * MS, T0 + b * MS,
             Source.BACKEND)
        for i, (a, b) in enumerate([(1, 3), (2, 8)])
    ]  # fmt: skip
    traces.append(("keras_cnn", [relay_request(tid, rid, (0, 100_000, 6 * MS, 7 * MS)), *ops]))
    tid, rid = new_trace_id(), new_span_id()
    traces.append(("add_sub", [relay_request(tid, rid, None), *server_spans(tid, rid, {})]))
    db = tmp_path / "marks.db"
    write_live(db, traces)
    export_parquet([db], tmp_path / "fleet")
    live = fleet_tables(tmp_path / "fleet")["live_breakdown"]
    store = TraceAnalysis.from_paths([db]).result("live_breakdown").table
    cols = ["requests", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "share_of_client"]
    same(live, store, ["model", "phase"], cols)
    assert "server_after_response" in set(live["phase"]) and (live["mean_ms"] >= 0).all()
