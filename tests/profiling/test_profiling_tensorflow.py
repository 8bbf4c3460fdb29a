"""Leveled profiles of SavedModels with real TensorFlow (CPU): the Keras CNN and transformer
block of `tests.harness.tfserving.models`, the runner, `profile` on a SavedModel folder, and the
pure parts (scopes, layer classes, FLOPs, the clock check) on their own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling.experiment import LeveledProfile, run_experiment
from sidecar.profiling.formats import ModelFormat, format_of
from sidecar.profiling.runners import tf_ops
from sidecar.profiling.runners.select import runner_for
from sidecar.profiling.runners.tf_trace import TFClockError, TFEvent, XTrace, assign
from sidecar.profiling.vocabulary import UNNAMED_INPUT, ProfilingError
from sidecar.trace.spans import Level

tf = pytest.importorskip("tensorflow")

from sidecar.profiling.runners.tensorflow import TensorFlowRunner  # noqa: E402
from tests.harness.tfserving import models  # noqa: E402


@pytest.fixture(scope="module")
def model_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model_base(tmp_path_factory.mktemp("tfmodels"))


@pytest.fixture(scope="module")
def cnn(model_base: Path) -> TensorFlowRunner:
    return TensorFlowRunner(model_base / models.CNN / "1")


def images(batch: int = 2) -> dict[str, np.ndarray]:
    return {"image": np.random.default_rng(0).random((batch, 32, 32, 3), dtype=np.float32)}


def check_tree(res: LeveledProfile, layer_names: tuple[str, ...]) -> dict[str, list[str]]:
    """Layers under M, ops under layers, no ambiguity; returns {layer: [op types]}."""
    (model,) = res.spans_at(Level.MODEL)
    by_id = {s.span_id: s for s in res.spans}
    layers = [s for s in res.spans_at(Level.LAYER) if not s.attributes.get("outside_layers")]
    assert [s.name for s in sorted(layers, key=lambda s: s.start_ns)] == list(layer_names)
    for span in res.spans:
        assert "parent_ambiguous" not in span.attributes, span.name
        assert "parent_missing" not in span.attributes, span.name
    for layer in res.spans_at(Level.LAYER):
        assert layer.parent_id == model.span_id
        assert model.start_ns <= layer.start_ns and layer.end_ns <= model.end_ns
    under: dict[str, list[str]] = {}
    kernels = res.spans_at(Level.KERNEL)
    assert kernels and all(k.kind == "cpu_op" for k in kernels)
    for k in kernels:  # every op event lands under a layer-level span
        parent = by_id[str(k.parent_id)]
        assert parent.level is Level.LAYER
        assert parent.start_ns <= k.start_ns and k.end_ns <= parent.end_ns
        under.setdefault(parent.name, []).append(k.attributes["tf_node"])
    for level in (Level.MODEL, Level.LAYER, Level.KERNEL):
        assert res.stats(level).overhead_ratio > 0
        assert res.stats(level).iterations == len(res.runs[level].iterations)
    assert res.trace.attributes["kernel_level"] == "captured"
    assert res.trace.attributes["tf_profiler_clock"] == "profile_start_time"
    return under


def test_cnn_layers_are_the_keras_layers(cnn: TensorFlowRunner) -> None:
    res = run_experiment(cnn, images(), model="keras_cnn", iterations=4, warmup=1)
    under = check_tree(res, models.CNN_LAYERS)
    layers = {s.name: s for s in res.spans_at(Level.LAYER)}
    assert [layers[n].kind for n in models.CNN_LAYERS] == [
        "Conv2D",
        "MaxPooling2D",
        "Conv2D",
        "GlobalAveragePooling2D",
        "Dense",
    ]
    assert all(n.startswith("keras_cnn_1/conv1_1/") for n in under["conv1"])
    conv1 = layers["conv1"].attributes
    assert conv1["input_shapes"][:2] == [[2, 32, 32, 3], [3, 3, 3, 16]]
    assert conv1["output_shapes"] == [[2, 32, 32, 16]]
    macs = 2 * 32 * 32 * 16 * 27
    assert conv1["flops"] == 2 * macs + 2 * 32 * 32 * 16 and conv1["flops_estimated"] is True
    assert layers["fc"].attributes["flops"] == 2 * 2 * 32 * 10 + 2 * 10
    # ops outside any layer (arguments, the output) are spans of their own
    outside = {s.kind for s in res.spans_at(Level.LAYER) if s.attributes.get("outside_layers")}
    assert "_Arg" in outside or "Identity" in outside


def test_transformer_layers_and_attention(model_base: Path) -> None:
    runner = runner_for(model_base / models.TRANSFORMER)  # a TF-Serving model folder
    assert isinstance(runner, TensorFlowRunner) and runner.model_name == models.TRANSFORMER
    feats = {"features": np.random.default_rng(1).random((2, 16, 32), dtype=np.float32)}
    res = run_experiment(runner, feats, model=models.TRANSFORMER, iterations=3, warmup=1)
    under = check_tree(res, models.TRANSFORMER_LAYERS)
    kinds = {s.name: s.kind for s in res.spans_at(Level.LAYER)}
    assert kinds["attention"] == "MultiHeadAttention"
    assert kinds["norm1"] == "LayerNormalization" and kinds["ffn_up"] == "Dense"
    assert kinds["add1"] == "Add" and kinds["pool"] == "GlobalAveragePooling1D"
    assert any("/query_1/" in n for n in under["attention"])
    attention = next(s for s in res.spans_at(Level.LAYER) if s.name == "attention")
    projections = 4 * 2 * (2 * 16) * 32 * 32
    assert attention.attributes["flops"] > projections


def test_model_level_matches_a_plain_call(cnn: TensorFlowRunner) -> None:
    inputs = images()
    run = cnn.run(inputs, Level.MODEL, iterations=5, warmup=2)
    assert [s.level for it in run.iterations for s in it.spans] == [Level.MODEL] * 5
    for it in run.iterations:
        (span,) = it.spans
        assert span.duration_ns == it.latency_ns > 0
    function = tf.saved_model.load(str(cnn.path)).signatures["serving_default"]
    x = tf.constant(inputs["image"])
    function(image=x)["output_0"].numpy()
    t0 = time.perf_counter_ns()
    plain = function(image=x)["output_0"].numpy()
    plain_ns = time.perf_counter_ns() - t0
    assert plain.shape == (2, 10)
    median = sorted(run.latencies_ns)[2]  # structure, not speed: same order of magnitude
    assert plain_ns / 50 < median < plain_ns * 50


def test_profile_cli_on_a_savedmodel_folder(
    model_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from analysis.report import main as report_main
    from sidecar.cli import main
    from sidecar.trace.store import TraceStore

    db = tmp_path / "traces.db"
    folder = model_base / models.CNN  # TF-Serving layout: the latest version is taken
    args = ["--iterations", "3", "--warmup", "1", "--no-peak", "--levels", "M,L"]
    rc = main(["profile", str(folder), "--batch-size", "1,2", "--db", str(db), *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "conv1" in out and "tensorflow" in out
    store = TraceStore(db)
    try:
        traces = store.list_traces()
        assert sorted(t.batch_size or 0 for t in traces) == [1, 2]
        for t in traces:
            assert t.model == models.CNN
            layers = [s for s in store.spans(t.trace_id) if s.level is Level.LAYER]
            conv1 = next(s for s in layers if s.name == "conv1")
            assert conv1.attributes["input_shapes"][0][0] == t.batch_size
    finally:
        store.close()
    assert report_main([str(db), "--only", "A2", "--format", "json", "--no-plots"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["A2"]["status"] == "ok"
    rows = {(r["batch_size"], r["name"]): r for r in doc["A2"]["rows"]}
    assert rows[(2, "conv1")]["type"] == "Conv2D" and rows[(1, "fc")]["type"] == "Dense"
    # ops outside every Keras layer (arguments, variable reads) are stored, but not layers
    stored = TraceStore(db)
    try:
        outside = [
            s
            for t in stored.list_traces()
            for s in stored.spans(t.trace_id, Level.LAYER)
            if s.attributes.get("outside_layers")
        ]
    finally:
        stored.close()
    assert outside, "the CNN's profile has ops outside its layers (its arguments at least)"
    assert {name for _, name in rows} == set(models.CNN_LAYERS)
    assert report_main([str(db), "--only", "A5", "--format", "json", "--no-plots"]) == 0
    types = {r["type"] for r in json.loads(capsys.readouterr().out)["A5"]["rows"]}
    assert types == {"Conv2D", "MaxPooling2D", "GlobalAveragePooling2D", "Dense"}


def test_savedmodel_formats_and_errors(model_base: Path, cnn: TensorFlowRunner) -> None:
    assert format_of(model_base / models.CNN) is ModelFormat.SAVEDMODEL
    assert format_of(model_base / models.CNN / "1") is ModelFormat.SAVEDMODEL
    with pytest.raises(ProfilingError, match="not supported for SavedModels yet"):
        runner_for(model_base / models.CNN, device="cuda")
    with pytest.raises(ProfilingError, match="no signature 'predict'"):
        TensorFlowRunner(model_base / models.CNN, signature="predict")
    with pytest.raises(ProfilingError, match=r"takes inputs \['image'\]"):
        cnn.run({"x": images()["image"]}, Level.MODEL, 1, 0)
    with pytest.raises(ProfilingError, match="shape"):
        cnn.run({"image": np.zeros((1, 8, 8, 3), np.float32)}, Level.MODEL, 1, 0)
    with pytest.raises(ProfilingError, match="runtime already started"):
        TensorFlowRunner(model_base / models.CNN, threads=1234)


def test_a_rest_predict_without_input_names_feeds_the_one_input(cnn: TensorFlowRunner) -> None:
    """TF-Serving REST's unnamed rows decode to `UNNAMED_INPUT`, which a signature of one
    input takes as its own."""
    import json

    from sidecar.backends.http_message import pack
    from sidecar.backends.tf_rest_decode import decode_rest_predict

    rows = images()["image"]
    body = json.dumps({"instances": rows.tolist()}).encode()
    decoded = decode_rest_predict(pack(body, None, target="/v1/models/cnn:predict"))
    assert list(decoded.inputs) == [UNNAMED_INPUT]
    np.testing.assert_array_equal(cnn.outputs(decoded.inputs)["output_0"],
                                  cnn.outputs({"image": rows})["output_0"])  # fmt: skip


# -- the pure parts ---------------------------------------------------------------------
def test_scopes_and_uniquifier() -> None:
    name = "StatefulPartitionedCall/keras_cnn_1/conv1_1/Relu"
    assert tf_ops.node_path(name) == ["keras_cnn_1", "conv1_1", "Relu"]
    assert tf_ops.scope_of(name) == ("keras_cnn_1", "conv1_1")
    assert tf_ops.scope_of("StatefulPartitionedCall/Identity") is None
    keras3 = tf_ops.LayerNames([("m_1", "conv_1_1"), ("m_1", "gap_1")], ["conv_1"])
    assert keras3.uniquified and keras3.name("conv_1_1") == "conv_1"
    plain = tf_ops.LayerNames([("model", "conv1"), ("model", "dense_1")], ["conv1"])
    assert not plain.uniquified and plain.name("dense_1") == "dense_1"


def test_layer_classes_and_op_flops() -> None:
    assert tf_ops.keras_class(["_MklNativeFusedConv2D", "Reshape", "ReadVariableOp"]) == "Conv2D"
    assert tf_ops.keras_class(["_MklEinsum", "_MklSoftmax", "AddV2"]) == "MultiHeadAttention"
    assert tf_ops.keras_class(["Mean"], 3) == "GlobalAveragePooling1D"
    assert tf_ops.keras_class(["ReadVariableOp"]) is None
    assert tf_ops.parse_shapes("(float[2,32];int32[2];resource)") == [
        ("float", [2, 32]),
        ("int32", [2]),
    ]
    conv = tf_ops.op_work(
        "_MklNativeFusedConv2D",
        [("float", [1, 8, 8, 4]), ("float", [3, 3, 4, 6])],
        {"strides": [1, 2, 2, 1], "padding": "SAME"},
    )
    assert conv is not None and conv.output_shape == [1, 4, 4, 6]
    assert conv.estimate.flops == 2 * (4 * 4 * 6) * (3 * 3 * 4)
    assert tf_ops.op_work("Conv2D", [("float", [1, 8, 8, 4]), ("float", [3, 3, 4, 6])]) is None
    ein = tf_ops.op_work(
        "Einsum", [("float", [2, 5, 3]), ("float", [2, 3, 7])], {"equation": "bik,bkj->bij"}
    )
    assert ein is not None and ein.estimate.flops == 2 * 2 * 5 * 3 * 7
    mm = tf_ops.op_work("_MklMatMul", [("float", [4, 8]), ("float", [8, 2])])
    assert mm is not None and mm.estimate.flops == 2 * 4 * 8 * 2 and mm.output_shape == [4, 2]


def test_clock_check_rejects_events_outside_their_wall() -> None:
    """A fake trace (two calls, one op each) on a profile clock starting at 1000 ns."""
    calls = [TFEvent("f", "", 100, 900), TFEvent("f", "", 2100, 2900)]
    ops = [TFEvent("m/l/op", "Relu", 200, 800), TFEvent("m/l/op", "Relu", 2200, 2800)]
    walls = [(1000, 2000), (3000, 4000)]
    ok = assign(XTrace(ops, calls, 1000), "f", walls, tolerance_ns=0)
    assert [[o.start_ns for o in per] for per in ok.ops] == [[1200], [3200]]
    with pytest.raises(TFClockError, match="outside the host wall"):
        assign(XTrace(ops, calls, 1500), "f", walls, tolerance_ns=0)
    stray = [*ops, TFEvent("m/l/late", "Relu", 1000, 1100)]
    with pytest.raises(TFClockError, match="outside every timed call"):
        assign(XTrace(stray, calls, 1000), "f", walls, tolerance_ns=0)
    with pytest.raises(ProfilingError, match="1 calls of f for 2 timed calls"):
        assign(XTrace(ops, calls[:1], 1000), "f", walls)
    aligned = assign(XTrace(ops, calls, None), "f", walls, tolerance_ns=0)
    assert aligned.clock == "aligned" and aligned.ops[1][0].start_ns == 3200
