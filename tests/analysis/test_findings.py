"""Findings: each rule fires where it should and stays silent where it should not, on the
checked-in stores, on copies of them changed with real SQLite UPDATEs, and on the real H100
recordings in tests/data/gpu-fixtures (kernel names and timelines a real GPU emitted)."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis import findings
from analysis.analyses.common import AnalysisResult
from analysis.trace_analysis import TraceAnalysis
from sidecar.trace.spans import new_span_id, new_trace_id
from tests.analysis.helpers import (
    CPU_DB,
    GPU_DB,
    LIVE_DB,
    MS,
    REPO,
    q,
    relay_request,
    server_spans,
    write_live,
)

FIXTURES = REPO / "tests" / "data" / "gpu-fixtures"  # copies of the H100 recordings
SCRIPT = REPO / "analysis" / "report.py"


def _rules(db: Path) -> dict[str, list[findings.Finding]]:
    out: dict[str, list[findings.Finding]] = {}
    for f in TraceAnalysis.from_paths([db]).findings():
        out.setdefault(f.rule, []).append(f)
    return out


def _changed(src: Path, tmp_path: Path, *sql: str) -> Path:
    db = tmp_path / "changed.sqlite"
    shutil.copy(src, db)
    conn = sqlite3.connect(db)
    try:
        for statement in sql:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()
    return db


@pytest.fixture(scope="module")
def checked_in() -> dict[str, dict[str, list[findings.Finding]]]:
    return {"cpu": _rules(CPU_DB), "gpu": _rules(GPU_DB), "live": _rules(LIVE_DB)}


def test_which_rules_fire_on_the_checked_in_stores(
    checked_in: dict[str, dict[str, list[findings.Finding]]],
) -> None:
    # the CPU store was profiled on a 2-core machine busy with other work: its peak (best of 5
    # rounds at load 0.83/CPU) is below what the fused convolutions achieved
    assert set(checked_in["cpu"]) == {
        "optimal_batch",
        "memory_bound_layers",
        "profiler_overhead",
        "peak_below_achieved",
    }
    assert set(checked_in["gpu"]) == {
        "optimal_batch",
        "launch_bound",
        "tensor_cores_unused",
        "memory_bound_layers",
        "profiler_overhead",
    }
    assert set(checked_in["live"]) == {"replay_fidelity", "optimal_batch"}
    for rules in checked_in.values():
        for found in rules.values():
            for f in found:
                assert f.finding and f.evidence and f.action
                assert all(key in f.evidence for key in f.analyses)  # names its analysis


def test_optimal_batch_says_what_to_measure(
    checked_in: dict[str, dict[str, list[findings.Finding]]],
) -> None:
    (big, small) = checked_in["live"]["optimal_batch"]
    assert "not yet known" in big.finding and "--batch-size 1,2" in big.action
    assert {big.subject, small.subject} == {"big_cnn", "small_cnn"}


def test_optimal_batch_decided_on_quiet_measurements(tmp_path: Path) -> None:
    # throughput 1000, 1900, 3000, 3090 inputs/s (+3% from 4 to 8), 0.1% apart per trace
    db = _changed(
        GPU_DB,
        tmp_path,
        "UPDATE level_stats SET trimmed_mean_ns = (SELECT CAST(t.batch_size * 1e9 / "
        "(CASE t.batch_size WHEN 1 THEN 1000 WHEN 2 THEN 1900 WHEN 4 THEN 3000 ELSE 3090 END)"
        " * (1 + (level_stats.rowid % 3) * 0.001) AS INTEGER) FROM traces t "
        "WHERE t.trace_id = level_stats.trace_id) WHERE level = 'model'",
    )
    (f,) = _rules(db)["optimal_batch"]
    assert f.finding.startswith("tiny_resnet: the optimal batch size is 4 (299")
    assert "doubling 4->8 adds +3.0%" in f.evidence and "batches of 4" in f.action


def test_optimal_batch_silent_without_batch_sizes(tmp_path: Path) -> None:
    db = _changed(CPU_DB, tmp_path, "UPDATE traces SET batch_size = NULL")
    assert "optimal_batch" not in _rules(db)


def test_model_level_after_cupti_names_the_sweeps_exposed_profiles(
    tmp_path: Path, checked_in: dict[str, dict[str, list[findings.Finding]]]
) -> None:
    """The attribute `run_experiment` sets where a CUPTI client ran before M (a GPU sweep of
    `xsp-sidecar profile`): named per model with its batch sizes; silent on the stores."""
    assert all("model_level_after_cupti" not in rules for rules in checked_in.values())
    db = _changed(
        GPU_DB,
        tmp_path,
        "UPDATE traces SET attributes = json_set(attributes, '$.model_level_after_cupti', "
        "'CuptiTracer') WHERE batch_size > 1",
    )
    (f,) = _rules(db)["model_level_after_cupti"]
    assert f.subject == "tiny_resnet"
    assert "after CuptiTracer had recorded in the same process" in f.finding
    assert "batch size(s) 2, 4, 8" in f.evidence
    assert "one batch size per" in f.action


def _live_store(db: Path, server: dict[str, tuple[float, float]], n: int = 3) -> Path:
    """`n` sampled add_sub requests (client 0..5 ms, response's first byte at 4 ms) with
    these backend spans (ms after the request reached the relay)."""
    traces = []
    for _ in range(n):
        tid, rid = new_trace_id(), new_span_id()
        spans = [relay_request(tid, rid, (0, 100_000, 4 * MS, 5 * MS))]
        traces.append(("add_sub", spans + server_spans(tid, rid, server)))
    write_live(db, traces)
    return db


def test_live_queue_fires_when_requests_wait(
    tmp_path: Path, checked_in: dict[str, dict[str, list[findings.Finding]]]
) -> None:
    assert "live_queue" not in checked_in["live"]  # 6% and 14% of the client's latency
    db = _live_store(tmp_path / "q.db", {"request": (0.2, 3.9), "queue": (0.3, 2.8)})
    (f,) = _rules(db)["live_queue"]
    assert f.subject == "add_sub" and "queue" in f.finding
    assert "instance_group" in f.action and "dynamic batching" in f.action


def test_post_response_work_fires_when_the_backend_works_on(
    tmp_path: Path, checked_in: dict[str, dict[str, list[findings.Finding]]]
) -> None:
    assert "post_response_work" not in checked_in["live"]
    quick = _live_store(tmp_path / "a.db", {"request": (0.2, 4.5), "compute_infer": (0.5, 3.9)})
    assert "post_response_work" not in _rules(quick)  # 0.5 ms after: 10 % of 5 ms
    db = _live_store(tmp_path / "b.db", {"request": (0.2, 6.0), "compute_infer": (0.5, 5.5)})
    (f,) = _rules(db)["post_response_work"]
    assert f.subject == "add_sub" and "2 ms per request after the response left" in f.finding
    assert "server_after_response 2 ms mean" in f.evidence and "instances" in f.action


def test_failed_profiles_are_reported_with_their_reason(tmp_path: Path) -> None:
    db = _changed(
        CPU_DB,
        tmp_path,
        "UPDATE traces SET status = 'error', error = 'replay failed: out of memory' "
        "WHERE rowid IN (1, 2)",
    )
    (f,) = _rules(db)["failed_profiles"]
    assert f.finding.startswith("2 profile(s) failed")
    assert "2x replay failed: out of memory" in f.evidence


def test_peak_below_achieved_hides_utilization_above_one(
    tmp_path: Path, checked_in: dict[str, dict[str, list[findings.Finding]]]
) -> None:
    assert "peak_below_achieved" not in checked_in["gpu"]
    assert "peak_below_achieved" not in checked_in["live"]
    (recorded,) = checked_in["cpu"]["peak_below_achieved"]  # measured under load (above)
    assert "Conv+Relu" in recorded.evidence and "--refresh-peak" in recorded.action
    # silent on the same real profiles once the peak is one they did not beat
    raised = _changed(
        CPU_DB,
        tmp_path,
        "UPDATE traces SET attributes = json_set(attributes, '$.peak_flops_per_s', 1e12)",
    )
    assert not [
        x
        for x in TraceAnalysis.from_paths([raised]).findings()
        if x.rule == ("peak_below_achieved")
    ]
    db = _changed(
        CPU_DB,
        tmp_path,
        "UPDATE traces SET attributes = json_set(attributes, '$.peak_flops_per_s', 2e10)",
    )
    ta = TraceAnalysis.from_paths([db])
    (f,) = [x for x in ta.findings() if x.rule == "peak_below_achieved"]
    assert "--refresh-peak" in f.action
    a15 = ta.get_model_aggregate()
    assert a15["above_roof"].any()
    assert a15.loc[a15["above_roof"], "utilization"].isna().all()
    assert (a15["utilization"].dropna() <= 1).all()
    assert any("above the recorded roof" in n for n in ta.result("A14").notes)


def test_profiler_overhead_threshold(
    checked_in: dict[str, dict[str, list[findings.Finding]]],
) -> None:
    (cpu,) = checked_in["cpu"]["profiler_overhead"]
    assert "layer-level profiling" in cpu.finding
    (gpu,) = checked_in["gpu"]["profiler_overhead"]  # K run 1.9x; L run 1.25x stays silent
    assert "kernel-level profiling made the model 90% slower" in gpu.finding


def _fixture(name: str) -> dict:
    with gzip.open(FIXTURES / name) as f:
        return json.load(f)


def _breakdown(name: str) -> AnalysisResult:
    """time_breakdown of a real H100 recording: kernel busy time (interval union) inside each
    forward's host wall, as the rule reads it."""
    d = _fixture(name)
    to_epoch = d["perf_counter_to_epoch_ns"]
    kernels = sorted(
        (r["start"] + d["offset_ns_cupti_to_epoch"], r["end"] + d["offset_ns_cupti_to_epoch"])
        for r in d["records"]
        if r.get("kind") == 10
    )
    rows = []
    for w0, w1 in d["walls_perf_counter_ns"]:
        lo, hi = w0 + to_epoch, w1 + to_epoch
        busy, cursor = 0, lo
        for s, e in kernels:
            s, e = max(s, cursor), min(e, hi)
            if e > s:
                busy += e - s
                cursor = e
        rows.append((hi - lo, busy))
    window = sum(w for w, _ in rows) / len(rows) / 1e6
    busy = sum(b for _, b in rows) / len(rows) / 1e6
    table = pd.DataFrame(
        {
            "model": ["resnet50"],
            "batch_size": [8],
            "window_ms": [window],
            "kernel_ms": [busy],
            "idle_pct": [100 * (1 - busy / window)],
        }
    )
    return AnalysisResult("time_breakdown", "t", table)


def test_launch_bound_on_real_h100_recordings() -> None:
    eager = _breakdown("cupti_resnet50_b8_h100.json.gz")
    (f,) = findings.launch_bound(lambda k: eager, None)  # type: ignore[arg-type]
    assert 1.7 < eager.table["kernel_ms"].iloc[0] < 1.85  # 1.77 ms of kernels per forward
    assert "CUDA graph" in f.action
    graph = _breakdown("cupti_resnet50_b8_cudagraph_h100.json.gz")
    assert graph.table["idle_pct"].iloc[0] < 100 * findings.IDLE_SHARE  # 1.75 of 3.0 ms
    assert findings.launch_bound(lambda k: graph, None) == []  # type: ignore[arg-type]


def _kernels(name: str) -> pd.DataFrame:
    d = _fixture(name)
    return pd.DataFrame(
        [(r["name"], r["end"] - r["start"]) for r in d["records"] if r.get("kind") == 10],
        columns=["name", "duration_ns"],
    )


def test_tensor_cores_on_real_h100_kernel_names() -> None:
    # BERT-base in FP32: its GEMMs are sm80_xmma_gemm_f32f32..._ffma kernels
    mm, tc, longest = findings.tensor_core_use(_kernels("cupti_bert_base_b8_s128_h100.json.gz"))
    assert mm >= findings.MATMUL_SHARE and tc < findings.TENSOR_CORE_SHARE
    assert "ffma" in longest
    # ResNet-50: cuDNN picked TF32 tensor-core convolutions (xmma ..tf32.., cutlass tensorop)
    mm, tc, _ = findings.tensor_core_use(_kernels("cupti_resnet50_b8_h100.json.gz"))
    assert tc >= findings.TENSOR_CORE_SHARE


@pytest.mark.parametrize("fmt", ["text", "markdown", "html", "json"])
def test_findings_come_first_in_every_format(tmp_path: Path, fmt: str) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(GPU_DB), "--format", fmt, "--out", str(tmp_path),
         "--no-plots"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    text = next(tmp_path.iterdir()).read_text()
    if fmt == "json":
        doc = json.loads(text)
        assert list(doc)[:2] == ["meta", "findings"]
        assert {f["rule"] for f in doc["findings"]} >= {"launch_bound", "tensor_cores_unused"}
        return
    heading = {"text": "\nfindings\n", "markdown": "## Findings", "html": "<h2>Findings</h2>"}
    first = {"text": "A1: Model", "markdown": "## A1:", "html": "<section id='A1'>"}
    assert 0 < text.index(heading[fmt]) < text.index(first[fmt])
    assert text.index("GPU is idle") < text.index(first[fmt])
    (n,) = q(GPU_DB, "SELECT COUNT(*) FROM traces")[0]
    assert n > 0
