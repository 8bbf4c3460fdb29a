"""CUPTI record -> span conversion and XSP correlation.

No GPU exists here, so the records are FAKES: `FakeCuptiRecord` objects shaped like
cupti-python's activity records (ActivityKernel9, ActivityMemcpy5, ActivityAPI fields).
"""

from __future__ import annotations

import ctypes.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.profiling.containment import assign_parents
from sidecar.profiling.gpu import cupti_tracer as ct
from sidecar.profiling.gpu.attribution import attach_gpu_activity
from sidecar.trace.spans import Level, Source, Span

T0 = 1_000_000  # CUPTI clock ns
OFFSET = 1_700_000_000_000_000_000  # CUPTI ns -> epoch ns


@dataclass
class FakeCuptiRecord:
    """FAKE stand-in for a CUPTI activity record (same field names as cupti-python)."""

    kind: int
    start: int
    end: int
    correlation_id: int
    name: str = ""
    device_id: int = 0
    stream_id: int = 7
    grid_x: int = 0
    grid_y: int = 0
    grid_z: int = 0
    block_x: int = 0
    block_y: int = 0
    block_z: int = 0
    bytes: int = 0
    copy_kind: int = 0
    cbid: int = 0


def fake_stream() -> list[FakeCuptiRecord]:
    """Layer A launches a memcpy and a kernel, layer B one kernel; the GPU runs them later."""
    return [
        FakeCuptiRecord(ct.KIND_RUNTIME, T0 + 100, T0 + 150, 11, name="cudaMemcpyAsync", cbid=41),
        FakeCuptiRecord(ct.KIND_RUNTIME, T0 + 200, T0 + 260, 12, name="cudaLaunchKernel", cbid=211),
        FakeCuptiRecord(ct.KIND_DRIVER, T0 + 210, T0 + 250, 12, name="cuLaunchKernel"),
        FakeCuptiRecord(ct.KIND_RUNTIME, T0 + 1100, T0 + 1150, 13, name="cudaLaunchKernel"),
        FakeCuptiRecord(ct.KIND_MEMCPY, T0 + 300, T0 + 900, 11, bytes=4096, copy_kind=1),
        FakeCuptiRecord(
            ct.KIND_CONCURRENT_KERNEL,
            T0 + 950,
            T0 + 1900,
            12,
            name="volta_sgemm_128x64_nn",
            grid_x=80,
            grid_y=2,
            grid_z=1,
            block_x=256,
            block_y=1,
            block_z=1,
        ),
        FakeCuptiRecord(
            ct.KIND_CONCURRENT_KERNEL,
            T0 + 2000,
            T0 + 2600,
            13,
            name="relu_kernel",
            grid_x=40,
            block_x=128,
        ),
        FakeCuptiRecord(ct.KIND_CONCURRENT_KERNEL, T0 + 2700, T0 + 2800, 99, name="orphan"),
        FakeCuptiRecord(42, T0, T0 + 1, 0),  # an activity kind we do not trace
    ]


def test_records_become_kernel_spans() -> None:
    raws = ct.records_to_spans(fake_stream(), OFFSET)
    assert len(raws) == 8  # unknown kind skipped
    assert all(r.level is Level.KERNEL for r in raws)
    kernel = next(r for r in raws if r.name == "volta_sgemm_128x64_nn")
    assert kernel.kind == "kernel"
    assert kernel.start_ns == OFFSET + T0 + 950 and kernel.duration_ns == 950
    assert kernel.attributes["grid"] == [80, 2, 1] and kernel.attributes["block"] == [256, 1, 1]
    assert kernel.attributes["stream"] == 7 and kernel.attributes["correlation_id"] == 12
    memcpy = next(r for r in raws if r.kind == "memcpy")
    assert memcpy.name == "memcpy HtoD" and memcpy.attributes["bytes"] == 4096
    assert {r.kind for r in raws} == {"runtime", "driver", "memcpy", "kernel"}


