"""`xsp-sidecar profile` end to end: real ONNX Runtime / PyTorch, real SQLite trace store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sidecar.cli import main
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore

FAST = ["--iterations", "4", "--warmup", "1", "--no-peak"]


def test_batch_sweep_stores_one_trace_per_batch(
    cnn_onnx: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "traces.db"
    rc = main(["profile", str(cnn_onnx), "--batch-size", "1,2,4", "--db", str(db), *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    assert "optimal batch size" in out and "layer type shares" in out
    store = TraceStore(db)
    try:
        traces = store.list_traces()
        assert sorted(t.batch_size or 0 for t in traces) == [1, 2, 4]
        for t in traces:
            assert t.model == "small_cnn"
            spans = store.spans(t.trace_id)
            assert len([s for s in spans if s.level is Level.MODEL]) == 1
            layers = [s for s in spans if s.level is Level.LAYER]
            assert layers and all(
                s.attributes["input_shapes"][0][0] == t.batch_size
                for s in layers
                if s.attributes["op_type"] == "MaxPool"
            )
            assert {s.level for s in store.level_stats(t.trace_id)} == {Level.MODEL, Level.LAYER}
    finally:
        store.close()


def test_json_output_with_explicit_input_and_torchscript(
    cnn_torchscript: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "profile",
            str(cnn_torchscript),
            "--input",
            "x:1x3x32x32:float32",
            "--levels",
            "M,L,K",
            "--json",
            *FAST,
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (prof,) = doc["profiles"]
    assert prof["batch_size"] == 1 and set(prof["levels"]) == {"model", "layer", "kernel"}
    assert prof["kernel_spans"] > 0 and prof["top_layers"]


def test_npz_inputs_and_peak(
    cnn_onnx: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XSP_CACHE_DIR", str(tmp_path / "cache"))
    npz = tmp_path / "in.npz"
    np.savez(npz, input=np.ones((3, 3, 32, 32), np.float32))
    db = tmp_path / "t.db"
    rc = main(
        [
            "profile",
            str(cnn_onnx),
            "--inputs",
            str(npz),
            "--levels",
            "M",
            "--db",
            str(db),
            "--iterations",
            "3",
            "--warmup",
            "1",
        ]
    )
    assert rc == 0
    assert (tmp_path / "cache" / "peak.json").is_file()
    store = TraceStore(db)
    try:
        (trace,) = store.list_traces()
        assert trace.batch_size == 3 and trace.attributes["peak_flops_per_s"] > 0
        assert trace.attributes["peak_source"] == "cpu-microbenchmark"
        # when and under what load the peak was measured travels with the trace
        assert trace.attributes["peak_measured_ns"] > 0 and trace.attributes["peak_rounds"] > 0
        # and the cache levels' roofs, measured with it
        assert trace.attributes["peak_cache_bytes_per_s"]["DRAM"] > 0
        assert trace.attributes["peak_cache_source"] == "measured (one core, read)"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.onnx"], "model file not found"),
        (["MODEL.txt"], "unknown model extension '.txt'"),
        (["MODEL", "--input", "input:1xZ:float32"], "bad --input"),
        (["MODEL", "--levels", "M,Q"], "unknown level 'Q'"),
        (["MODEL", "--batch-size", "1,two"], "bad --batch-size"),
        (["TS"], "does not declare its inputs"),
        (["CORRUPT.onnx"], "is not an ONNX model"),
    ],
)
def test_clear_errors(
    args: list[str],
    message: str,
    cnn_onnx: Path,
    cnn_torchscript: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    txt = tmp_path / "model.txt"
    txt.write_text("not a model")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(bytes(range(256)) * 8)  # any bytes that are not an ONNX protobuf
    subst = {
        "MODEL": str(cnn_onnx),
        "MODEL.txt": str(txt),
        "TS": str(cnn_torchscript),
        "missing.onnx": str(tmp_path / "missing.onnx"),
        "CORRUPT.onnx": str(corrupt),
    }
    rc = main(["profile", *[subst.get(a, a) for a in args], *FAST])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err  # one line


def test_help_shows_defaults_and_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 20)" in text and "(default: 5)" in text and "--refresh-peak" in text
    assert "--max-rounds N" in text and "0 never repeats (default: 2)" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "analysis/report.py" in capsys.readouterr().out


def test_sweep_without_the_double_names_what_to_measure(
    cnn_onnx: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the issue's `--batch-size 1,4`: batch 2 was never measured, so no optimum is claimed
    rc = main(["profile", str(cnn_onnx), "--batch-size", "1,4", "--levels", "M", "--json",
               *FAST])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["optimal_batch"] is None
    assert doc["batch_decision"]["status"] == "not_yet_known"
    assert doc["batch_decision"]["measure_next"] == [2, 8]
    # named, never measured: the command to run, not a silent extra batch size
    assert [p["batch_size"] for p in doc["profiles"]] == [1, 4]
    assert doc["batch_rounds"]["rounds"] == 0
    command = doc["suggested_command"]
    assert command.startswith("xsp-sidecar profile ") and "--batch-size 1,2,4,8 " in command
    assert "--levels M --iterations 4 --warmup 1" in command and "--no-peak" in command


def test_console_and_report_decide_the_same_from_the_pooled_rounds(
    cnn_onnx: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from analysis.trace_analysis import TraceAnalysis

    db = tmp_path / "sweep.db"
    # 3 iterations per run: noisy enough that the first decision is often uncertain
    rc = main(["profile", str(cnn_onnx), "--batch-size", "1,2,4", "--levels", "M", "--iterations",
               "3", "--warmup", "1", "--no-peak", "--max-rounds", "2", "--db", str(db),
               "--json"])  # fmt: skip
    assert rc == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    decision, rounds = doc["batch_decision"], doc["batch_rounds"]
    assert rounds["rounds"] <= 2 and len(rounds["remeasured"]) == rounds["rounds"]
    if rounds["rounds"] < 2:  # stopped early: only once the decision was no longer uncertain
        assert decision["status"] != "uncertain"
    assert captured.err.count("re-measuring batch") == rounds["rounds"]
    # the report reaches the console's decision from the database alone
    assert TraceAnalysis.from_paths([db]).get_batch_decision() == {"small_cnn": decision}
    store = TraceStore(db)
    try:
        traces = {t.batch_size: t for t in store.list_traces()}
        assert sorted(traces) == [1, 2, 4]  # repeats pool into the sweep's traces
        for batch, trace in traces.items():
            runs = 1 + sum(batch in r for r in rounds["remeasured"])
            (stats,) = store.level_stats(trace.trace_id)
            assert len(stats.samples_ns) == 3 * runs
            assert trace.attributes.get("model_runs", 1) == runs
    finally:
        store.close()


def test_a_layer_faster_than_the_cached_peak_measures_it_again(
    cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sidecar.profiling.peak import machine_key

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("XSP_CACHE_DIR", str(cache))
    low = {
        "flops_per_s": 1e3,
        "dram_bytes_per_s": 1e3,
        "source": "cpu-microbenchmark",
        "machine": machine_key(),
        "measured_ns": 1,
        "load_per_cpu": 0.0,
        "rounds": 5,
    }
    (cache / "peak.json").write_text(json.dumps(low))
    db = tmp_path / "t.db"
    rc = main(["profile", str(cnn_onnx), "--levels", "M,L", "--db", str(db), "--iterations", "3",
               "--warmup", "1"])  # fmt: skip
    assert rc == 0
    store = TraceStore(db)
    try:
        (trace,) = store.list_traces()
    finally:
        store.close()
    assert trace.attributes["peak_flops_per_s"] > 1e8  # measured again, not 1 kFLOP/s
    assert json.loads((cache / "peak.json").read_text())["flops_per_s"] > 1e8


def test_layer_names_fusions_and_gemm_weights(
    cnn_onnx: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnx

    db = tmp_path / "t.db"
    rc = main(["profile", str(cnn_onnx), "--levels", "M,L", "--db", str(db), *FAST])
    assert rc == 0
    out = capsys.readouterr().out
    store = TraceStore(db)
    try:
        (trace,) = store.list_traces()
        layers = [s for s in store.spans(trace.trace_id) if s.level is Level.LAYER]
    finally:
        store.close()
    for s in layers:  # every name whole, never cut mid-word
        assert f"  {s.name}  " in out
    fused = [s for s in layers if len(s.attributes["original_nodes"]) > 1]
    assert fused and "Conv+Relu" in out
    for s in fused:
        assert f"{s.name}: {', '.join(s.attributes['original_nodes'])}" in out
    # Gemm: ORT's profiler leaves out the pre-packed weight; the trace has it (from the graph)
    model = onnx.load(str(cnn_onnx))
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    (span,) = [s for s in layers if s.attributes["op_type"] == "Gemm"]
    expected = [span.attributes["input_shapes"][0], *(dims[i] for i in gemm.input[1:])]
    assert span.attributes["input_shapes"] == expected and len(expected) == 3
