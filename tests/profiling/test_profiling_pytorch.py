"""Leveled profiles of the small CNN with real PyTorch (CPU): nn.Module and TorchScript."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling import testmodels
from sidecar.profiling.experiment import ProfileResult, run_experiment
from sidecar.profiling.runners.base import ProfilingError
from sidecar.profiling.runners.pytorch import PyTorchRunner
from sidecar.trace.spans import Level

MODULES = ["conv1", "relu1", "pool", "conv2", "relu2", "gap", "flatten", "fc", "softmax"]
CLASSES = [
    "Conv2d",
    "ReLU",
    "MaxPool2d",
    "Conv2d",
    "ReLU",
    "AdaptiveAvgPool2d",
    "Flatten",
    "Linear",
    "Softmax",
]


def check_tree(res: ProfileResult) -> None:
    (model,) = res.spans_at(Level.MODEL)
    layers = sorted(res.spans_at(Level.LAYER), key=lambda s: s.start_ns)
    assert [s.name for s in layers] == MODULES
    assert [s.kind for s in layers] == CLASSES
    by_id = {s.span_id: s for s in res.spans}
    for layer in layers:
        assert layer.parent_id == model.span_id
    kernels = res.spans_at(Level.KERNEL)
    assert kernels and all(k.kind == "cpu_op" for k in kernels)
    placed = [k for k in kernels if k.parent_id is not None]
    assert len(placed) >= len(kernels) * 0.8
    for k in placed:
        parent = by_id[str(k.parent_id)]
        assert parent.level is Level.LAYER
        assert parent.start_ns <= k.start_ns and k.end_ns <= parent.end_ns
    under: dict[str, list[str]] = {}
    for k in placed:
        under.setdefault(by_id[str(k.parent_id)].name, []).append(k.name)
    assert under["relu1"] == ["aten::relu"]
    assert "aten::conv2d" in under["conv1"] or "aten::_convolution" in under["conv1"]
    assert "aten::linear" in under["fc"]
    conv_ops = [k for k in placed if by_id[str(k.parent_id)].name == "conv1"]
    assert any(k.attributes["dominant_op"] == "aten::mkldnn_convolution" for k in conv_ops)
    assert layers[0].attributes.get("allocated_bytes", 0) >= 2 * 8 * 32 * 32 * 4
    for level in (Level.MODEL, Level.LAYER, Level.KERNEL):
        assert res.stats(level).overhead_ratio > 0
    assert res.trace.attributes["kernel_level"] == "captured"


def test_nn_module_profile(cnn_inputs: dict[str, np.ndarray]) -> None:
    runner = PyTorchRunner(testmodels.small_cnn_torch(), name="small_cnn")
    res = run_experiment(runner, cnn_inputs, model="small_cnn", iterations=5, warmup=2)
    check_tree(res)
    conv1 = next(s for s in res.spans_at(Level.LAYER) if s.name == "conv1")
    assert conv1.attributes["input_shapes"] == [[2, 3, 32, 32], [8, 3, 3, 3], [8]]
    assert conv1.attributes["output_shapes"] == [[2, 8, 32, 32]]
    assert conv1.attributes["flops"] == 2 * 2 * 8 * 32 * 32 * 27 + 2 * 8 * 32 * 32


def test_torchscript_profile(cnn_torchscript: Path, cnn_inputs: dict[str, np.ndarray]) -> None:
    runner = PyTorchRunner(cnn_torchscript)
    res = run_experiment(runner, cnn_inputs, model="small_cnn", iterations=5, warmup=2)
    check_tree(res)
    assert res.trace.attributes["torchscript_optimized_execution"] is False


def test_layer_level_durations_come_from_the_layer_run(cnn_inputs: dict[str, np.ndarray]) -> None:
    runner = PyTorchRunner(testmodels.small_cnn_torch())
    res = run_experiment(runner, cnn_inputs, model="cnn", iterations=5, warmup=1)
    layer_run = res.runs[Level.LAYER]
    conv1 = [s.duration_ns for it in layer_run.iterations for s in it.spans if s.key == "conv1"]
    span = next(s for s in res.spans_at(Level.LAYER) if s.name == "conv1")
    ordered = sorted(conv1)[1:-1]  # 5 samples, 20% trimmed
    assert span.duration_ns == round(sum(ordered) / len(ordered))
    assert span.run_level is Level.KERNEL  # the timeline is the deepest run's


def test_cuda_device_is_not_supported_yet() -> None:
    with pytest.raises(ProfilingError, match="not supported"):
        PyTorchRunner(testmodels.small_cnn_torch(), device="cuda")
