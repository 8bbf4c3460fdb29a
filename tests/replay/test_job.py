"""Replaying a sampled KServe request: real ONNX Runtime, real SQLite, the sample repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sidecar.localtriton.model_repo import build_model_repository
from sidecar.replay.job import replay_job
from sidecar.replay.jobs import ProfileJob
from sidecar.replay.options import ReplayOptions
from sidecar.trace.spans import Level, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore


def infer_request(model: str, x: np.ndarray) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "input", "FP32"
    tensor.shape.extend(x.shape)
    request.raw_input_contents.append(x.astype(np.float32).tobytes())
    return bytes(request.SerializeToString())


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_repository(tmp_path_factory.mktemp("repo") / "models")


def context(repo: Path, db: Path, store_raw_inputs: bool = False) -> dict[str, Any]:
    """What the worker hands the replay: the options and, across jobs, its caches."""
    options = ReplayOptions(
        model_repository=repo,
        db_path=db,
        levels=(Level.MODEL, Level.LAYER),
        iterations=3,
        warmup=1,
        store_raw_inputs=store_raw_inputs,
    )
    return {"options": options}


def job(model: str, message: bytes, reason: str = "forced") -> ProfileJob:
    return ProfileJob(
        trace_id=new_trace_id(),
        parent_span_id=new_span_id(),
        model=model,
        method="ModelInfer",
        request_message=message,
        reason=reason,
        received_ns=0,
    )


def test_replay_stores_a_leveled_trace_under_the_proxy_span(repo: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    the_job = job("simple_cnn", infer_request("simple_cnn", x))
    result = replay_job(the_job, context(repo, tmp_path / "t.db"))
    assert result.outcome == "ok", result.error
    assert set(result.level_latency_s) == {"model", "layer"}
    assert result.overhead_ratio["model"] == pytest.approx(1.0)
    assert sum(result.layer_type_share.values()) == pytest.approx(1.0)
    assert "Conv+Relu" in result.layer_type_share  # ORT fused each Conv with its Relu

    store = TraceStore(tmp_path / "t.db")
    trace = store.get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "ok"
    assert trace.sample_reason == "forced" and trace.batch_size == 2
    assert trace.model_version == "1"
    assert trace.attributes["inputs"][0]["shape"] == [2, 3, 32, 32]
    assert "raw_inputs" not in trace.attributes  # only with the opt-in
    models = store.spans(the_job.trace_id, Level.MODEL)
    assert len(models) == 1 and models[0].parent_id == the_job.parent_span_id
    layers = store.spans(the_job.trace_id, Level.LAYER)
    assert layers and all(s.parent_id == models[0].span_id for s in layers)


def test_raw_inputs_are_kept_only_when_asked(repo: Path, tmp_path: Path) -> None:
    x = np.ones((1, 3, 32, 32), dtype=np.float32)
    the_job = job("simple_cnn", infer_request("simple_cnn", x))
    replay_job(the_job, context(repo, tmp_path / "t.db", store_raw_inputs=True))
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None
    assert trace.attributes["raw_inputs"]["input"]["shape"] == [1, 3, 32, 32]


def test_admin_profile_without_a_request_uses_config_shaped_random_inputs(
    repo: Path, tmp_path: Path
) -> None:
    the_job = job("simple_cnn", b"", reason="admin")
    result = replay_job(the_job, context(repo, tmp_path / "t.db"))
    assert result.outcome == "ok", result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.attributes["input_source"] == "random"
    assert trace.batch_size == 1


@pytest.mark.parametrize(
    ("model", "error"),
    [("add_sub", "UnsupportedModelFormat"), ("no_such_model", "no_such_model")],
)
def test_unreplayable_models_are_stored_as_errors(
    repo: Path, tmp_path: Path, model: str, error: str
) -> None:
    the_job = job(model, b"")
    result = replay_job(the_job, context(repo, tmp_path / "t.db"))
    assert result.outcome == "error" and error in result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "error" and error in trace.error
