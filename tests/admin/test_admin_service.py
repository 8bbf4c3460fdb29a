"""`xsp.v1.Profiler` servicer methods called directly: a fake ServicerContext, a real Sampler,
real SQLite trace stores (healthy and broken) and a list that stands in for the worker queue."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, cast

import grpc
import numpy as np
import pytest

from sidecar.admin._proto.xsp.v1 import profiler_pb2
from sidecar.admin.service import DEFAULT_LIST_LIMIT, MAX_INPUTS, ProfilerService
from sidecar.backends.kserve_decode import decode_model_infer_request
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.last_requests import LastRequests
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.harness.traces.synthetic import make_trace


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """Stands in for `grpc.ServicerContext`: `abort` raises, as gRPC's does."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)


CONTEXT = cast(grpc.ServicerContext, FakeContext())


class FakeQueue:
    """Stands in for the worker's `submit`: records jobs, accepts while there is room."""

    def __init__(self, room: int = 10) -> None:
        self.jobs: list[ProfileJob] = []
        self.room = room

    def submit(self, job: ProfileJob) -> bool:
        if len(self.jobs) >= self.room:
            return False
        self.jobs.append(job)
        return True


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    (tmp_path / "models" / "simple_cnn" / "1").mkdir(parents=True)
    return tmp_path / "models"


def service(
    repo: Path | None = None,
    *,
    db: Path | None = None,
    queue: FakeQueue | None = None,
    last: LastRequests | None = None,
    disabled_reason: str | None = None,
    settings: SamplingSettings | None = None,
    replayability: Callable[[str], Any] | None = None,
) -> ProfilerService:
    return ProfilerService(
        Sampler(settings or SamplingSettings()),
        (queue or FakeQueue()).submit,
        db,
        LastRequests() if last is None else last,
        model_repository=repo,
        disabled_reason=disabled_reason,
        replayability=replayability,
    )


def aborted(call: Callable[[], object]) -> Aborted:
    with pytest.raises(Aborted) as info:
        call()
    return info.value


def fp32(name: str, shape: list[int], data: np.ndarray | None = None) -> profiler_pb2.InputTensor:
    values = np.zeros(shape, np.float32) if data is None else data.astype(np.float32)
    return profiler_pb2.InputTensor(
        name=name, datatype="FP32", shape=shape, raw_contents=values.tobytes()
    )


# --- TriggerProfile -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({}, "model is required"),
        ({"model": "bad\nname"}, "printable characters"),
        ({"model": "simple_cnn", "version": "latest"}, "version must be a number"),
        ({"model": "simple_cnn", "version": "9" * 19}, "version must be a number"),
        ({"inputs": [fp32("x", [2, 2]), fp32("x", [1])]}, "'x' is given twice"),
        ({"inputs": [profiler_pb2.InputTensor(name="x", datatype="FP33")]}, "unknown datatype"),
        ({"inputs": [profiler_pb2.InputTensor(name="x", datatype="FP32", shape=[2, 3],
                                              raw_contents=bytes(16))]}, "needs 24 bytes"),
        ({"inputs": [profiler_pb2.InputTensor(name="x", datatype="FP32", shape=[-1])]},
         "none negative"),
        ({"inputs": [fp32(f"x{n}", [1]) for n in range(MAX_INPUTS + 1)]},
         f"at most {MAX_INPUTS} input tensors"),
    ],
)  # fmt: skip
def test_trigger_rejects_bad_requests(
    repo: Path, request_fields: dict[str, Any], message: str
) -> None:
    fields = {"model": "simple_cnn", **request_fields} if request_fields else {}
    queue = FakeQueue()
    error = aborted(
        lambda: service(repo, queue=queue).TriggerProfile(
            profiler_pb2.TriggerProfileRequest(**fields), CONTEXT
        )
    )
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and message in error.details
    assert queue.jobs == []


def test_trigger_answers_not_found_for_a_model_outside_the_repository(repo: Path) -> None:
    (repo.parent / "outside").mkdir()
    queue = FakeQueue()
    admin = service(repo, queue=queue)
    for model in ("resnet50", "..", "../outside"):
        request = profiler_pb2.TriggerProfileRequest(model=model)
        error = aborted(functools.partial(admin.TriggerProfile, request, CONTEXT))
        assert error.code is grpc.StatusCode.NOT_FOUND, model
        assert f"model {model!r} is not in the model repository" in error.details
    assert queue.jobs == []


