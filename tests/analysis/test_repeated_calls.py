"""Every call of a module counted (issue 22, part 5): a TorchScript model that calls one ReLU
three times and one conv twice, profiled on the CPU by the real PyTorch runner into a real
SQLite store, has its eight calls in every layer analysis, not the five module names."""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from analysis.report import main as report_main
from sidecar.cli import main as sidecar_main
from tests.analysis.helpers import q

CALLS = ["conv", "relu", "conv#1", "relu#1", "pool", "relu#2", "flatten", "fc"]
TYPES = ["Conv2d", "ReLU", "Conv2d", "ReLU", "MaxPool2d", "ReLU", "Flatten", "Linear"]


def _repeated_calls_model(path: Path) -> Path:
    import torch
    from torch import nn

    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.relu = nn.ReLU()
            self.pool = nn.MaxPool2d(2)
            self.flatten = nn.Flatten()
            self.fc = nn.Linear(4 * 4 * 4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.relu(self.conv(x))
            x = self.relu(self.conv(x))
            x = self.relu(self.pool(x))
            return self.fc(self.flatten(x))

    torch.manual_seed(0)
    with warnings.catch_warnings():  # torch.jit is deprecated, but Triton's backend loads it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(Repeated().eval()), str(path))
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("calls")
    model = _repeated_calls_model(tmp / "repeated.pt")
    db = tmp / "t.db"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = sidecar_main(["profile", str(model), "--input", "x:2x4x8x8:float32",
                           "--levels", "M,L,K", "--db", str(db), "--iterations", "5",
                           "--warmup", "1", "--no-peak"])  # fmt: skip
        assert rc == 0
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert report_main([str(db), "--format", "json", "--only", "A2,A5,A11"]) == 0
    return db, json.loads(out.getvalue())


def test_the_store_holds_each_call_under_its_module_name(
    report: tuple[Path, dict[str, Any]],
) -> None:
    db, _ = report
    rows = q(db, "SELECT name FROM spans WHERE level = 'layer' ORDER BY start_ns")
    assert [r[0] for r in rows] == [c.split("#")[0] for c in CALLS]


def test_a2_lists_all_eight_calls_and_their_shares_sum_to_one(
    report: tuple[Path, dict[str, Any]],
) -> None:
    db, out = report
    rows = out["A2"]["rows"]
    assert [r["name"] for r in rows] == CALLS
    assert [r["type"] for r in rows] == TYPES
    assert math.isclose(sum(r["latency_share"] for r in rows), 1.0, rel_tol=1e-9)
    # each row is its own call's stored duration (one trace: no mean across traces)
    stored = [r[0] for r in q(db, "SELECT duration_ns FROM spans WHERE level = 'layer' "
                                  "ORDER BY start_ns")]  # fmt: skip
    assert [round(r["latency_ms"] * 1e6) for r in rows] == stored


def test_layer_types_count_calls(report: tuple[Path, dict[str, Any]]) -> None:
    _, out = report
    layers = {r["type"]: r["layers"] for r in out["A5"]["rows"]}
    assert layers == {"ReLU": 3, "Conv2d": 2, "MaxPool2d": 1, "Flatten": 1, "Linear": 1}


def test_each_call_gets_the_operator_it_ran(report: tuple[Path, dict[str, Any]]) -> None:
    db, out = report
    rows = {r["layer"]: r for r in out["A11"]["rows"]}
    assert sorted(rows) == sorted(CALLS)
    assert all(r["count"] == 1 for r in rows.values())  # not 3 aten::relu under one relu
    ops = q(db, "SELECT duration_ns FROM spans WHERE level = 'kernel' ORDER BY start_ns")
    assert [round(rows[c]["latency_ms"] * 1e6) for c in CALLS] == [r[0] for r in ops]


def test_the_fleet_report_counts_every_call_too(
    report: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from analysis.fleet.analyses import export_parquet, fleet_tables

    db, out = report
    export_parquet([str(db)], tmp_path)
    tables = fleet_tables(tmp_path, top=10)
    layers = dict(zip(tables["layer_types"]["type"], tables["layer_types"]["layers"], strict=True))
    assert layers == {r["type"]: r["layers"] for r in out["A5"]["rows"]}
    top = tables["top_layers"]
    assert sorted(top["name"]) == sorted(CALLS)
    shares = {r["name"]: r["latency_share"] for r in out["A2"]["rows"]}
    for name, share in zip(top["name"], top["latency_share"], strict=True):
        assert math.isclose(share, shares[name], rel_tol=1e-9)
