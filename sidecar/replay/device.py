"""Where a sampled request is replayed: `--replay-device auto|cpu|cuda|cuda:N`, per model.

`auto` (the default) replays on the GPU when the model's `config.pbtxt` asks Triton for one
(an `instance_group` of `kind: KIND_GPU`; its first `gpus` entry picks the device) and the
model's runtime sees a CUDA device in the worker process; otherwise on the CPU. Only an
explicit `KIND_GPU` counts: a config without `instance_group` (or with `KIND_AUTO`, which
Triton places on a GPU when it has one) replays on the CPU unless `--replay-device cuda[:N]`
says otherwise. An explicit `cuda[:N]` that the runtime cannot use fails every replay of the
model with `ReplayDeviceError` (a failed profile, stored and counted with its reason), never
the worker.

What "CUDA is visible" means depends on the runtime: `torch.cuda` for TorchScript, the
CUDA execution provider plus a device reported by the NVIDIA driver for ONNX Runtime;
TensorFlow SavedModels replay on the CPU only (`runners.select`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.profiling.devices import AUTO, CPU, device_name
from sidecar.profiling.formats import ModelFormat
from sidecar.profiling.vocabulary import ProfilingError

KIND_GPU = 1  # inference.ModelInstanceGroup.Kind.KIND_GPU
DRIVER_LIBRARIES = ("libcuda.so.1", "libcuda.so")


class ReplayDeviceError(ProfilingError):
    """The replay device asked for cannot be used in the profiling worker."""


@dataclass(frozen=True)
class DeviceChoice:
    """The device one replay runs on and why (stored with the trace)."""

    device: str  # "cpu" or "cuda:N"
    reason: str


@dataclass(frozen=True)
class CudaProbe:
    """How many CUDA devices a runtime can use here; `reason` says why none."""

    devices: int
    reason: str = ""


def gpu_request(config: Any) -> int | None:
    """The device index a Triton `ModelConfig` asks for with a `KIND_GPU` instance group
    (its first `gpus` entry, else 0), or None when no group asks for a GPU."""
    if config is None:
        return None
    for group in config.instance_group:
        if int(group.kind) == KIND_GPU:
            return int(group.gpus[0]) if len(group.gpus) else 0
    return None


def resolve(
    setting: str, fmt: ModelFormat, config: Any, probe: Callable[[ModelFormat], CudaProbe]
) -> DeviceChoice:
    """The device a model's replay runs on, for the `--replay-device` setting.

    `config` is the model's parsed `config.pbtxt` (None without one); `probe(fmt)` says how
    many CUDA devices the model's runtime can use (asked only when the answer matters)."""
    setting = device_name(setting, allow_auto=True)
    if setting == CPU:
        return DeviceChoice(CPU, "--replay-device cpu")
    if setting == AUTO:
        wanted = gpu_request(config)
        if wanted is None:
            return DeviceChoice(CPU, "auto: config.pbtxt asks for no KIND_GPU instance")
        found = probe(fmt)
        if found.devices == 0:
            return DeviceChoice(CPU, f"auto: config.pbtxt asks for KIND_GPU, but {found.reason}")
        if wanted < found.devices:
            return DeviceChoice(
                f"cuda:{wanted}", f"auto: config.pbtxt asks for KIND_GPU (gpu {wanted})"
            )
        return DeviceChoice(
            "cuda:0",
            f"auto: config.pbtxt asks for KIND_GPU on gpu {wanted}, but the profiling worker "
            f"sees {found.devices} CUDA device(s): cuda:0",
        )
    index = int(setting.split(":")[1])
    found = probe(fmt)
    if found.devices == 0:
        raise ReplayDeviceError(f"--replay-device {setting}: {found.reason}")
    if index >= found.devices:
        raise ReplayDeviceError(
            f"--replay-device {setting}: the profiling worker sees {found.devices} CUDA "
            f"device(s) (cuda:0..cuda:{found.devices - 1})"
        )
    return DeviceChoice(setting, f"--replay-device {setting}")


def _driver(load: Callable[[str], Any]) -> Any:
    """The NVIDIA driver library (libcuda), None when this container has none."""
    for name in DRIVER_LIBRARIES:
        try:
            return load(name)
        except OSError:
            continue
    return None


def driver_devices(load: Callable[[str], Any] = ctypes.CDLL) -> CudaProbe:
    """CUDA devices the NVIDIA driver shows this process (`cuInit` + `cuDeviceGetCount`,
    which honour `CUDA_VISIBLE_DEVICES`); creates no CUDA context."""
    driver = _driver(load)
    if driver is None:
        return CudaProbe(0, "no NVIDIA driver in this container (libcuda.so.1 not found)")
    status = driver.cuInit(0)
    if status != 0:
        return CudaProbe(0, f"the NVIDIA driver found no usable GPU (cuInit returned {status})")
    count = ctypes.c_int(0)
    status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != 0 or count.value == 0:
        return CudaProbe(0, "the NVIDIA driver shows this container no GPU")
    return CudaProbe(count.value)


def torch_devices() -> CudaProbe:
    """CUDA devices PyTorch can use in this process."""
    try:
        import torch
    except ImportError:
        return CudaProbe(0, "PyTorch is not installed in the sidecar")
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none"
        return CudaProbe(
            0,
            f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build: {build})",
        )
    return CudaProbe(int(torch.cuda.device_count()))


def onnxruntime_devices() -> CudaProbe:
    """CUDA devices ONNX Runtime can use here: its CUDA execution provider and the driver's."""
    import onnxruntime as ort

    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return CudaProbe(
            0, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers "
            f"{providers}); install onnxruntime-gpu",
        )  # fmt: skip
    return driver_devices()


def runtime_devices(fmt: ModelFormat) -> CudaProbe:
    """The probe the worker uses: what the runtime of a model format can use."""
    if fmt is ModelFormat.TORCHSCRIPT:
        return torch_devices()
    if fmt is ModelFormat.ONNX:
        return onnxruntime_devices()
    return CudaProbe(0, f"{fmt.value} models replay on the CPU only")


def driver_device_name(index: int, load: Callable[[str], Any] = ctypes.CDLL) -> str | None:
    """The name the NVIDIA driver gives CUDA device `index` (e.g. `NVIDIA H100 80GB HBM3`),
    None when it cannot tell."""
    driver = _driver(load)
    if driver is None:
        return None
    handle = ctypes.c_int(0)
    buffer = ctypes.create_string_buffer(256)
    if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(handle), index) != 0:
        return None
    if driver.cuDeviceGetName(buffer, len(buffer), handle) != 0:
        return None
    return buffer.value.decode(errors="replace")
