"""Every admin input is checked: INVALID_ARGUMENT with the reason, never UNKNOWN.

The real `xsp.v1.Profiler` service on a real grpcio server (port 0), over a real sampler and
real SQLite; the worker queue is a list (what was submitted is all these tests look at).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from sidecar.admin._proto.xsp.v1 import profiler_pb2, profiler_pb2_grpc
from sidecar.admin.service import ProfilerService, add_to_server
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.last_requests import LastRequests
from sidecar.sampling.sampler import Decision, Sampler
from sidecar.sampling.settings import SamplingSettings
from sidecar.trace.store import TraceStore
from tests.harness.traces.synthetic import make_trace

Stub = profiler_pb2_grpc.ProfilerStub


class Admin:
    def __init__(self, tmp_path: Path) -> None:
        (tmp_path / "models" / "simple_cnn").mkdir(parents=True)
        self.db = tmp_path / "traces.db"
        self.sampler = Sampler(SamplingSettings(rate=1.0, budget_per_minute=1e6, duty_cycle=0.5))
        self.jobs: list[ProfileJob] = []
        self.service = ProfilerService(
            self.sampler,
            self.submit,
            self.db,
            LastRequests(),
            model_repository=tmp_path / "models",
        )

    def submit(self, job: ProfileJob) -> bool:
        self.jobs.append(job)
        return True


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[tuple[Admin, Stub]]:
    state = Admin(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_to_server(state.service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield state, profiler_pb2_grpc.ProfilerStub(channel)
    finally:
        server.stop(0)


def rejected(call: object, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        ({"rate": math.nan}, "[0, 1]"),
        ({"rate": -0.5}, "[0, 1]"),
        ({"budget_per_minute": math.nan}, "finite"),
        ({"budget_per_minute": math.inf}, "finite"),
        ({"duty_cycle": 5e-324}, "duty cycle"),
        ({"duty_cycle": math.inf}, "duty cycle"),
        ({"model_rates": {"m": math.nan}}, "[0, 1]"),
        ({"model_rates": {"m\0": 0.5}}, "printable"),
        ({"model_rates": {"x" * 10_000: 0.5}}, "printable"),
        ({"force_header": "bad header"}, "metadata key"),
    ],
)
def test_bad_sampling_updates_are_invalid_arguments(
    admin: tuple[Admin, Stub], update: dict[str, object], reason: str
) -> None:
    state, stub = admin
    before = state.sampler.settings
    error = rejected(stub.UpdateSampling, profiler_pb2.UpdateSamplingRequest(**update))  # type: ignore[arg-type]
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert reason in (error.details() or "")
    assert state.sampler.settings == before  # nothing applied


def test_a_tiny_duty_cycle_set_back_does_not_leave_sampling_off(
    admin: tuple[Admin, Stub],
) -> None:
    state, stub = admin
    stub.UpdateSampling(profiler_pb2.UpdateSamplingRequest(duty_cycle=0.001))
    sampler = state.sampler
    assert sampler.at_body("m", sampler.at_headers(forced=False)) is Decision.SAMPLED
    sampler.duty.record_busy(10.0)  # 10 s busy at 0.001: closed for almost 3 hours
    assert sampler.at_body("m", sampler.at_headers(False)) is Decision.SKIPPED_DUTY_CYCLE
    stub.UpdateSampling(profiler_pb2.UpdateSamplingRequest(duty_cycle=0.5))
    assert sampler.at_body("m", sampler.at_headers(False)) is Decision.SAMPLED


@pytest.mark.parametrize("limit", [-1, 1001, 2**31 - 1])
def test_list_limits_outside_the_cap_are_invalid_arguments(
    admin: tuple[Admin, Stub], limit: int
) -> None:
    _, stub = admin
    error = rejected(stub.ListTraces, profiler_pb2.ListTracesRequest(limit=limit))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "1 to 1000" in (error.details() or "")


def test_list_is_capped_and_answers_within_the_cap(admin: tuple[Admin, Stub]) -> None:
    state, stub = admin
    with TraceStore(state.db) as store:
        for _ in range(25):
            trace, spans, stats = make_trace(layers=1, kernels_per_layer=0)
            store.write_trace(trace, spans, stats)
    assert len(stub.ListTraces(profiler_pb2.ListTracesRequest()).traces) == 20  # default
    assert len(stub.ListTraces(profiler_pb2.ListTracesRequest(limit=1000)).traces) == 25


def test_a_failing_store_is_unavailable_not_unknown(admin: tuple[Admin, Stub]) -> None:
    state, stub = admin
    state.db.write_bytes(b"this is not an SQLite database" * 100)
    error = rejected(stub.ListTraces, profiler_pb2.ListTracesRequest())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "not a readable SQLite trace database" in (error.details() or "")


def tensor(shape: list[int], data: bytes, datatype: str = "FP32") -> profiler_pb2.InputTensor:
    return profiler_pb2.InputTensor(name="input", datatype=datatype, shape=shape, raw_contents=data)


@pytest.mark.parametrize(
    ("request_fields", "code", "reason"),
    [
        ({"model": "x" * 10_000}, "INVALID_ARGUMENT", "printable"),
        ({"model": "m\0"}, "INVALID_ARGUMENT", "printable"),
        ({"model": "simple_cnn", "version": "-1"}, "INVALID_ARGUMENT", "version"),
        ({"model": "no_such_model"}, "NOT_FOUND", "not in the model repository"),
        ({"model": "../etc"}, "NOT_FOUND", "not in the model repository"),
        (
            {"model": "simple_cnn", "inputs": [tensor([2, 2], b"1234")]},
            "INVALID_ARGUMENT",
            "needs 16 bytes",
        ),
        (
            {"model": "simple_cnn", "inputs": [tensor([1], b"1234", "FP33")]},
            "INVALID_ARGUMENT",
            "unknown datatype",
        ),
        (
            {"model": "simple_cnn", "inputs": [tensor([-1], b"")]},
            "INVALID_ARGUMENT",
            "none negative",
        ),
    ],
)
def test_bad_trigger_requests_are_answered_with_the_reason(
    admin: tuple[Admin, Stub], request_fields: dict[str, object], code: str, reason: str
) -> None:
    state, stub = admin
    request = profiler_pb2.TriggerProfileRequest(**request_fields)  # type: ignore[arg-type]
    error = rejected(stub.TriggerProfile, request)
    assert error.code() is getattr(grpc.StatusCode, code)
    assert reason in (error.details() or "")
    assert state.jobs == []


def test_a_good_trigger_request_is_queued(admin: tuple[Admin, Stub]) -> None:
    state, stub = admin
    x = np.ones((1, 3, 32, 32), np.float32)
    reply = stub.TriggerProfile(
        profiler_pb2.TriggerProfileRequest(
            model="simple_cnn", version="1", inputs=[tensor(list(x.shape), x.tobytes())]
        )
    )
    assert reply.accepted and reply.input_source == "given"
    assert [job.model for job in state.jobs] == ["simple_cnn"]
