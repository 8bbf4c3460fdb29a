"""Which runner profiles a model file: the one place that maps model formats to runtimes.

`runner_for(path)` infers the format from the file's extension (`formats.format_of`, as
`xsp-sidecar profile` does); replay passes the format it resolved from the model repository.
Runtimes are imported on first use: importing this module loads no ONNX Runtime, PyTorch or
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from sidecar.profiling.devices import cuda_index
from sidecar.profiling.formats import SUPPORTED, ModelFormat, UnsupportedFormatError, format_of
from sidecar.profiling.server_config import OrtSettings, ReplaySettings, TorchSettings
from sidecar.profiling.vocabulary import ModelLookup, ProfilingError, Runner

log = logging.getLogger(__name__)
CONFIG_FILE = "config.pbtxt"  # a Triton model's configuration, beside its version folders


def runner_for(
    path: Path | str,
    format: ModelFormat | None = None,
    *,
    device: str = "cpu",
    optimizations: bool = True,
    threads: int | None = None,
    name: str | None = None,
    ncu_metrics: bool = False,
    settings: ReplaySettings | None = None,
    find: ModelLookup | None = None,
) -> Runner:
    """A loaded runner for the model at `path`.

    `format` defaults to what the extension says; `threads` caps the runtime's intra-op
    threads (None: the runtime's default; TensorFlow: intra- and inter-op, settable only
    before TensorFlow first runs in the process); `name` is the model's name in PyTorch
    and TensorFlow traces; `ncu_metrics` adds Nsight Compute's metrics run after K (PyTorch
    on CUDA only); `settings` are what the model's `config.pbtxt` asks of the runtime
    (`server_config.replay_settings`), which win over `optimizations` and `threads`;
    `find` is the model repository's lookup, which a Triton Python-backend model (its BLS
    callees) and an ensemble (its steps) need (`vocabulary.ModelLookup`).
    """
    path = Path(path)
    if not path.exists():
        raise ProfilingError(f"model file not found: {path}")
    fmt = format or format_of(path)
    if ncu_metrics and (fmt is not ModelFormat.TORCHSCRIPT or device == "cpu"):
        raise ProfilingError(
            "the Nsight Compute metrics level (--ncu-metrics) is supported for PyTorch models "
            "on a CUDA device only"
        )
    if fmt is None:
        raise UnsupportedFormatError(
            f"unknown model extension {path.suffix!r} for {path}: use .onnx (ONNX Runtime), "
            ".pt / .pth (TorchScript), a SavedModel folder (TensorFlow) or a Triton "
            "Python-backend model.py"
        )
    if fmt is ModelFormat.ONNX:
        ort_settings = settings.ort if settings is not None else OrtSettings()
        return _onnx_runner(path, device, optimizations, threads, ort_settings)
    if fmt is ModelFormat.TORCHSCRIPT:
        torch_settings = settings.torch if settings is not None else TorchSettings()
        return _torchscript_runner(
            path, device, optimizations, threads, name, ncu_metrics, torch_settings
        )
    if fmt is ModelFormat.SAVEDMODEL:
        return _savedmodel_runner(path, device, optimizations, threads, name)
    if fmt is ModelFormat.PYTHON:
        return _python_runner(path, device, _needs(find, path))
    if fmt is ModelFormat.ENSEMBLE:
        return _ensemble_runner(path, device, optimizations, threads, _needs(find, path))
    raise UnsupportedFormatError(
        f"profiling {fmt.value} models is not supported (supported: {SUPPORTED})"
    )


def ort_providers(device: str) -> list[str | tuple[str, dict[str, Any]]]:
    """ONNX Runtime's execution providers for a device: the CPU alone, or the CUDA provider on
    device N with the CPU provider for the nodes CUDA does not implement."""
    try:
        index = cuda_index(device)
    except ValueError as exc:
        raise ProfilingError(str(exc)) from None
    if index is None:
        return ["CPUExecutionProvider"]
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def with_accelerators(
    providers: list[str | tuple[str, dict[str, Any]]], settings: OrtSettings
) -> list[str | tuple[str, dict[str, Any]]]:
    """The device's providers with the config's accelerators first (TensorRT before CUDA
    before the CPU); a `cuda` accelerator's options go into the device's CUDA provider."""
    extra = {name: dict(options) for name, options in settings.providers}
    out: list[str | tuple[str, dict[str, Any]]] = []
    for name, options in extra.items():
        if name != "CUDAExecutionProvider":
            out.append((name, options))
    for provider in providers:
        name = provider if isinstance(provider, str) else provider[0]
        if name == "CUDAExecutionProvider" and name in extra:
            base = provider[1] if isinstance(provider, tuple) else {}
            out.append((name, {**extra[name], **base}))
        else:
            out.append(provider)
    return out


def _onnx_runner(
    path: Path, device: str, optimizations: bool, threads: int | None, settings: OrtSettings
) -> Runner:
    import onnxruntime as ort
    from google.protobuf.message import DecodeError

    from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner

    device_providers = ort_providers(device)
    available = ort.get_available_providers()
    if len(device_providers) > 1 and "CUDAExecutionProvider" not in available:
        raise ProfilingError(
            f"--device {device} needs onnxruntime-gpu (installed onnxruntime "
            f"{ort.__version__} has providers {available})"
        )
    providers = with_accelerators(device_providers, settings)
    try:
        return OnnxRuntimeRunner(
            path,
            optimizations=optimizations,
            providers=providers,
            intra_op_threads=threads or 0,
            settings=settings,
        )
    except DecodeError:
        raise ProfilingError(
            f"{path} is not an ONNX model (its bytes do not parse as an ONNX protobuf)"
        ) from None


def _torchscript_runner(
    path: Path,
    device: str,
    optimizations: bool,
    threads: int | None,
    name: str | None,
    ncu_metrics: bool = False,
    settings: TorchSettings | None = None,
) -> Runner:
    from sidecar.profiling.runners.pytorch import PyTorchRunner

    if not optimizations:
        log.info("--no-optimizations has no effect on TorchScript models")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return PyTorchRunner(path, device=device, name=name, ncu_metrics=ncu_metrics, settings=settings)


def _needs(find: ModelLookup | None, path: Path) -> ModelLookup:
    if find is None:
        raise ProfilingError(
            f"{path}: a Python-backend model or an ensemble is replayed from its model "
            "repository, and no repository lookup was given (runner_for's `find`)"
        )
    return find


def _python_runner(path: Path, device: str, find: ModelLookup) -> Runner:
    """A Python-backend model's `model.py`, found in its repository as Triton lays it out
    (`<repo>/<model>/<version>/model.py`, beside `<repo>/<model>/config.pbtxt`). Asked for by
    its path, the model.py runs even where the repository lookup prefers a model file beside it."""
    from sidecar.profiling.runners.python_model import PythonModelRunner

    if device != "cpu":
        raise ProfilingError(
            f"--device {device}: Python-backend models are replayed on the CPU only"
        )
    version_dir = path.resolve().parent
    if not version_dir.name.isdigit():
        raise ProfilingError(
            f"{path} is not in a Triton model repository (<repo>/<model>/<version>/model.py)"
        )
    try:
        location = find(version_dir.parent.parent, version_dir.parent.name, version_dir.name)
    except LookupError as exc:  # the lookup's errors (the model, its config, its version)
        raise ProfilingError(str(exc)) from None
    if location.format is not ModelFormat.PYTHON:  # e.g. a model.py beside its model.onnx
        location = dataclasses.replace(location, path=path, format=ModelFormat.PYTHON)
    return PythonModelRunner(location, find)


def _ensemble_runner(
    path: Path, device: str, optimizations: bool, threads: int | None, find: ModelLookup
) -> Runner:
    """A Triton ensemble, found by its `config.pbtxt` (or its folder) in the repository; each
    step's runner is loaded here as the step's model alone would be."""
    from sidecar.profiling.runners.ensemble import EnsembleRunner

    model_dir = path.resolve().parent if path.name == CONFIG_FILE else path.resolve()
    try:
        location = find(model_dir.parent, model_dir.name, None)
    except LookupError as exc:
        raise ProfilingError(str(exc)) from None
    if location.format is not ModelFormat.ENSEMBLE:
        raise ProfilingError(f'{path} is not a Triton ensemble (platform: "ensemble")')

    def step_runner(step: Any) -> Runner:
        return runner_for(
            step.path,
            step.format,
            device=device,
            optimizations=optimizations,
            threads=threads,
            name=step.name,
            find=find,
        )

    return EnsembleRunner(location, step_runner, find)


def _savedmodel_runner(
    path: Path, device: str, optimizations: bool, threads: int | None, name: str | None
) -> Runner:
    from sidecar.profiling.runners.tensorflow import TensorFlowRunner

    if device != "cpu":
        raise ProfilingError(
            f"--device {device} is not supported for SavedModels yet: TensorFlow's GPU kernels "
            "would have to come from its own profiler (a CUPTI client), which is not wired up; "
            "profile on the CPU (--device cpu)"
        )
    if not optimizations:
        log.info("--no-optimizations has no effect on SavedModels (grappler stays on)")
    return TensorFlowRunner(path, threads=threads, name=name)