def test_trigger_of_a_model_no_replay_can_run_is_refused_naming_why(tmp_path: Path) -> None:
    from sidecar.backends.model_repository import find_model, python_models
    from sidecar.backends.replayability import ReplayabilityCache
    from tests.harness.triton.model_repo import build_model_repository

    repo = build_model_repository(tmp_path / "models")
    cache = ReplayabilityCache(python_models(find_model, False), repo)  # python models off
    queue = FakeQueue()
    admin = service(repo, queue=queue, replayability=cache.of)
    error = aborted(
        lambda: admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="add_sub"), CONTEXT)
    )
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "model 'add_sub' cannot be profiled: no replay can run it" in error.details
    assert "--replay-python-models is off" in error.details
    assert "kept as live-only traces" in error.details
    assert queue.jobs == []
    answer = admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="simple_cnn"), CONTEXT)
    assert answer.accepted and len(queue.jobs) == 1  # its model.onnx: replayable


def test_trigger_while_sampling_is_off_is_a_failed_precondition(repo: Path) -> None:
    queue = FakeQueue()
    error = aborted(
        lambda: service(repo, queue=queue, disabled_reason="the trace store cannot be opened")
        .TriggerProfile(profiler_pb2.TriggerProfileRequest(model="simple_cnn"), CONTEXT)
    )  # fmt: skip
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "the trace store cannot be opened" in error.details and queue.jobs == []


def test_given_inputs_are_queued_as_a_kserve_request(repo: Path) -> None:
    queue = FakeQueue()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    reply = service(repo, queue=queue).TriggerProfile(
        profiler_pb2.TriggerProfileRequest(
            model="simple_cnn", version="1", inputs=[fp32("x", [2, 3], x)]
        ),
        CONTEXT,
    )
    assert reply.accepted and reply.input_source == "given" and reply.message == "queued"
    (job,) = queue.jobs
    assert (job.trace_id, job.model, job.model_version) == (reply.trace_id, "simple_cnn", "1")
    assert (job.reason, job.method) == ("admin", "ModelInfer")
    decoded = decode_model_infer_request(job.request_message)
    np.testing.assert_array_equal(decoded.inputs["x"], x)


def test_without_inputs_the_last_request_is_replayed_else_random_ones(repo: Path) -> None:
    queue = FakeQueue()
    last = LastRequests()
    admin = service(repo, queue=queue, last=last)
    first = admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="simple_cnn"), CONTEXT)
    assert first.accepted and first.input_source == "random"
    assert queue.jobs[-1].request_message == b""
    last.remember("simple_cnn", "ModelStreamInfer", b"sampled bytes")
    second = admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="simple_cnn"), CONTEXT)
    assert second.accepted and second.input_source == "last_request"
    assert (queue.jobs[-1].method, queue.jobs[-1].request_message) == (
        "ModelStreamInfer",
        b"sampled bytes",
    )
    assert first.trace_id != second.trace_id


def test_a_full_queue_is_an_answer_not_an_error(repo: Path) -> None:
    reply = service(repo, queue=FakeQueue(room=0)).TriggerProfile(
        profiler_pb2.TriggerProfileRequest(model="simple_cnn"), CONTEXT
    )
    assert not reply.accepted and reply.trace_id == "" and "queue is full" in reply.message


# --- ListTraces ---------------------------------------------------------------------------


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "traces.db"
    store = TraceStore(path)
    try:
        for n in range(25):
            store.write_trace(*make_trace(model="resnet50", created_ns=1_000 + n, layers=1))
        store.write_trace(*make_trace(model="bert", created_ns=5_000, layers=1))
    finally:
        store.close()
    return path


def list_traces(db: Path | None, **fields: Any) -> profiler_pb2.ListTracesResponse:
    return service(db=db).ListTraces(profiler_pb2.ListTracesRequest(**fields), CONTEXT)


def test_list_traces_newest_first_with_the_model_latency(db: Path) -> None:
    traces = list_traces(db).traces
    assert len(traces) == DEFAULT_LIST_LIMIT
    assert [t.model for t in traces[:2]] == ["bert", "resnet50"]
    assert [t.created_unix_ns for t in traces] == sorted(
        (t.created_unix_ns for t in traces), reverse=True
    )
    first = traces[0]
    store = TraceStore(db, create=False)
    try:
        (model_stats,) = [s for s in store.level_stats(first.trace_id) if s.level is Level.MODEL]
        (header,) = [t for t in store.list_traces() if t.trace_id == first.trace_id]
    finally:
        store.close()
    assert first.model_latency_ns == model_stats.trimmed_mean_ns > 0
    assert (first.runtime, first.device, first.batch_size) == (
        header.runtime,
        header.device,
        header.batch_size,
    )
    assert (first.sample_reason, first.model_version) == ("forced", "3")


