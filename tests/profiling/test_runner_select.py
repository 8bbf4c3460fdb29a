"""One runner choice for `profile` (by extension) and replay (by the repository's format)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.profiling.formats import ModelFormat, UnsupportedFormatError, format_of
from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner
from sidecar.profiling.runners.pytorch import PyTorchRunner
from sidecar.profiling.runners.select import ort_providers, runner_for
from sidecar.profiling.vocabulary import ProfilingError


def test_the_extension_names_the_format(tmp_path: Path) -> None:
    saved = tmp_path / "exported"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"")
    assert format_of(Path("m.onnx")) is ModelFormat.ONNX
    assert format_of(Path("m.ONNX")) is ModelFormat.ONNX
    for name in ("m.pt", "m.pth", "m.torchscript", "m.ts"):
        assert format_of(Path(name)) is ModelFormat.TORCHSCRIPT, name
    assert format_of(Path("model.savedmodel")) is ModelFormat.SAVEDMODEL
    assert format_of(saved) is ModelFormat.SAVEDMODEL
    assert format_of(Path("m.txt")) is None and format_of(tmp_path) is None


def test_onnx_by_extension_or_by_format(cnn_onnx: Path, tmp_path: Path) -> None:
    runner = runner_for(cnn_onnx, threads=2, optimizations=False)
    assert isinstance(runner, OnnxRuntimeRunner)
    assert (runner.intra_op_threads, runner.optimizations) == (2, False)
    renamed = tmp_path / "model.bin"  # a repository's default_model_filename can be anything
    renamed.write_bytes(cnn_onnx.read_bytes())
    assert isinstance(runner_for(renamed, ModelFormat.ONNX), OnnxRuntimeRunner)


def test_cuda_n_is_the_cuda_execution_provider_on_gpu_n_with_the_cpu_behind_it() -> None:
    assert ort_providers("cuda:1") == [
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert ort_providers("CUDA") == ort_providers("cuda:0")
    assert ort_providers("cuda:0")[0] == ("CUDAExecutionProvider", {"device_id": 0})
    assert ort_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(ProfilingError, match="unknown device 'gpu'"):
        ort_providers("gpu")


def test_onnx_on_cuda_without_onnxruntime_gpu_says_what_to_install(cnn_onnx: Path) -> None:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        pytest.skip("this onnxruntime has the CUDA execution provider")
    with pytest.raises(ProfilingError) as info:
        runner_for(cnn_onnx, device="cuda:1")
    assert str(info.value) == (
        f"--device cuda:1 needs onnxruntime-gpu (installed onnxruntime {ort.__version__} "
        f"has providers {available})"
    )


def test_a_runner_on_the_cuda_provider_says_so(cnn_onnx: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu")
    runner = runner_for(cnn_onnx, device="cuda:0")
    assert isinstance(runner, OnnxRuntimeRunner)
    assert runner.device == "cuda:0" and runner.provider_names[0] == "CUDAExecutionProvider"


def test_torchscript_takes_the_model_name(cnn_torchscript: Path) -> None:
    runner = runner_for(cnn_torchscript, ModelFormat.TORCHSCRIPT, name="simple_cnn")
    assert isinstance(runner, PyTorchRunner) and runner.model_name == "simple_cnn"
    assert runner_for(cnn_torchscript).model_name == cnn_torchscript.stem  # type: ignore[attr-defined]


def test_unsupported_formats_say_what_is_supported(tmp_path: Path) -> None:
    saved = tmp_path / "model.savedmodel"
    saved.mkdir()
    with pytest.raises(ProfilingError, match=r"is not a SavedModel: no saved_model.pb"):
        runner_for(saved)
    text = tmp_path / "model.txt"
    text.write_text("not a model")
    with pytest.raises(
        UnsupportedFormatError, match=r"unknown model extension '\.txt'.*\.onnx"
    ) as info:
        runner_for(text)
    assert "SavedModel" in str(info.value) and "TorchScript" in str(info.value)
    with pytest.raises(ProfilingError, match="model file not found"):
        runner_for(tmp_path / "missing.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ProfilingError, match="is not an ONNX model"):
        runner_for(corrupt)
