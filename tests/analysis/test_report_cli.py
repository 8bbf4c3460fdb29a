"""`python analysis/report.py` run as a script: formats, filters, fleets, errors."""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.load.tracedb import TraceDatabaseError, load_traces
from analysis.trace_analysis import TraceAnalysis
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB, REPO, q, trace_attr

SCRIPT = REPO / "analysis" / "report.py"
XSP_KEYS = [f"A{i}" for i in range(1, 16)]
NAMED = [
    "fidelity",
    "live_breakdown",
    "overhead",
    "comparison",
    "time_breakdown",
    "stream_responses",
]


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_help_explains_commands() -> None:
    out = run("--help")
    assert out.returncode == 0
    for word in ("timeline", "compare", "report", "--format", "ui.perfetto.dev"):
        assert word in out.stdout
    # the top-level help shows the default command's filters and formats, with defaults
    for flag in ("--model", "--batch-size", "--since", "--out", "markdown", "(default: 15)"):
        assert flag in out.stdout
    bare = run()
    assert bare.returncode == 2 and "--format" in bare.stderr
    sub = run("report", "--help").stdout
    for flag in ("--model", "--trace", "--batch-size", "--since", "--format", "--out"):
        assert flag in sub


def test_json_is_keyed_by_xsp_ids_from_any_directory(tmp_path: Path) -> None:
    out = run(str(CPU_DB), "--format", "json", cwd=tmp_path)  # not the repo root
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"meta", "findings", "skipped_rows", *XSP_KEYS, *NAMED}
    assert doc["skipped_rows"] == {"count": 0, "summary": "", "rows": [], "rows_left_out": 0}
    assert doc["A8"]["status"] == "not_captured" and "kernel_level" in doc["A8"]["reason"]
    assert doc["A14"]["estimated"] is True and doc["A2"]["status"] == "ok"
    assert doc["comparison"]["status"] == "not_applicable"
    (n_layers,) = q(
        CPU_DB,
        "SELECT COUNT(DISTINCT t.batch_size || s.name) FROM spans s JOIN traces t USING "
        "(trace_id) WHERE s.level='layer' AND t.status='ok'",
    )[0]
    assert len(doc["A2"]["rows"]) == n_layers
    assert doc["A1"]["optimal_batch"] == {"small_cnn": None}


def test_filters(tmp_path: Path) -> None:
    doc = json.loads(run(str(GPU_DB), "--format", "json", "--batch-size", "2,8").stdout)
    assert sorted(r["batch_size"] for r in doc["A1"]["rows"]) == [2, 8]
    created = sorted(c for (c,) in q(GPU_DB, "SELECT created_ns FROM traces"))
    since = str(created[10])
    doc = json.loads(run(str(GPU_DB), "--format", "json", "--since", since).stdout)
    assert doc["meta"]["traces"] == len(created) - 10
    tid = q(GPU_DB, "SELECT trace_id FROM traces ORDER BY trace_id LIMIT 1")[0][0]
    doc = json.loads(run(str(GPU_DB), "--format", "json", "--trace", tid[:10]).stdout)
    assert doc["meta"]["traces"] == 1
    # a model no store holds: one line naming the models that exist, exit 2
    (n,) = q(GPU_DB, "SELECT COUNT(*) FROM traces WHERE model = 'tiny_resnet'")[0]
    (m,) = q(CPU_DB, "SELECT COUNT(*) FROM traces WHERE model = 'small_cnn'")[0]
    for args in (["--model", "doesnotexist"], ["--model", "small_cnn,doesnotexist"]):
        out = run(str(GPU_DB), str(CPU_DB), *args)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (
            f"report.py: no model named doesnotexist in {GPU_DB}, {CPU_DB}; the stores "
            f"hold: small_cnn ({m} traces), tiny_resnet ({n} traces)\n"
        )
    assert run("timeline", "abc", str(GPU_DB), "--model", "doesnotexist").returncode == 2
    # a model that exists, but no trace of it matches the other filters: exit 1
    out = run(str(GPU_DB), "--model", "tiny_resnet", "--batch-size", "3")
    assert out.returncode == 1 and "no trace" in out.stderr
    out = run(str(GPU_DB), "--since", "last tuesday")
    assert out.returncode == 2 and "--since" in out.stderr


def test_fleet_keeps_each_source(tmp_path: Path) -> None:
    pod_a, pod_b = tmp_path / "pod-a" / "traces.sqlite", tmp_path / "pod-b" / "traces.sqlite"
    for p in (pod_a, pod_b):
        p.parent.mkdir()
        shutil.copy(CPU_DB, p)
    ta = TraceAnalysis.from_paths([pod_a, pod_b])
    # the same trace ids in both pods stay two traces, each with its source
    assert ta.data.traces["tkey"].nunique() == 2 * ta.data.traces["trace_id"].nunique()
    assert set(ta.data.traces["source_db"]) == {str(pod_a), str(pod_b)}
    assert ta.data.spans.groupby("tkey")["source_db"].nunique().eq(1).all()
    doc = json.loads(run(str(pod_a), str(pod_b), "--format", "json").stdout)
    assert doc["meta"]["sources"] == f"{pod_a}, {pod_b}"
    cmp_ = doc["comparison"]
    assert cmp_["status"] == "ok" and cmp_["labels"] == [
        "pod-a/traces.sqlite",
        "pod-b/traces.sqlite",
    ]
    assert all(abs(r["diff_ms"]) < 1e-12 for r in cmp_["rows"])  # identical pods
    single = json.loads(run(str(CPU_DB), "--format", "json").stdout)
    assert [r["n_traces"] for r in doc["A1"]["rows"]] == [
        2 * r["n_traces"] for r in single["A1"]["rows"]
    ]