def test_kernels_join_their_launch_and_its_layer() -> None:
    trace = "t" * 32
    model = Span(
        trace, "m", None, Level.MODEL, "model", "model", OFFSET, OFFSET + T0 + 5000, Source.REPLAY
    )
    layer_a = Span(
        trace,
        "A",
        None,
        Level.LAYER,
        "fc",
        "Gemm",
        OFFSET + T0 + 50,
        OFFSET + T0 + 300,
        Source.REPLAY,
    )
    layer_b = Span(
        trace,
        "B",
        None,
        Level.LAYER,
        "relu",
        "Relu",
        OFFSET + T0 + 1000,
        OFFSET + T0 + 1200,
        Source.REPLAY,
    )
    spans = [model, layer_a, layer_b]
    for i, raw in enumerate(ct.records_to_spans(fake_stream(), OFFSET)):
        spans.append(
            Span(
                trace,
                f"k{i}",
                None,
                raw.level,
                raw.name,
                raw.kind,
                raw.start_ns,
                raw.end_ns,
                Source.REPLAY,
                attributes=raw.attributes,
            )
        )
    assign_parents(spans)  # API calls by containment; GPU activity is skipped here
    attach_gpu_activity(spans)
    by_name = {s.name: s for s in spans}
    assert by_name["cudaMemcpyAsync"].parent_id == "A"
    assert by_name["cuLaunchKernel"].parent_id == "A"
    # the sgemm ran after layer A ended (asynchronous) but belongs to it via its launch
    sgemm = by_name["volta_sgemm_128x64_nn"]
    assert sgemm.start_ns > layer_a.end_ns and sgemm.parent_id == "A"
    assert sgemm.attributes["launch_name"] == "cudaLaunchKernel"  # the outer runtime call
    assert by_name["memcpy HtoD"].parent_id == "A"
    assert by_name["relu_kernel"].parent_id == "B"
    assert by_name["orphan"].parent_id is None
    assert by_name["orphan"].attributes["parent_missing"] is True


def test_split_records_groups_by_iteration() -> None:
    tracer = ct.CuptiTracer()
    tracer.offset_ns = OFFSET
    walls = [(OFFSET + T0, OFFSET + T0 + 1000), (OFFSET + T0 + 1000, OFFSET + T0 + 3000)]
    first, second = ct.split_records(fake_stream(), walls, tracer)
    assert {s.name for s in first} == {
        "cudaMemcpyAsync",
        "cudaLaunchKernel",
        "cuLaunchKernel",
        "memcpy HtoD",
        "volta_sgemm_128x64_nn",
    }
    assert {s.name for s in second} == {"cudaLaunchKernel", "relu_kernel"}
    assert next(s for s in second if s.name == "cudaLaunchKernel").key == "runtime:cudaLaunchKernel"


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver exists")
def test_tracer_without_driver_gives_clear_error() -> None:
    from sidecar.profiling.gpu.owner import CuptiOwner

    owner = CuptiOwner()
    with pytest.raises(ct.GpuNotAvailableError, match="needs an NVIDIA GPU and driver"):
        ct.CuptiTracer(owner=owner).start()
    assert owner.owner is None  # a tracer that never recorded does not lock out torch.profiler


def test_dict_records_and_api_names_without_a_driver() -> None:
    """Recordings store records as dicts; API names come from cupti-python's cbid tables."""
    records = [
        {"kind": ct.KIND_RUNTIME, "start": T0, "end": T0 + 10, "correlation_id": 5, "cbid": 211},
        {"kind": ct.KIND_RUNTIME, "start": T0 + 20, "end": T0 + 30, "correlation_id": 6,
         "cbid": 17},
        {"kind": ct.KIND_CONCURRENT_KERNEL, "start": T0 + 40, "end": T0 + 90,
         "correlation_id": 5, "name": "k", "graph_id": 3, "graph_node_id": 9},
    ]  # fmt: skip
    kept = ct.launch_records_only(records)
    assert [r["correlation_id"] for r in kept] == [5, 5]  # cbid 17 launched nothing
    launch, kernel = ct.records_to_spans(kept, OFFSET)
    assert launch.name == "cudaLaunchKernel" and launch.attributes["cbid"] == 211
    assert kernel.attributes["graph_id"] == 3 and kernel.attributes["graph_node_id"] == 9


def test_profile_cli_device_cuda_without_gpu(tmp_path: pytest.TempPathFactory) -> None:
    import torch

    from sidecar.cli import main
    from tests.harness import models

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU exists")
    model = models.small_cnn_torchscript(tmp_path / "m.pt")  # type: ignore[operator]
    code = main(["profile", str(model), "--device", "cuda", "--input", "x:1x3x32x32:float32"])
    assert code == 2


def test_profile_cli_provider_cuda_is_device_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnxruntime as ort

    from sidecar.cli import main
    from sidecar.commands.profile import device_of
    from tests.harness import models

    assert device_of("cpu", "cuda") == "cuda"
    assert device_of("cuda:1", "cuda") == "cuda:1"
    assert device_of("cpu", None) == device_of("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="--provider cpu contradicts --device cuda:1"):
        device_of("cuda:1", "cpu")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA execution provider")
    model = models.save_onnx(models.small_cnn_onnx(), tmp_path / "m.onnx")
    code = main(["profile", str(model), "--provider", "cuda", "--no-peak"])
    assert code == 2
    assert "--device cuda needs onnxruntime-gpu" in capsys.readouterr().err