def test_list_traces_by_model_and_limit(db: Path) -> None:
    assert [t.model for t in list_traces(db, model="bert").traces] == ["bert"]
    assert len(list_traces(db, model="resnet50", limit=1000).traces) == 25
    assert len(list_traces(db, limit=3).traces) == 3
    assert list_traces(db, model="nobody").traces == []


@pytest.mark.parametrize(("fields", "message"), [
    ({"limit": -1}, "limit must be from 1 to 1000"),
    ({"limit": 1001}, "limit must be from 1 to 1000"),
    ({"model": "x" * 10_000}, "printable characters"),
])  # fmt: skip
def test_list_traces_rejects_bad_requests(db: Path, fields: dict[str, Any], message: str) -> None:
    error = aborted(lambda: list_traces(db, **fields))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and message in error.details


def test_no_store_yet_is_an_empty_list(tmp_path: Path) -> None:
    assert list_traces(None).traces == []
    assert list_traces(tmp_path / "not-yet.db").traces == []


def store_that_is_not_a_database(tmp_path: Path) -> Path:
    path = tmp_path / "traces.db"
    path.write_bytes(b"this is not an SQLite database" * 100)
    return path


def store_with_a_row_that_does_not_decode(tmp_path: Path) -> Path:
    path = tmp_path / "traces.db"
    store = TraceStore(path)
    store.write_trace(*make_trace())
    store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE traces SET attributes = '{not json'")
    db.commit()
    db.close()
    return path


def store_from_a_newer_sidecar(tmp_path: Path) -> Path:
    path = tmp_path / "traces.db"
    TraceStore(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 999")
    db.commit()
    db.close()
    return path


def store_that_is_a_directory(tmp_path: Path) -> Path:
    path = tmp_path / "traces.db"
    path.mkdir()
    return path


@pytest.mark.parametrize(
    "broken",
    [
        store_that_is_not_a_database,
        store_that_is_a_directory,
        store_with_a_row_that_does_not_decode,
        store_from_a_newer_sidecar,
    ],
)
def test_a_failing_store_is_unavailable(tmp_path: Path, broken: Callable[[Path], Path]) -> None:
    path = broken(tmp_path)
    error = aborted(lambda: list_traces(path))
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert error.details.startswith("the trace store failed: ")


# --- GetSampling / UpdateSampling ---------------------------------------------------------


def test_get_sampling_reports_the_sampler_settings() -> None:
    settings = SamplingSettings(rate=0.25, model_rates={"bert": 1.0}, force_header=None)
    got = service(settings=settings).GetSampling(profiler_pb2.GetSamplingRequest(), CONTEXT)
    assert (got.rate, dict(got.model_rates), got.force_header) == (0.25, {"bert": 1.0}, "")
    assert (got.budget_per_minute, got.duty_cycle, got.enabled) == (
        settings.budget_per_minute,
        settings.duty_cycle,
        True,
    )


def test_update_sampling_changes_only_what_is_given() -> None:
    admin = service(settings=SamplingSettings(rate=0.1, model_rates={"bert": 0.5, "gpt": 0.2}))
    reply = admin.UpdateSampling(
        profiler_pb2.UpdateSamplingRequest(
            rate=0.3, model_rates={"bert": -1.0, "t5": 1.0}, force_header="X-Profile-Me"
        ),
        CONTEXT,
    )
    assert reply.rate == pytest.approx(0.3) and dict(reply.model_rates) == {"gpt": 0.2, "t5": 1.0}
    assert reply.force_header == "x-profile-me"
    now = admin.GetSampling(profiler_pb2.GetSamplingRequest(), CONTEXT)
    assert now == reply
    off = admin.UpdateSampling(
        profiler_pb2.UpdateSamplingRequest(enabled=False, force_header=""), CONTEXT
    )
    assert not off.enabled and off.force_header == "" and off.rate == pytest.approx(0.3)


@pytest.mark.parametrize(
    "update",
    [
        {"rate": 1.5},
        {"duty_cycle": float("nan")},
        {"model_rates": {"bad\nname": 0.5}},
        {"force_header": "grpc-timeout"},
    ],
)
def test_bad_updates_are_rejected_and_change_nothing(update: dict[str, Any]) -> None:
    before = SamplingSettings(rate=0.1)
    admin = service(settings=before)
    error = aborted(
        lambda: admin.UpdateSampling(profiler_pb2.UpdateSamplingRequest(**update), CONTEXT)
    )
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert admin.GetSampling(profiler_pb2.GetSamplingRequest(), CONTEXT).rate == pytest.approx(0.1)