def test_text_markdown_and_csv(tmp_path: Path) -> None:
    text = run(str(GPU_DB), str(LIVE_DB)).stdout
    assert "A1: Model throughput" in text and "A15: Model aggregate" in text
    assert "live breakdown:" in text and "synthetic" in text
    md = run(str(CPU_DB), "--format", "markdown", "--out", str(tmp_path / "md"))
    assert md.returncode == 0
    body = (tmp_path / "md" / "report.md").read_text()
    assert "## A14: Layer roofline (estimated)" in body and "**NOT CAPTURED:" in body
    assert run(str(CPU_DB), "--format", "csv").returncode != 0  # needs --out
    out = run(str(GPU_DB), "--format", "csv", "--out", str(tmp_path / "csv"))
    assert out.returncode == 0, out.stderr
    doc = json.loads(run(str(GPU_DB), "--format", "json").stdout)
    for key in XSP_KEYS:
        path = tmp_path / "csv" / f"{key}.csv"
        if doc[key]["status"] != "ok":  # an analysis without data writes no CSV
            assert not path.exists()
            continue
        with open(path, newline="") as f:
            assert len(list(csv.DictReader(f))) == len(doc[key]["rows"])
    assert (tmp_path / "csv" / "findings.csv").is_file()


def test_only_and_unknown_keys() -> None:
    doc = json.loads(run(str(GPU_DB), "--format", "json", "--only", "A1,A15").stdout)
    assert set(doc) == {"meta", "findings", "skipped_rows", "A1", "A15"}
    out = run(str(GPU_DB), "--only", "A99")
    assert out.returncode == 2 and "unknown analysis" in out.stderr


def test_compare_command() -> None:
    out = run("compare", str(GPU_DB), "--base", "batch_size=1", "--new", "batch_size=8",
              "--format", "json")  # fmt: skip
    doc = json.loads(out.stdout)
    assert set(doc) == {"meta", "skipped_rows", "comparison"}  # no findings: not a report
    rows = {r["type"]: r for r in doc["comparison"]["rows"]}
    assert rows["Conv"]["batch_size=8_ms"] > rows["Conv"]["batch_size=1_ms"]
    assert run("compare", str(GPU_DB), "--base", "model=x").returncode != 0


def test_not_a_trace_store(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_text("hello")
    out = run(str(bad))
    assert out.returncode == 1 and "not" in out.stderr and "bad.db" in out.stderr
    out = run(str(tmp_path / "missing.db"))
    assert out.returncode == 1 and "no such file" in out.stderr


def test_unreadable_databases_raise_trace_database_error(tmp_path: Path) -> None:
    """The reader's own error, distinct from the store's `TraceStoreError`."""
    bad = tmp_path / "bad.db"
    bad.write_text("hello")
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    cases = [
        ([], "no trace database"),
        ([bad], "not a readable SQLite database"),
        ([empty], "not an xsp-sidecar trace store"),
        ([tmp_path / "none.db"], "no such file"),
    ]
    for paths, message in cases:
        with pytest.raises(TraceDatabaseError, match=message):
            load_traces(paths)


@pytest.mark.parametrize("fmt", ["text", "html"])
def test_write_to_out_dir(tmp_path: Path, fmt: str) -> None:
    out = run(str(CPU_DB), "--format", fmt, "--out", str(tmp_path), "--no-plots")
    assert out.returncode == 0
    ext = {"text": "txt", "html": "html"}[fmt]
    assert (tmp_path / f"report.{ext}").stat().st_size > 1000


def test_meta_says_how_the_peak_was_measured() -> None:
    from analysis.report import peak_line
    from sidecar.profiling.peak import Peak

    peak = Peak(182.4e9, 12.1e9, measured_ns=1_763_000_000 * 10**9, load_per_cpu=0.046, rounds=5)
    assert peak_line(peak.trace_attributes()) == (
        "cpu-microbenchmark 182.4 GFLOP/s, 12.1 GB/s, best of 5 rounds, "
        "measured 2025-11-13 02:13 UTC, load 0.05/CPU"
    )
    doc = json.loads(run(str(CPU_DB), "--format", "json", "--only", "A15").stdout)
    # a store may hold several peaks (one re-measured when a layer beat it): each one listed
    stored = sorted(trace_attr(CPU_DB, "peak_flops_per_s"))
    listed = doc["meta"]["peaks"].split(" | ")
    assert len(listed) == len(stored)
    for flops in stored:
        head = f"cpu-microbenchmark {flops / 1e9:.4g} GFLOP/s, "
        assert any(line.startswith(head) for line in listed), (head, listed)
