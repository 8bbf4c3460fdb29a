"""`bench/report_speed.py --fleet` at a small size: the generated fleet is what it says (500
spans a trace, every pod, every model) and the fleet report runs over it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from analysis.fleet import fleet_tables

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
        "client_total", "network_proxy", "queue", "compute_input", "compute_infer",
        "compute_output", "server_other", "server_after_response",
    }  # fmt: skip
