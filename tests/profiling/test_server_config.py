"""A model's config.pbtxt applied to the replay: real config texts parsed with Triton's protobuf,
the real ONNX Runtime session the runner builds (its `get_session_options()`), a real
TorchScript model. This machine's onnxruntime has no OpenVINO, TensorRT or CUDA provider, so
the not-applied path of each accelerator runs for real and the applied path's mapping is
checked as the pure function it is (`provider_for`, `with_accelerators`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from sidecar.profiling.formats import ModelFormat
from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner
from sidecar.profiling.runners.pytorch import PyTorchRunner
from sidecar.profiling.runners.select import runner_for, with_accelerators
from sidecar.profiling.server_config import (
    OrtSettings,
    ReplaySettings,
    ServerConfigError,
    SettingRecord,
    config_beside,
    provider_for,
    read_config,
    replay_settings,
    server_summary,
    sweep_sizes,
)
from tests.harness.models import save_onnx, small_cnn_onnx, small_cnn_torchscript
from tests.harness.triton.model_repo import write_config

ONNX, TORCHSCRIPT = ModelFormat.ONNX, ModelFormat.TORCHSCRIPT

ORT_CONFIG = """\
name: "cnn"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "probs" data_type: TYPE_FP32 dims: [ 10 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
optimization { graph: { level: 1 } }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
parameters { key: "inter_op_thread_count" value: { string_value: "3" } }
parameters { key: "execution_mode" value: { string_value: "1" } }
parameters { key: "enable_mem_arena" value: { string_value: "0" } }
parameters { key: "enable_mem_pattern" value: { string_value: "0" } }
"""

MALFORMED_PARAMETERS = """\
name: "cnn"
backend: "onnxruntime"
parameters { key: "intra_op_thread_count" value: { string_value: "abc" } }
parameters { key: "execution_mode" value: { string_value: "7" } }
parameters { key: "enable_mem_arena" value: { string_value: "maybe" } }
parameters { key: "my_own_knob" value: { string_value: "42" } }
"""

ACCELERATORS = """\
name: "cnn"
backend: "onnxruntime"
instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]
optimization { execution_accelerators {
  cpu_execution_accelerator: [ { name: "openvino" } ]
  gpu_execution_accelerator: [
    { name: "tensorrt"
      parameters { key: "precision_mode" value: "FP16" }
      parameters { key: "max_workspace_size_bytes" value: "1073741824" } },
    { name: "cuda" parameters { key: "cudnn_conv_algo_search" value: "1" } },
    { name: "warp_drive" }
  ]
} }
"""

DYNAMIC_BATCHING = """\
name: "cnn"
backend: "onnxruntime"
max_batch_size: 16
dynamic_batching { preferred_batch_size: [ 4, 8, 4 ] max_queue_delay_microseconds: 100 }
instance_group [ { kind: KIND_CPU count: 2 }, { kind: KIND_CPU count: 1 } ]
"""


def config(tmp_path: Path, text: str) -> Any:
    return read_config(write_config(tmp_path, "cnn", text))


def records(settings: ReplaySettings) -> dict[str, SettingRecord]:
    return {r.setting: r for r in settings.records}


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_onnx(small_cnn_onnx(), tmp_path_factory.mktemp("m") / "model.onnx")


def session_options(path: Path, settings: ReplaySettings) -> ort.SessionOptions:
    runner = runner_for(path, ONNX, threads=1, settings=settings)
    assert isinstance(runner, OnnxRuntimeRunner)
    return runner.session.get_session_options()


def test_ort_parameters_reach_the_session_the_runner_builds(
    tmp_path: Path, onnx_path: Path
) -> None:
    settings = replay_settings(
        config(tmp_path, ORT_CONFIG), ONNX, device_reason="auto", worker_threads=1
    )
    so = session_options(onnx_path, settings)
    assert so.intra_op_num_threads == 2  # the config wins over the worker's one thread
    assert so.inter_op_num_threads == 3
    assert so.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert so.enable_cpu_mem_arena is False and so.enable_mem_pattern is False
    seen = records(settings)
    assert all(seen[f"parameters.{k}"].applied for k in ("inter_op_thread_count", "execution_mode"))
    assert seen["parameters.intra_op_thread_count"].reason == (
        "config.pbtxt wins over the worker's 1 thread(s)"
    )
    assert seen["optimization.graph.level"] == SettingRecord(
        "optimization.graph.level", "1", True, "extended"
    )
    assert seen["instance_group[0].kind"].applied  # KIND_CPU, replayed on the CPU
    assert "instance_group[0].count" not in seen  # in server_config: not a replay setting


def test_without_a_config_the_session_keeps_the_runner_defaults(onnx_path: Path) -> None:
    so = session_options(onnx_path, ReplaySettings())
    assert so.intra_op_num_threads == 1
    assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert so.enable_cpu_mem_arena is True


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("level: -1", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
        ("level: 1", ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        ("level: 2", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        ("level: 0", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
    ],
)
def test_graph_levels_follow_the_onnxruntime_backend(
    tmp_path: Path, onnx_path: Path, level: str, expected: Any
) -> None:
    text = f'name: "cnn"\nbackend: "onnxruntime"\noptimization {{ graph: {{ {level} }} }}\n'
    settings = replay_settings(config(tmp_path, text), ONNX)
    assert session_options(onnx_path, settings).graph_optimization_level == expected


def test_the_config_level_wins_over_no_optimizations(tmp_path: Path, onnx_path: Path) -> None:
    text = 'name: "cnn"\nbackend: "onnxruntime"\noptimization { graph: { level: -1 } }\n'
    settings = replay_settings(config(tmp_path, text), ONNX, optimizations=False)
    runner = runner_for(onnx_path, ONNX, optimizations=False, settings=settings)
    assert isinstance(runner, OnnxRuntimeRunner)
    so = runner.session.get_session_options()
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert (
        "config.pbtxt wins over --no-optimizations"
        in records(settings)["optimization.graph.level"].reason
    )


def test_malformed_and_unknown_parameters_are_recorded_never_raised(
    tmp_path: Path, onnx_path: Path
) -> None:
    settings = replay_settings(config(tmp_path, MALFORMED_PARAMETERS), ONNX)
    seen = records(settings)
    assert not any(r.applied for r in seen.values())
    assert seen["parameters.intra_op_thread_count"].reason == "not a count (0 or more)"
    assert seen["parameters.execution_mode"].value == "7"
    assert seen["parameters.enable_mem_arena"].reason == "expected 0 or 1"
    assert seen["parameters.my_own_knob"].reason == "unknown parameter"
    so = session_options(onnx_path, settings)  # the replay still runs, on the defaults
    assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert so.enable_cpu_mem_arena is True


def test_accelerators_are_not_applied_on_a_cpu_replay(tmp_path: Path) -> None:
    settings = replay_settings(
        config(tmp_path, ACCELERATORS),
        ONNX,
        device_reason="auto: no GPU",
        available_providers=ort.get_available_providers(),
    )
    seen = records(settings)
    openvino = seen["cpu_execution_accelerator.openvino"]
    assert not openvino.applied
    assert "OpenVINOExecutionProvider is not in this onnxruntime build" in openvino.reason
    trt = seen["gpu_execution_accelerator.tensorrt"]
    assert not trt.applied and trt.reason == "a GPU accelerator; the replay runs on cpu"
    assert trt.value == "max_workspace_size_bytes=1073741824,precision_mode=FP16"
    assert seen["gpu_execution_accelerator.warp_drive"].reason == "unknown accelerator"
    assert seen["instance_group[0].kind"] == SettingRecord(
        "instance_group[0].kind", "KIND_GPU", False, "auto: no GPU"
    )
    assert settings.ort.providers == ()


def test_gpu_accelerators_need_their_provider_in_the_build(tmp_path: Path) -> None:
    settings = replay_settings(
        config(tmp_path, ACCELERATORS),
        ONNX,
        device="cuda:1",  # the device a GPU machine would choose; this build has no CUDA EP
        available_providers=ort.get_available_providers(),
    )
    seen = records(settings)
    for name, provider in (("tensorrt", "Tensorrt"), ("cuda", "CUDA")):
        record = seen[f"gpu_execution_accelerator.{name}"]
        assert not record.applied
        assert record.reason.startswith(f"{provider}ExecutionProvider is not in this onnxruntime")
    assert seen["instance_group[0].gpus"] == SettingRecord("instance_group[0].gpus", "1", True, "")


def test_an_available_accelerator_becomes_a_provider_before_the_devices(tmp_path: Path) -> None:
    """The applied path: the providers a GPU build would list (given here as a list, since
    this build has none of them)."""
    gpu_build = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    settings = replay_settings(
        config(tmp_path, ACCELERATORS), ONNX, device="cuda:1", available_providers=gpu_build
    )
    assert records(settings)["gpu_execution_accelerator.tensorrt"].applied
    providers = with_accelerators(
        [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"], settings.ort
    )
    assert providers == [
        (
            "TensorrtExecutionProvider",
            {"device_id": "1", "trt_fp16_enable": "True", "trt_max_workspace_size": "1073741824"},
        ),
        ("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC", "device_id": 1}),
        "CPUExecutionProvider",
    ]


def test_provider_options_map_tritons_keys() -> None:
    provider, options, skipped = provider_for(
        "tensorrt",
        {"precision_mode": "INT8", "trt_engine_cache_enable": "1", "bogus": "x"},
        device_id=0,
    )
    assert provider == "TensorrtExecutionProvider"
    assert options == {"device_id": "0", "trt_int8_enable": "True", "trt_engine_cache_enable": "1"}
    assert skipped == [("bogus", "unknown parameter")]
    _, options, skipped = provider_for("cuda", {"arena_extend_strategy": "1", "gpu_mem_limit": "7"})
    assert options["arena_extend_strategy"] == "kSameAsRequested"
    assert options["gpu_mem_limit"] == "7" and not skipped
    _, _, skipped = provider_for("cuda", {"cudnn_conv_algo_search": "9"})
    assert skipped == [("cudnn_conv_algo_search", "expected one of 0, 1, 2")]


def test_dynamic_batching_gives_the_summary_and_the_default_sweep(tmp_path: Path) -> None:
    parsed = config(tmp_path, DYNAMIC_BATCHING)
    assert sweep_sizes(parsed) == [1, 4, 8, 16]
    assert server_summary(parsed) == {
        "backend": "onnxruntime",
        "platform": "",
        "instance_kind": "KIND_CPU",
        "instance_count": 3,
        "gpus": [],
        "accelerators": [],
        "max_batch_size": 16,
        "dynamic_batching": True,
        "preferred_batch_sizes": [4, 8, 4],
    }
    unbatched = config(tmp_path, 'name: "m"\nplatform: "onnxruntime_onnx"\n')
    assert sweep_sizes(unbatched) == []
    assert server_summary(unbatched)["backend"] == "onnxruntime_onnx"
    accelerated = server_summary(config(tmp_path, ACCELERATORS))
    assert accelerated["accelerators"] == ["openvino", "tensorrt", "cuda", "warp_drive"]
    assert (accelerated["instance_kind"], accelerated["gpus"]) == ("KIND_GPU", [1])


def test_a_config_that_does_not_parse_is_a_clear_error(tmp_path: Path) -> None:
    text = 'name: "cnn"\nbackend: "onnxruntime"\nparameters { key: "x" value: 3 }\n'
    path = write_config(tmp_path, "cnn", text)
    with pytest.raises(ServerConfigError, match=r"config\.pbtxt is not a valid Triton model"):
        read_config(path)
    with pytest.raises(ServerConfigError, match="cannot read"):
        read_config(tmp_path / "missing" / "config.pbtxt")


def test_a_python_backend_s_settings_are_recorded_not_applied(tmp_path: Path) -> None:
    text = (
        'name: "m"\nbackend: "python"\n'
        'parameters { key: "intra_op_thread_count" value: { string_value: "4" } }\n'
        "optimization { graph: { level: 2 } execution_accelerators {\n"
        '  cpu_execution_accelerator: [ { name: "openvino" } ] } }\n'
    )
    settings = replay_settings(config(tmp_path, text), ONNX)
    seen = records(settings)
    assert {"parameters.intra_op_thread_count", "optimization.graph.level"} < set(seen)
    assert not any(r.applied for r in seen.values())
    assert "python backend" in seen["parameters.intra_op_thread_count"].reason
    assert seen["cpu_execution_accelerator.openvino"].reason == (
        "not a setting the onnx replay applies (backend python)"
    )
    assert settings.ort == OrtSettings()


def test_config_beside_finds_the_repository_layout(tmp_path: Path, onnx_path: Path) -> None:
    version = tmp_path / "cnn" / "1"
    version.mkdir(parents=True)
    model = version / "model.onnx"
    model.write_bytes(onnx_path.read_bytes())
    assert config_beside(model) is None
    written = write_config(tmp_path, "cnn", 'name: "cnn"\n')
    assert config_beside(model) == written == tmp_path / "cnn" / "config.pbtxt"


TORCH_CONFIG = """\
name: "cnn"
backend: "pytorch"
parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }
parameters { key: "ENABLE_JIT_EXECUTOR" value: { string_value: "false" } }
parameters { key: "ENABLE_JIT_PROFILING" value: { string_value: "false" } }
parameters { key: "ENABLE_NVFUSER" value: { string_value: "true" } }
parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "false" } }
parameters { key: "ENABLE_CACHE_CLEANING" value: { string_value: "true" } }
parameters { key: "SOMETHING_ELSE" value: { string_value: "true" } }
"""


def test_pytorch_parameters_set_the_mode_and_the_jit_flags_for_the_run(tmp_path: Path) -> None:
    import torch

    settings = replay_settings(config(tmp_path, TORCH_CONFIG), TORCHSCRIPT)
    seen = records(settings)
    assert all(
        seen[f"parameters.{k}"].applied
        for k in ("INFERENCE_MODE", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING")
    )
    assert seen["parameters.ENABLE_NVFUSER"].reason == (
        "nvFuser fuses CUDA kernels; the replay runs on cpu"
    )
    assert not seen["parameters.DISABLE_OPTIMIZED_EXECUTION"].applied
    assert seen["parameters.SOMETHING_ELSE"].reason == "unknown parameter"
    assert not seen["parameters.ENABLE_CACHE_CLEANING"].applied

    runner = runner_for(small_cnn_torchscript(tmp_path / "model.pt"), settings=settings)
    assert isinstance(runner, PyTorchRunner)

    def executor() -> bool:  # the setter returns the old value: set it back at once
        old = torch._C._jit_set_profiling_executor(True)
        torch._C._jit_set_profiling_executor(old)
        return bool(old)

    before = executor()
    with runner._context():
        assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
        assert executor() is False
    assert executor() is before  # restored: the worker's other models are not affected
    default = runner_for(tmp_path / "model.pt")
    assert isinstance(default, PyTorchRunner)
    with default._context():
        assert torch.is_inference_mode_enabled()
