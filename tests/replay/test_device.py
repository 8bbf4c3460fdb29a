"""`--replay-device`: the device per model from config.pbtxt and what the worker's runtimes see.

The choice is a pure function of the setting, the parsed config and a probe; the probes for
"a GPU is visible" are fakes named as such (this machine has no GPU). The real probes are
run too: here they must say why no GPU can be used. The replay tests at the end use the
sample repository, real ONNX Runtime and real SQLite.
"""

from __future__ import annotations

import ctypes.util
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.backends.model_repository import read_config
from sidecar.profiling.formats import ModelFormat
from sidecar.replay.device import (
    CudaProbe,
    ReplayDeviceError,
    driver_device_name,
    driver_devices,
    gpu_request,
    resolve,
    runtime_devices,
    torch_devices,
)
from sidecar.replay.replay_job import replay_job
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.harness.triton.model_repo import build_model_repository
from tests.replay.test_replay_job import context, infer_request, job


def config(tmp_path: Path, instance_group: str) -> Any:
    path = tmp_path / "config.pbtxt"
    path.write_text(f'name: "m"\nbackend: "onnxruntime"\n{instance_group}\n')
    return read_config(path)


def fake_probe(devices: int) -> Any:
    """A fake of the worker's runtime probe: `devices` CUDA devices for every format."""
    return lambda fmt: CudaProbe(devices, "" if devices else "fake: no GPU")


ONNX = ModelFormat.ONNX


def test_auto_follows_a_kind_gpu_instance_group_when_a_gpu_is_visible(tmp_path: Path) -> None:
    gpu = config(tmp_path, "instance_group [ { kind: KIND_GPU count: 2 } ]")
    assert gpu_request(gpu) == 0
    choice = resolve("auto", ONNX, gpu, fake_probe(1))
    assert choice.device == "cuda:0" and "KIND_GPU" in choice.reason
    on_one = config(tmp_path, "instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU gpus: [1] } ]")
    assert gpu_request(on_one) == 1
    assert resolve("auto", ONNX, on_one, fake_probe(2)).device == "cuda:1"
    # the sidecar's container may see only the one GPU it was given: that one is device 0
    fallback = resolve("auto", ONNX, on_one, fake_probe(1))
    assert fallback.device == "cuda:0" and "sees 1 CUDA device(s)" in fallback.reason


def test_auto_is_the_cpu_without_kind_gpu_or_without_a_visible_gpu(tmp_path: Path) -> None:
    asked: list[ModelFormat] = []

    def counting_fake_probe(fmt: ModelFormat) -> CudaProbe:
        asked.append(fmt)
        return CudaProbe(1)

    for text in ("instance_group [ { kind: KIND_CPU count: 2 } ]", "", "max_batch_size: 8"):
        choice = resolve("auto", ONNX, config(tmp_path, text), counting_fake_probe)
        assert choice.device == "cpu" and "no KIND_GPU" in choice.reason
    assert resolve("auto", ONNX, None, counting_fake_probe).device == "cpu"  # no config.pbtxt
    assert asked == []  # nothing to probe when the model does not ask for a GPU
    gpu = config(tmp_path, "instance_group [ { kind: KIND_GPU } ]")
    choice = resolve("auto", ONNX, gpu, fake_probe(0))
    assert choice.device == "cpu"
    assert choice.reason == "auto: config.pbtxt asks for KIND_GPU, but fake: no GPU"


def test_an_explicit_device_is_used_or_fails_with_the_reason(tmp_path: Path) -> None:
    cpu_model = config(tmp_path, "instance_group [ { kind: KIND_CPU } ]")
    assert resolve("cuda", ONNX, cpu_model, fake_probe(1)).device == "cuda:0"
    assert resolve("CUDA:1", ONNX, None, fake_probe(2)).device == "cuda:1"
    gpu_model = config(tmp_path, "instance_group [ { kind: KIND_GPU } ]")
    assert resolve("cpu", ONNX, gpu_model, fake_probe(1)).device == "cpu"
    with pytest.raises(ReplayDeviceError, match=r"^--replay-device cuda:0: fake: no GPU$"):
        resolve("cuda:0", ONNX, cpu_model, fake_probe(0))
    with pytest.raises(ReplayDeviceError, match=r"sees 2 CUDA device\(s\) \(cuda:0..cuda:1\)"):
        resolve("cuda:2", ONNX, cpu_model, fake_probe(2))
    with pytest.raises(ValueError, match="use auto, cpu, cuda or cuda:N"):
        resolve("gpu", ONNX, cpu_model, fake_probe(1))


def test_the_real_probes_say_why_no_gpu_can_be_used_here() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    assert runtime_devices(ModelFormat.SAVEDMODEL) == CudaProbe(
        0, "savedmodel models replay on the CPU only"
    )
    probe = torch_devices()
    assert probe.devices == 0 and "torch.cuda.is_available() is False" in probe.reason
    onnx = runtime_devices(ModelFormat.ONNX)
    assert onnx.devices == 0
    assert "CUDAExecutionProvider" in onnx.reason or "NVIDIA driver" in onnx.reason
    if ctypes.util.find_library("cuda") is None:
        assert driver_devices() == CudaProbe(
            0, "no NVIDIA driver in this container (libcuda.so.1 not found)"
        )
        assert driver_device_name(0) is None


