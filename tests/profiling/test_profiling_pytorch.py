"""Leveled profiles of the small CNN with real PyTorch (CPU): nn.Module and TorchScript."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling.experiment import LeveledProfile, run_experiment
from sidecar.profiling.runners.pytorch import PyTorchRunner
from sidecar.profiling.vocabulary import LevelNotSupportedError, ProfilingError
from sidecar.trace.spans import Level
from tests.harness import models

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


def check_tree(res: LeveledProfile) -> None:
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
    runner = PyTorchRunner(models.small_cnn_torch(), name="small_cnn")
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
    runner = PyTorchRunner(models.small_cnn_torch())
    res = run_experiment(runner, cnn_inputs, model="cnn", iterations=5, warmup=1)
    layer_run = res.runs[Level.LAYER]
    conv1 = [s.duration_ns for it in layer_run.iterations for s in it.spans if s.key == "conv1"]
    span = next(s for s in res.spans_at(Level.LAYER) if s.name == "conv1")
    ordered = sorted(conv1)[1:-1]  # 5 samples, 20% trimmed
    assert span.duration_ns == round(sum(ordered) / len(ordered))
    assert span.run_level is Level.KERNEL  # the timeline is the deepest run's


CUDA = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU exists")
def test_cuda_without_a_gpu_gives_clear_error() -> None:
    with pytest.raises(LevelNotSupportedError, match=r"cuda:1 needs a CUDA GPU"):
        PyTorchRunner(models.small_cnn_torch(), device="cuda:1")


def test_unknown_device_is_rejected() -> None:
    with pytest.raises(ProfilingError, match="unknown device 'tpu'"):
        PyTorchRunner(models.small_cnn_torch(), device="tpu")


def test_hooks_on_every_module_nest_and_give_one_span_per_call() -> None:
    """The CUDA layer level's hooks, run on the CPU without events: containers get spans,
    children name their parent, and a module called twice gives two spans."""
    import torch
    from torch import nn

    from sidecar.profiling.gpu.layers import call_spans
    from sidecar.profiling.runners.pytorch_cuda import ModuleHooks

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.relu = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.relu(self.relu(self.conv(x)) + x)  # relu called twice

    model = nn.Sequential(Block(), nn.Sequential(Block())).eval()
    with torch.inference_mode(), ModuleHooks(model, events=False) as hooks:
        model(torch.zeros(1, 4, 8, 8))
    spans = call_spans(hooks.calls, offset_ns=0)
    names = [s.name for s in spans]
    assert names == ["0", "0.conv", "0.relu", "0.relu#1", "1", "1.0", "1.0.conv", "1.0.relu",
                     "1.0.relu#1"]  # fmt: skip
    by = {s.name: s for s in spans}
    assert by["0.relu#1"].attributes["parent_layer"] == "0"
    assert by["1.0.conv"].attributes["parent_layer"] == "1.0"
    assert by["1.0"].attributes["parent_layer"] == "1"
    assert not by["1"].attributes["leaf"] and by["1.0.relu"].attributes["leaf"]
    for s in spans:  # a parent's host interval contains its children's
        parent = s.attributes["parent_layer"]
        if parent:
            assert by[parent].start_ns <= s.start_ns and s.end_ns <= by[parent].end_ns
        assert s.attributes["time_base"] == "host"


def test_cpu_kernel_level_claims_cupti_only_with_cuda() -> None:
    """torch.profiler is CUPTI's client only on a CUDA build: the CPU K level must not lock
    out CuptiTracer on a machine without CUDA."""
    import torch

    from sidecar.profiling.gpu.owner import PROCESS_OWNER

    runner = PyTorchRunner(models.small_cnn_torch())
    x = {"input": np.zeros((1, 3, 32, 32), dtype=np.float32)}
    runner.run(x, Level.KERNEL, iterations=1, warmup=0)
    if torch.cuda.is_available():
        assert PROCESS_OWNER.owner == "torch.profiler"
    else:
        assert PROCESS_OWNER.owner is None


@CUDA
def test_cuda_levels_on_a_gpu() -> None:  # pragma: no cover - GPU only
    """Runs on a GPU: M with CUDA-event time, nested L on the GPU timeline, K with CUPTI
    (skipped in a process where torch.profiler already used CUPTI)."""
    from sidecar.profiling.gpu.owner import PROCESS_OWNER

    if PROCESS_OWNER.owner not in (None, "CuptiTracer"):
        pytest.skip("torch.profiler already used CUPTI in this process")
    runner = PyTorchRunner(models.small_cnn_torch(), device="cuda")
    x = {"input": np.zeros((8, 3, 32, 32), dtype=np.float32)}
    res = run_experiment(runner, x, model="cnn", iterations=5, warmup=2)
    (model,) = res.spans_at(Level.MODEL)
    assert res.runs[Level.MODEL].iterations[0].spans[0].attributes["gpu_time_ns"] > 0
    assert res.trace.attributes["layer_time_base"] == "gpu_events"
    kernels = [s for s in res.spans_at(Level.KERNEL) if s.kind == "kernel"]
    assert kernels and all(k.parent_id for k in kernels)
    assert res.trace.attributes["clock_check"].startswith("ok")
    assert model.span_id


@pytest.mark.parametrize("levels", [(Level.MODEL, Level.LAYER), (Level.MODEL, Level.KERNEL)])
def test_each_call_of_a_module_records_its_own_shapes(levels: tuple[Level, ...]) -> None:
    """A module called on two shapes: each call's span carries its own shapes and FLOPs, in
    the hooked L run and in the profiled K run."""
    import torch
    from torch import nn

    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.relu = nn.ReLU()
            self.pool = nn.MaxPool2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.relu(self.pool(self.relu(x)))

    inputs = {"x": np.random.default_rng(0).random((2, 4, 8, 8), dtype=np.float32)}
    runner = PyTorchRunner(Repeated().eval(), name="repeated")
    res = run_experiment(runner, inputs, model="repeated", levels=levels, iterations=3, warmup=1)
    layers = sorted(res.spans_at(Level.LAYER), key=lambda s: s.start_ns)
    assert [s.name for s in layers] == ["relu", "pool", "relu"]
    first, _, second = layers
    assert first.attributes["input_shapes"] == [[2, 4, 8, 8]]
    assert second.attributes["input_shapes"] == [[2, 4, 4, 4]]
    assert first.attributes["flops"] == 4 * second.attributes["flops"] == 2 * 4 * 8 * 8
