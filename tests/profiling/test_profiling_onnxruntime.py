"""Leveled profiles of the small CNN with the real ONNX Runtime (CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner
from sidecar.profiling.vocabulary import LevelNotSupportedError
from sidecar.trace.spans import Level
from tests.harness.models import SMALL_CNN_LAYERS


def test_unoptimized_profile_has_one_layer_per_node(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray]
) -> None:
    runner = OnnxRuntimeRunner(cnn_onnx, optimizations=False)
    res = run_experiment(runner, cnn_inputs, model="cnn", iterations=6, warmup=2)
    models = res.spans_at(Level.MODEL)
    layers = sorted(res.spans_at(Level.LAYER), key=lambda s: s.start_ns)
    assert len(models) == 1
    assert [s.kind for s in layers] == list(SMALL_CNN_LAYERS)
    assert [s.attributes["op_type"] for s in layers] == list(SMALL_CNN_LAYERS)
    conv0 = layers[0]
    assert conv0.name == "Conv_0" and conv0.attributes["original_nodes"] == ["Conv_0"]
    assert conv0.attributes["input_shapes"][0] == [2, 3, 32, 32]
    assert conv0.attributes["output_shapes"] == [[2, 8, 32, 32]]
    assert conv0.attributes["output_bytes"] == 2 * 8 * 32 * 32 * 4
    assert conv0.attributes["provider"] == "CPUExecutionProvider"
    assert conv0.attributes["flops_estimated"] is True and conv0.attributes["flops"] > 0
    assert layers[-1].attributes["output_shapes"] == [[2, 10]]
    # parents by containment, inside the model span of the timeline
    model = models[0]
    for layer in layers:
        assert layer.parent_id == model.span_id
        assert model.start_ns <= layer.start_ns <= layer.end_ns <= model.end_ns
    assert [s.index for s in layers] == list(range(len(layers)))
    # levels, overhead and trace attributes
    m, lay = res.stats(Level.MODEL), res.stats(Level.LAYER)
    assert m.overhead_ratio == 1.0 and m.iterations == 6 and len(m.samples_ns) == 6
    assert lay.overhead_ratio == pytest.approx(lay.trimmed_mean_ns / m.trimmed_mean_ns, rel=1e-3)
    assert model.duration_ns == m.trimmed_mean_ns
    attrs = res.trace.attributes
    assert attrs["graph_optimizations"] == "disabled" and attrs["layer_names"] == "original"
    assert attrs["levels"] == ["model", "layer"]
    assert attrs["kernel_level"].startswith("not captured")
    assert attrs["inputs"][0]["shape"] == [2, 3, 32, 32]
    assert res.trace.runtime.startswith("onnxruntime ")
    # span clock is Unix epoch ns
    assert abs(model.start_ns - res.trace.created_ns) < 60 * 10**9


def test_optimized_profile_attributes_fused_nodes_to_originals(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray]
) -> None:
    runner = OnnxRuntimeRunner(cnn_onnx)
    res = run_experiment(
        runner, cnn_inputs, model="cnn", levels=[Level.LAYER], iterations=4, warmup=1
    )
    layers = res.spans_at(Level.LAYER)
    covered = [n for s in layers for n in s.attributes["original_nodes"]]
    assert sorted(covered) == sorted(
        [
            "Conv_0",
            "Relu_0",
            "MaxPool_0",
            "Conv_1",
            "Relu_1",
            "GlobalAveragePool_0",
            "Flatten_0",
            "Gemm_0",
            "Softmax_0",
        ]
    )
    (fused,) = [s for s in layers if s.attributes["original_nodes"] == ["Conv_0", "Relu_0"]]
    # typed by what it fused; ORT's own op kept, and the FLOPs estimated from it
    assert fused.kind == fused.attributes["op_type"] == "Conv+Relu"
    assert fused.attributes["runtime_op_type"] == "Conv"
    assert fused.attributes["original_op_types"] == ["Conv", "Relu"]
    assert fused.attributes["flops"] > 0 and fused.attributes["flops_estimated"] is True
    for s in layers:  # a layer that is one node (or none: a reorder ORT inserted) keeps ORT's op
        if len(s.attributes["original_nodes"]) < 2:
            assert s.attributes["op_type"] == s.attributes["runtime_op_type"]
    assert res.trace.attributes["graph_optimizations"] == "enabled"
    assert res.trace.attributes["layer_names"] == "optimized"


def test_kernel_level_on_cpu_is_reported_not_faked(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray]
) -> None:
    runner = OnnxRuntimeRunner(cnn_onnx)
    assert Level.KERNEL not in runner.supported_levels()
    with pytest.raises(LevelNotSupportedError, match="not captured"):
        runner.run(cnn_inputs, Level.KERNEL, 1, 0)
    res = run_experiment(
        runner, cnn_inputs, model="cnn", levels=[Level.MODEL, Level.KERNEL], iterations=2, warmup=1
    )
    assert res.spans_at(Level.KERNEL) == []
    assert "no events below the node level" in res.trace.attributes["kernel_level"]


def test_residual_block_fusions_are_attributed(tmp_path: Path) -> None:
    """Conv+BN+Add+Relu with the residual as an extra input: every node finds its layer."""
    from onnx import TensorProto, helper

    from tests.harness.models import _GraphBuilder, save_onnx

    g = _GraphBuilder()
    x = g.one("Relu", [g.bn(g.conv("input", 8, 16, 3, bias=False), 16)])
    y = g.bn(g.conv(x, 16, 16, 3, bias=False), 16)
    g.nodes.append(helper.make_node("Add", [x, y], ["sum"], name="Add_res"))
    g.nodes.append(helper.make_node("Relu", ["sum"], ["out"], name="Relu_out"))
    model = g.model(
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 8, 16, 16])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 16, 16, 16])],
        "res_block",
    )
    path = save_onnx(model, tmp_path / "res.onnx")
    feed = {"input": np.ones((1, 8, 16, 16), np.float32)}
    res = run_experiment(
        OnnxRuntimeRunner(path), feed, model="res", levels=[Level.LAYER], iterations=2, warmup=1
    )
    covered = sorted(n for s in res.spans_at(Level.LAYER) for n in s.attributes["original_nodes"])
    assert covered == sorted(node.name for node in model.graph.node)
    assert res.trace.attributes["original_nodes_attributed"] == len(model.graph.node)


def test_a_session_that_fell_back_to_the_cpu_is_never_a_gpu_run(
    cnn_onnx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime-gpu lists the CUDA provider even when its CUDA/cuDNN libraries do not
    load; ORT then runs the session on the CPU with a log line. The listing is FAKED here
    (no onnxruntime-gpu); the fall-back is this real ONNX Runtime's own."""
    import onnxruntime as ort

    from sidecar.profiling.runners import onnxruntime as ort_runner
    from sidecar.profiling.vocabulary import ProfilingError

    real = ort.get_available_providers()
    monkeypatch.setattr(
        ort_runner.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real]
    )
    runner = OnnxRuntimeRunner(
        cnn_onnx, providers=[("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    )
    with pytest.raises(ProfilingError, match=r"did not put small_cnn.onnx on CUDAExecutionPro"):
        runner.describe()


class FakeGpuSession:
    """FAKE: a real CPU session whose runs, while the FAKE tracer records, each leave one
    launch and one kernel record inside the run (what CUPTI gives for a GPU session)."""

    recording: list[dict] | None = None

    def __init__(self, session: object) -> None:
        self.session = session
        self.correlation = 0

    def run(self, *args: object) -> object:
        import time

        t0 = time.time_ns()
        out = self.session.run(*args)  # type: ignore[attr-defined]
        t1 = time.time_ns()
        if FakeGpuSession.recording is not None:
            self.correlation += 1
            cid = self.correlation
            FakeGpuSession.recording += [
                {"kind": 5, "start": t0 + 1, "end": t0 + 2, "correlation_id": cid, "cbid": 211},
                {"kind": 10, "start": t0 + 3, "end": t1 - 1, "correlation_id": cid, "name": "k"},
            ]
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self.session, name)


class FakeTracer:
    """FAKE CuptiTracer: hands out what `FakeGpuSession` recorded between start and stop."""

    offset_ns = 0
    api_filter = "cbid"

    def start(self) -> None:
        FakeGpuSession.recording = []

    def stop(self) -> list[dict]:
        records, FakeGpuSession.recording = FakeGpuSession.recording or [], None
        return records


def test_kernel_level_warms_up_before_cupti_records(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up runs launch outside every timed wall; recorded, they failed the clock check."""
    import onnxruntime as ort

    from sidecar.profiling.runners import onnxruntime as ort_runner

    monkeypatch.setattr(ort_runner, "CuptiTracer", FakeTracer)
    runner = OnnxRuntimeRunner(cnn_onnx)
    runner.provider_names = ["CUDAExecutionProvider", "CPUExecutionProvider"]  # FAKE GPU
    monkeypatch.setattr(
        runner,
        "_make_session",
        lambda so: FakeGpuSession(
            ort.InferenceSession(str(cnn_onnx), so, providers=["CPUExecutionProvider"])
        ),
    )
    run = runner.run(cnn_inputs, Level.KERNEL, 3, 5)
    assert run.attributes["clock_check"] == "ok (3 GPU, 3 API records)"
    assert [sum(s.kind == "kernel" for s in it.spans) for it in run.iterations] == [1, 1, 1]


def test_an_onnxruntime_with_its_own_cuda_profiler_owns_cupti(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an ONNX Runtime built with CUDA profiling writes `Kernel` events, through its own
    CUPTI client; CuptiTracer must then refuse this process. The events are FAKED into a
    real profile (no such build here)."""
    import json

    import onnxruntime as ort

    from sidecar.profiling.gpu.owner import CUPTI_TRACER, CuptiOwner, CuptiOwnerError
    from sidecar.profiling.runners import onnxruntime as ort_runner

    owner = CuptiOwner()
    monkeypatch.setattr(ort_runner, "PROCESS_OWNER", owner)

    class WithKernelEvents:
        def __init__(self, session: ort.InferenceSession) -> None:
            self.session = session

        def end_profiling(self) -> str:
            path = Path(self.session.end_profiling())
            events = json.loads(path.read_text())
            events.append({"cat": "Kernel", "name": "gemm", "ts": 0, "dur": 1, "args": {}})
            path.write_text(json.dumps(events))
            return str(path)

        def __getattr__(self, name: str) -> object:
            return getattr(self.session, name)

    runner = OnnxRuntimeRunner(cnn_onnx)
    make = runner._make_session
    monkeypatch.setattr(runner, "_make_session", lambda so: WithKernelEvents(make(so)))
    runner.run(cnn_inputs, Level.LAYER, 2, 1)
    with pytest.raises(CuptiOwnerError, match="ONNX Runtime's CUDA profiler already used"):
        owner.check(CUPTI_TRACER)