class FakeDriver:
    """A fake of libcuda's four entry points the probe calls, with `count` devices."""

    def __init__(self, count: int, init_status: int = 0) -> None:
        self.count, self.init_status = count, init_status

    def cuInit(self, flags: int) -> int:  # libcuda's names
        return self.init_status

    def cuDeviceGetCount(self, out: Any) -> int:
        out._obj.value = self.count
        return 0

    def cuDeviceGet(self, out: Any, index: int) -> int:
        out._obj.value = index
        return 0 if index < self.count else 101

    def cuDeviceGetName(self, buffer: Any, size: int, device: Any) -> int:
        buffer.value = b"NVIDIA H100 80GB HBM3"
        return 0


def test_the_driver_probe_counts_what_libcuda_reports_a_fake_driver() -> None:
    assert driver_devices(lambda name: FakeDriver(2)) == CudaProbe(2)
    assert driver_devices(lambda name: FakeDriver(0)).devices == 0
    no_gpu = driver_devices(lambda name: FakeDriver(1, init_status=100))
    assert no_gpu == CudaProbe(0, "the NVIDIA driver found no usable GPU (cuInit returned 100)")
    assert driver_device_name(0, lambda name: FakeDriver(1)) == "NVIDIA H100 80GB HBM3"
    assert driver_device_name(1, lambda name: FakeDriver(1)) is None


# -- the replay: where it ran is stored; a device that cannot be used fails that replay only


@pytest.fixture(scope="module")
def gpu_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample repository with `simple_cnn` asking Triton for a GPU."""
    repo = build_model_repository(tmp_path_factory.mktemp("gpu-repo") / "models")
    path = repo / "simple_cnn" / "config.pbtxt"
    path.write_text(path.read_text().replace("KIND_CPU", "KIND_GPU"))
    shutil.rmtree(repo / "sleep")
    return repo


def _simple_cnn_job() -> Any:
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    return job("simple_cnn", infer_request("simple_cnn", x))


def test_auto_replays_a_kind_gpu_model_on_the_cpu_without_cuda_and_says_why(
    gpu_repo: Path, tmp_path: Path
) -> None:
    ctx = context(gpu_repo, tmp_path / "t.db", cuda_probe=fake_probe(0))
    the_job = _simple_cnn_job()
    result = replay_job(the_job, ctx)
    assert result.outcome == "ok", result.error
    store = TraceStore(tmp_path / "t.db")
    trace = store.get_trace(the_job.trace_id)
    assert trace is not None
    assert trace.attributes["replay_device"] == "cpu"
    reason = "auto: config.pbtxt asks for KIND_GPU, but fake: no GPU"
    assert trace.attributes["replay_device_reason"] == reason
    [model] = store.spans(the_job.trace_id, Level.MODEL)
    assert model.attributes["device"] == "cpu" and model.attributes["device_reason"] == reason


def test_an_explicit_cuda_device_without_cuda_fails_each_replay_with_the_reason(
    gpu_repo: Path, tmp_path: Path
) -> None:
    ctx = context(gpu_repo, tmp_path / "t.db", device="cuda:0")  # the real probe
    the_job = _simple_cnn_job()
    first, second = replay_job(the_job, ctx), replay_job(_simple_cnn_job(), ctx)
    assert first.outcome == second.outcome == "error"
    assert first.error is not None and first.error.startswith(
        "ReplayDeviceError: --replay-device cuda:0: "
    )
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "error" and trace.error == first.error


def test_a_gpu_the_probe_sees_but_onnxruntime_cannot_use_fails_that_replay(
    gpu_repo: Path, tmp_path: Path
) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA execution provider")
    # the probe says a GPU is visible: the runner must refuse
    ctx = context(gpu_repo, tmp_path / "t.db", cuda_probe=fake_probe(1))
    the_job = _simple_cnn_job()
    result = replay_job(the_job, ctx)
    assert result.outcome == "error"
    assert result.error is not None and "--device cuda:0 needs onnxruntime-gpu" in result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.attributes["replay_device"] == "cuda:0"


def test_serve_warns_once_at_start_when_the_replay_gpu_is_not_visible(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from sidecar.serve import warn_if_no_replay_gpu

    assert warn_if_no_replay_gpu("auto") is None and warn_if_no_replay_gpu("cpu") is None
    one_gpu = lambda: CudaProbe(1)  # noqa: E731  a fake probe: one visible GPU
    assert warn_if_no_replay_gpu("cuda:0", one_gpu) is None
    message = warn_if_no_replay_gpu("cuda:1", one_gpu)
    assert message is not None and message.startswith(
        "--replay-device cuda:1: it sees 1 CUDA device(s); every replay will fail"
    )
    if driver_devices().devices:
        pytest.skip("this machine's driver shows a GPU")
    caplog.clear()
    message = warn_if_no_replay_gpu("cuda:0")  # the real driver probe
    assert message is not None and "sidecar.gpu.enabled" in message
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [message]
