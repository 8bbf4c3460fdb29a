"""`bench/report_speed.py --fleet` at a small size: the generated fleet is what it says (500
spans a trace, every pod, every model, every column `export-parquet` writes, with their types)
and the fleet report runs over it, the fidelity and stream response analyses included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb

from analysis.fleet.analyses import NOT_CAPTURED, TABLES, export_parquet, fleet_tables
from tests.analysis.helpers import LIVE_DB

BENCH = Path(__file__).resolve().parents[2] / "bench" / "report_speed.py"


def test_a_small_fleet_is_generated_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    args = ["--fleet", "--databases", "3", "--traces", "20", "--keep", str(out)]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "3 databases x 20 traces, 30,000 spans" in run.stdout
    assert "fleet report:" in run.stdout and "spans/s" in run.stdout
    tables = fleet_tables(out, top=3)
    assert tables["traces"]["traces"].sum() == 60
    assert set(tables["traces"]["databases"]) == {3}
    assert (tables["model_latency"]["n_traces"] == 3).all()  # 3 pods x 20 / (5 models x 4)
    layers = tables["layer_types"].groupby(["model", "batch_size"])["layers"].sum()
    assert (layers == 60).all()  # the L run's 60 layers, not the K run's copies
    live = tables["live_breakdown"]
    assert set(live["phase"]) == {
        "client_total",
        "network_proxy",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "server_other",
        "server_after_response",
        "backend_response",
    }  # fmt: skip  (backend_response: the relay's marks on the request spans)
    fidelity = tables["fidelity"]
    assert NOT_CAPTURED not in fidelity.attrs
    assert set(fidelity["model"]) == {f"model_{m}" for m in range(5)}
    assert fidelity["requests"].sum() > 0 and fidelity["slow_requests"].sum() > 0
    streams = tables["stream_responses"]
    assert NOT_CAPTURED not in streams.attrs
    # every seventh trace of each pod is a stream message: traces 0, 7 and 14 of 20
    assert streams["requests"].sum() == 3 * 3
    assert (streams["gaps"] > 0).all()

    export = tmp_path / "export"
    export_parquet([LIVE_DB], export)
    con = duckdb.connect()
    try:
        for table in TABLES:
            schema = [
                con.sql(f"DESCRIBE SELECT * FROM '{d}/{table}/*.parquet'").fetchall()
                for d in (out, export)
            ]
            assert [r[:2] for r in schema[0]] == [r[:2] for r in schema[1]], table
    finally:
        con.close()
