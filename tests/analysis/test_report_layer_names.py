"""Layer names and types as they are, from a real ONNX Runtime profile to every report format.

The small CNN is given the long, path-like node and tensor names a PyTorch export writes
(`/encoder/layers.3/.../relu/Relu`), profiled with graph optimizations on (ORT fuses each
Conv with its Relu and names the result after the Relu's output), and reported.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import onnx
import pytest

from analysis.report import main as report_main
from sidecar.cli import main as sidecar_main
from sidecar.profiling.summary import NAME_WIDTH, cut
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.harness import models

PREFIX = "/encoder/layers.3/layers.3.1/block"  # long, as torch.onnx.export names nodes


def _long_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every node `Conv_0` -> `PREFIX/conv_0/Conv`, its output -> `..._output_0`."""
    graph = model.graph
    keep = {i.name for i in graph.input} | {o.name for o in graph.output}
    keep |= {t.name for t in graph.initializer}
    renamed: dict[str, str] = {}
    for node in graph.node:
        op, _, num = node.name.rpartition("_")
        node.name = f"{PREFIX}/{op.lower()}_{num}/{op}"
        for k, out in enumerate(node.output):
            if out not in keep:
                renamed[out] = f"{node.name}_output_{k}"
                node.output[k] = renamed[out]
    for node in graph.node:
        for k, inp in enumerate(node.input):
            node.input[k] = renamed.get(inp, inp)
    return model


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list]:
    tmp = tmp_path_factory.mktemp("names")
    path = models.save_onnx(_long_names(models.small_cnn_onnx()), tmp / "named.onnx")
    db = tmp / "t.db"
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        rc = sidecar_main(["profile", str(path), "--levels", "M,L", "--db", str(db),
                           "--iterations", "4", "--warmup", "1", "--no-peak"])  # fmt: skip
    assert rc == 0
    store = TraceStore(db)
    try:
        (trace,) = store.list_traces()
        layers = [s for s in store.spans(trace.trace_id) if s.level is Level.LAYER]
    finally:
        store.close()
    return db, console.getvalue(), layers


def _report(db: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert report_main([str(db), *args]) == 0
    return capsys.readouterr().out


def test_the_runtime_fused_conv_and_relu(profiled: tuple[Path, str, list]) -> None:
    _, _, layers = profiled
    assert all(s.name.startswith(PREFIX) or "Reorder" in s.name for s in layers)
    fused = [s for s in layers if len(s.attributes["original_nodes"]) > 1]
    assert len(fused) == 2  # both Conv+Relu pairs, optimizations on
    for s in fused:
        assert s.kind == s.attributes["op_type"] == "Conv+Relu"
        assert s.attributes["runtime_op_type"] == "Conv"
        conv, relu = s.attributes["original_nodes"]
        assert conv.endswith("/Conv") and relu.endswith("/Relu")
        assert s.name.startswith(relu)  # ORT names it after the Relu's output
        assert len(s.name) > NAME_WIDTH  # longer than the console's column


def test_console_cuts_only_with_an_ellipsis(profiled: tuple[Path, str, list]) -> None:
    _, out, layers = profiled
    for s in layers:  # the top-layers table: whole, or cut and marked
        shown = cut(s.name, NAME_WIDTH)
        assert f"  {shown}  " in out, s.name
        assert shown == s.name or (shown.endswith("\u2026") and len(shown) == NAME_WIDTH)
    assert sum(cut(s.name, NAME_WIDTH) != s.name for s in layers) >= 4
    for s in layers:  # every fused layer is also listed in full, with its graph nodes
        if len(s.attributes["original_nodes"]) > 1:
            assert f"{s.name}: {', '.join(s.attributes['original_nodes'])}" in out
    assert "Conv+Relu" in out


def test_reports_show_full_names_types_and_gemm_weights(
    profiled: tuple[Path, str, list], capsys: pytest.CaptureFixture[str]
) -> None:
    db, _, layers = profiled
    text = _report(db, capsys, "--only", "A2,A3,A5,A6,A14")
    md = _report(db, capsys, "--only", "A2", "--format", "markdown")
    page = _report(db, capsys, "--only", "A2", "--format", "html", "--no-plots")
    doc = json.loads(_report(db, capsys, "--only", "A2", "--format", "json"))
    assert "\u2026" not in text and "\u2026" not in md  # no table of the report cuts a name
    for s in layers:
        assert s.name in text and s.name in md and s.name in page
    for word in ("Conv+Relu", "GlobalAveragePool", "MaxPool", "Softmax"):
        assert re.search(rf"\s{re.escape(word)}\s", text), word
    rows = {r["name"]: r for r in doc["A2"]["rows"]}
    for s in layers:
        row = rows[s.name]
        assert row["type"] == s.attributes["op_type"]
        nodes = s.attributes["original_nodes"]
        if len(nodes) > 1:
            assert row["type"] == "Conv+Relu" and row["original_nodes"] == ", ".join(nodes)
            assert row["original_nodes"] in text and row["original_nodes"] in page
    gemm = next(r for r in doc["A2"]["rows"] if r["type"] == "Gemm")
    assert json.loads(gemm["input_shapes"]) == [[1, 16], [10, 16], [10]]  # X, weight B, bias C
    assert "[[1,16],[10,16],[10]]" in text
