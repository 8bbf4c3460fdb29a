"""The fleet report (DuckDB over a Parquet export) against the single-store report.

The checked-in stores are exported to Parquet; the fleet's per-model numbers must be the
single-store report's on the same data, so the two paths cannot drift apart.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from analysis import report
from analysis.analyses.common import GROUP, across_traces
from analysis.analyses.layer_level import layer_frame
from analysis.analyses.live import STEPS_NOTE
from analysis.fleet.analyses import (
    FIDELITY_TABLE,
    FLEET_ANALYSES,
    NOT_CAPTURED,
    NOTES,
    TRACE_COLUMNS,
    export_parquet,
    fleet_tables,
    render_text,
)
from analysis.trace_analysis import TraceAnalysis
from sidecar.trace.spans import new_trace_id
from sidecar.trace.store import TraceStore
from tests.analysis.helpers import MS, write_live
from tests.analysis.test_fidelity import PY, write
from tests.analysis.test_stream_responses import store as stream_store
from tests.analysis.test_stream_responses import stream_span

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


def test_an_ensembles_steps_have_rows_as_in_the_report(tmp_path: Path) -> None:
    """Each step's phases and the ensemble's own rows; steps that overlap (Triton stamps a
    step's ends after the next one started) keep their request in, as in the report."""
    from tests.analysis.test_ensemble_steps import T0, write_ensemble

    db = tmp_path / "ensemble.db"
    with TraceStore(db) as store:
        for i, gap_us in enumerate((400, 3000, -490, 250)):
            write_ensemble(store, T0 + i * 30 * MS, gap_us=gap_us)
    dbs = [db, DATA / "live" / "traces.sqlite"]  # beside models that are no ensemble
    export_parquet(dbs, tmp_path / "fleet")
    live = fleet_tables(tmp_path / "fleet")["live_breakdown"]
    store = TraceAnalysis.from_paths(dbs).result("live_breakdown")
    assert {"ens_cnn", "small_cnn"} <= set(live["model"])
    cols = ["requests", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "share_of_client"]
    pd.testing.assert_frame_equal(
        live[["model", "step", "phase", *cols]], store.table[["model", "step", "phase", *cols]],
        check_dtype=False, rtol=1e-9,
    )  # fmt: skip
    rows = live[live["model"] == "ens_cnn"].set_index(["step", "phase"])
    assert rows.at[("2. simple_cnn", "compute_infer"), "requests"] == 4
    assert rows.at[("", "steps_overlap"), "p99_ms"] == pytest.approx(0.49, rel=0.05)
    assert live.attrs[NOTES] == [STEPS_NOTE]


FIDELITY_COLS = [c for c in FIDELITY_TABLE if c not in GROUP]


def test_fidelity_matches_on_the_checked_in_stores(
    tables: dict[str, pd.DataFrame], single: TraceAnalysis
) -> None:
    """The live store predates the `fidelity` attribute: both paths read its backend spans."""
    store = single.result("fidelity")
    assert not store.table.empty
    same(tables["fidelity"], store.table, GROUP, FIDELITY_COLS)
    assert tables["fidelity"].attrs[NOTES] == store.notes


def fidelity_store(db: Path) -> None:
    """Sampled requests written as the sidecar writes them (the store keeps `fidelity`):
    causes, batch windows, a request without backend spans, slow requests."""
    gpu = {"server_config": {"backend": "onnxruntime", "instance_kind": "KIND_GPU"}}
    trt = {
        "replay_settings": [
            {
                "setting": "optimization.execution_accelerators.gpu.tensorrt",
                "value": "",
                "applied": False,
                "reason": "no TensorRT here",
            }
        ]
    }
    one = {"inferences": 4, "executions": 1, "batch_sizes": {"4": 1}}
    busy = {"inferences": 3, "executions": 3, "batch_sizes": {"2": 3}}
    with TraceStore(db) as store:
        for live in (400_000, 500_000, 600_000, 700_000):
            write(store, model="py", live_ns=live, replay_ns=50_000, attrs=PY)
        write(store, model="g", live_ns=100_000, replay_ns=900_000, attrs={**gpu, **trt})
        write(store, model="g", live_ns=120_000, replay_ns=100_000, attrs=trt)
        write(store, batch=1, live_ns=800_000, replay_ns=200_000, window=one)
        write(store, batch=1, live_ns=900_000, replay_ns=210_000, window=one)
        two = {"inferences": 8, "executions": 2, "batch_sizes": {"4": 2}}  # not one execution
        write(store, batch=1, live_ns=400_000, replay_ns=210_000, window=two)
        write(store, batch=4, live_ns=800_000, replay_ns=720_000)
        write(store, batch=2, live_ns=800_000, replay_ns=300_000, window=busy)
        write(
            store,
            batch=2,
            live_ns=700_000,
            replay_ns=310_000,
            window={"unobserved": "the first read completed 1 ms after the response"},
        )
        write(store, batch=2, live_ns=None, replay_ns=300_000, window=busy)
        write(store, batch=1, reason="slow", live_ns=None, replay_ns=900_000)
        write(store, batch=1, reason="slow", live_ns=None, replay_ns=210_000)
        write(store, model="s", reason="slow", live_ns=None, replay_ns=1_000)  # fmt: skip


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("sampled") / "sampled.db"
    fidelity_store(db)
    return db


def test_the_export_keeps_the_stores_fidelity(sampled: Path, tmp_path: Path) -> None:
    export_parquet([sampled], tmp_path)
    got = duckdb.sql(
        "SELECT trace_id, live_compute_ns, replay_model_ns, fidelity_ratio, window_note, "
        f"fidelity_kept FROM '{tmp_path}/traces/*.parquet' ORDER BY trace_id"
    ).fetchall()
    with sqlite3.connect(sampled) as conn:
        stored = conn.execute(
            "SELECT trace_id, json_extract(attributes, '$.fidelity.live_compute_ns'), "
            "json_extract(attributes, '$.fidelity.replay_model_ns'), "
            "json_extract(attributes, '$.fidelity.ratio'), "
            "json_extract(attributes, '$.fidelity.server_batch_window.unobserved'), "
            "json_type(attributes, '$.fidelity') IS NOT NULL FROM traces ORDER BY trace_id"
        ).fetchall()
    assert [(*r[:5], bool(r[5])) for r in got] == [(*r[:5], bool(r[5])) for r in stored]
    assert any(r[3] is not None for r in got) and any(r[4] for r in got)


def test_fidelity_matches_with_the_stores_attribute(sampled: Path, tmp_path: Path) -> None:
    """Causes, the server's batch window, slow requests, and the live store's older traces
    beside them in one fleet."""
    dbs = [str(sampled), DBS[2]]
    export_parquet(dbs, tmp_path)
    fleet = fleet_tables(tmp_path)["fidelity"]
    store = TraceAnalysis.from_paths(dbs).result("fidelity")
    same(fleet, store.table, GROUP, FIDELITY_COLS)
    assert fleet["ratio_at_server_batch_p50"].notna().any()
    assert fleet["slow_reproduced"].notna().any() and "s" in set(fleet["model"])
    assert fleet["differences"].str.contains("KIND_GPU").any()
    # the single-store notes the fleet does not repeat: requests left out and their reasons
    assert set(fleet.attrs[NOTES]) <= set(store.notes)


def old_export(fleet: Path, stem: str) -> None:
    """Rewrite one store's exported traces as an export before the fidelity columns."""
    (path,) = (fleet / "traces").glob(f"*{stem}.parquet")
    old = ", ".join(c for c in TRACE_COLUMNS if c != "sample_reason")
    con = duckdb.connect()
    con.execute(f"CREATE TABLE t AS SELECT {old} FROM '{path}'")
    con.execute(f"COPY t TO '{path}' (FORMAT parquet)")


def test_an_export_without_the_fidelity_columns_says_not_captured(
    sampled: Path, tmp_path: Path
) -> None:
    export_parquet([sampled], tmp_path)
    old_export(tmp_path, "sampled")
    tables = fleet_tables(tmp_path)
    assert tables["fidelity"].empty and not tables["model_latency"].empty
    assert "without the fidelity columns" in tables["fidelity"].attrs[NOT_CAPTURED]
    n = sqlite3.connect(sampled).execute("SELECT count(*) FROM traces").fetchone()[0]
    section = render_text(tables).split("== fidelity ==\n")[1]
    assert section.startswith(f"not captured: every trace ({n}) comes from an export")


def test_old_and_new_exports_in_one_folder(sampled: Path, tmp_path: Path) -> None:
    export_parquet([str(sampled), DBS[2]], tmp_path)
    old_export(tmp_path, "sampled")
    fleet = fleet_tables(tmp_path)["fidelity"]
    store = TraceAnalysis.from_paths([DBS[2]]).result("fidelity")
    same(fleet, store.table, GROUP, FIDELITY_COLS)
    n = sqlite3.connect(sampled).execute("SELECT count(*) FROM traces").fetchone()[0]
    assert f"{n} traces come from exports without the fidelity columns" in fleet.attrs[NOTES][-1]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_without_live_samples_the_fleet_says_why(name: str, tmp_path: Path) -> None:
    db = str(DATA / name / "traces.sqlite")
    export_parquet([db], tmp_path)
    fleet = fleet_tables(tmp_path)["fidelity"]
    store = TraceAnalysis.from_paths([db]).result("fidelity")
    assert store.status == "not_captured" and fleet.empty
    assert fleet.attrs[NOT_CAPTURED] == store.reason


def test_the_fleet_json_carries_the_fidelity_and_its_notes(
    sampled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export_parquet([sampled], tmp_path)
    assert report.main(["fleet", str(tmp_path), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["model"] for r in out["fidelity"]} == {"g", "m", "py", "s"}
    assert out["notes"]["fidelity"]["notes"][0].startswith("ratio = the replay's model time")


def test_stream_responses_match(tmp_path: Path) -> None:
    """Sampled stream messages as the relay writes them, one with a count that is not a
    number, one whose gaps hold a boolean, one with a JSON null count (not a stream message)."""
    db, _ = stream_store(tmp_path)
    odd = [stream_span(new_trace_id(), 5 * MS, [MS, MS]) for _ in range(3)]
    odd[0].attributes["responses"] = "three"
    odd[1].attributes["response_gaps_ns"] = [MS, True]
    odd[2].attributes["responses"] = None
    write_live(tmp_path / "odd.sqlite", [("tok", [s]) for s in odd])
    dbs = [str(db), str(tmp_path / "odd.sqlite")]
    export_parquet(dbs, tmp_path / "fleet")
    fleet = fleet_tables(tmp_path / "fleet")["stream_responses"]
    store = TraceAnalysis.from_paths(dbs).result("stream_responses")
    assert set(fleet["model"]) == {"chat", "tok"}
    same(fleet, store.table, ["model"], [c for c in store.table.columns if c != "model"])
    assert fleet.attrs[NOTES] == store.notes and "2 stream span(s) left out" in store.notes[-1]


def test_stream_responses_without_stream_messages_or_columns(tmp_path: Path) -> None:
    export_parquet(DBS, tmp_path / "none")
    fleet = fleet_tables(tmp_path / "none")["stream_responses"]
    store = TraceAnalysis.from_paths(DBS).result("stream_responses")
    assert fleet.empty and fleet.attrs[NOT_CAPTURED] == store.reason
    db, _ = stream_store(tmp_path)
    export_parquet([db], tmp_path / "old")
    (path,) = (tmp_path / "old" / "spans").glob("*.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE TABLE s AS SELECT * EXCLUDE (stream_span, responses, "
                f"response_gaps_ns) FROM '{path}'")  # fmt: skip
    con.execute(f"COPY s TO '{path}' (FORMAT parquet)")
    old = fleet_tables(tmp_path / "old")["stream_responses"]
    assert old.empty and "without the stream columns" in old.attrs[NOT_CAPTURED]
