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
    subst = {
        "MODEL": str(cnn_onnx),
        "MODEL.txt": str(txt),
        "TS": str(cnn_torchscript),
        "missing.onnx": str(tmp_path / "missing.onnx"),
    }
    rc = main(["profile", *[subst.get(a, a) for a in args], *FAST])
    assert rc == 2
    assert message in capsys.readouterr().err
