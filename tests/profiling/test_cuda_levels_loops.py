"""The CUDA levels' loops on the CPU: warm-up, pacing, CUPTI's window, kernel -> layer.

No GPU exists here, so CUDA is a FAKE: `fake_torch.cuda` has events on the host clock and a
no-op synchronize, and `FakeTracer` stands in for CUPTI, handing out one launch record and
one kernel record per call of `Launching.forward` while it records. The model, its hooks,
the pacer and the experiment code around them are the real ones.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from sidecar.profiling import pacing
from sidecar.profiling.gpu.attribution import kernel_layers
from sidecar.profiling.runners import pytorch_cuda
from sidecar.profiling.runners.pytorch_cuda import CudaLevels
from sidecar.trace.spans import Level

RECORDS: list[dict[str, Any]] | None = None  # what the FAKE tracer is recording, if it is


class FakeEvent:
    """FAKE torch.cuda.Event: the host clock at record()."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t_ns = 0

    def record(self) -> None:
        self.t_ns = time.perf_counter_ns()

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t_ns - self.t_ns) / 1e6


fake_torch = SimpleNamespace(
    cuda=SimpleNamespace(
        Event=FakeEvent,
        synchronize=lambda device=None: None,
        device=lambda device: contextlib.nullcontext(),
    )
)


class FakeTracer:
    """FAKE CuptiTracer: epoch-ns records (offset 0) of the launches made while it records."""

    offset_ns = 0
    api_filter = "cbid"

    def start(self) -> None:
        global RECORDS
        RECORDS = []

    def stop(self) -> list[dict[str, Any]]:
        global RECORDS
        records, RECORDS = RECORDS or [], None
        return records


class Launching(nn.Module):
    """A layer that 'launches' one kernel per call while the FAKE tracer records."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if RECORDS is not None:
            Launching.calls += 1
            cid, t = Launching.calls, time.time_ns()
            launch = {"kind": 5, "start": t, "end": t + 10, "cbid": 211}
            kernel = {"kind": 10, "start": t + 20, "end": t + 30, "name": "gemm"}
            RECORDS.extend([{**launch, "correlation_id": cid}, {**kernel, "correlation_id": cid}])
        return self.fc(x)


class InterruptFirst:
    """A pacer whose first timed run of each loop was disturbed."""

    def __init__(self) -> None:
        self.runs = 0

    def wait(self) -> None:
        pass

    def begin(self) -> int:
        return 0

    def interrupted(self, mark: int, wall_ns: int) -> bool:
        self.runs += 1
        return self.runs == 1


@pytest.fixture
def levels() -> CudaLevels:
    model = nn.Sequential(Launching(), nn.ReLU()).eval()
    return CudaLevels(fake_torch, model, "cuda:0", "m", lambda *a: {}, hookable=True)


def test_model_level_is_paced_and_reruns_a_disturbed_iteration(levels: CudaLevels) -> None:
    pacing.take_loops()  # forget loops other tests left
    with pacing.installed(InterruptFirst()), torch.inference_mode():
        its = levels.model_run([torch.rand(2, 4)], iterations=3, warmup=2)
    assert pacing.take_loops() == [pacing.LoopRecord(4, [0])]
    assert len(its) == 4
    for it in its:
        (span,) = it.spans
        assert 0 < span.attributes["gpu_time_ns"] <= span.end_ns - span.start_ns


def test_kernel_level_records_the_timed_runs_only_and_places_kernels_in_layers(
    levels: CudaLevels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pytorch_cuda, "CuptiTracer", FakeTracer)
    Launching.calls = 0
    pacing.take_loops()  # forget loops other tests left
    with pacing.installed(InterruptFirst()), torch.inference_mode():
        its, attrs = levels.kernel_run([torch.rand(2, 4)], iterations=3, warmup=5)
    assert pacing.take_loops() == [pacing.LoopRecord(4, [0])]
    assert Launching.calls == 4  # the five warm-up forwards ran before CUPTI recorded
    assert attrs["clock_check"] == "ok (4 GPU, 4 API records)"
    for it in its:
        (kernel,) = [s for s in it.spans if s.kind == "kernel"]
        assert kernel.level is Level.KERNEL
        layer = kernel_layers(it.spans)[id(kernel)]
        assert layer is not None and layer.name == "0"  # the Launching layer, by its launch
