"""Replaying a sampled KServe or TF-Serving request: real ONNX Runtime, real SQLite, the sample
repository, and real Keras SavedModels in a TF-Serving model base path."""

from __future__ import annotations

import base64
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sidecar.backends import TF_SERVING, TRITON
from sidecar.backends.kserve_decode import KServeDecodeError
from sidecar.replay.context import ReplayContext
from sidecar.replay.job_records import ProfileJob
from sidecar.replay.options import ReplayOptions
from sidecar.replay.replay_job import ReplayError, decode_request, replay_job
from sidecar.trace.spans import Level, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.triton.model_repo import build_model_repository


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


def context(
    repo: Path,
    db: Path,
    store_raw_inputs: bool = False,
    device: str = "auto",
    python_models: bool = True,
    backend: str = "triton",
    **fields: Any,
) -> ReplayContext:
    """What the worker hands the replay: the options and, across jobs, its caches; `fields`
    replace the probe or the store's opening."""
    options = ReplayOptions(
        model_repository=repo,
        db_path=db,
        levels=(Level.MODEL, Level.LAYER),
        iterations=3,
        warmup=1,
        store_raw_inputs=store_raw_inputs,
        device=device,
        python_models=python_models,
        backend_protocol=backend,
    )
    return ReplayContext(options, **fields)


def predict_request(model: str, inputs: dict[str, np.ndarray], version: int | None = None) -> bytes:
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    if version is not None:
        request.model_spec.version.value = version
    for name, array in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return bytes(request.SerializeToString())


def job(
    model: str, message: bytes, reason: str = "forced", method: str = "ModelInfer"
) -> ProfileJob:
    return ProfileJob(
        trace_id=new_trace_id(),
        parent_span_id=new_span_id(),
        model=model,
        method=method,
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
    result = replay_job(the_job, context(repo, tmp_path / "t.db", python_models=False))
    assert result.outcome == "error" and error in result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "error" and error in trace.error


def test_the_decoder_is_the_configured_backends_for_the_jobs_method() -> None:
    image = np.random.default_rng(1).random((2, 32, 32, 3), dtype=np.float32)
    predict = predict_request("keras_cnn", {"image": image}, version=3)
    decoded = decode_request(job("keras_cnn", predict, method="Predict"), TF_SERVING)
    assert decoded is not None and list(decoded.inputs) == ["image"]
    np.testing.assert_array_equal(decoded.inputs["image"], image)
    assert decoded.version == "3" and decoded.attributes == {"signature_name": "serving_default"}

    x = np.ones((1, 3, 32, 32), dtype=np.float32)
    infer = infer_request("simple_cnn", x)
    kserve = decode_request(job("simple_cnn", infer), TRITON)
    assert kserve is not None and kserve.version == "" and kserve.inputs["input"].shape == x.shape
    with pytest.raises(KServeDecodeError):
        decode_request(job("keras_cnn", predict), TRITON)  # a Predict message is no ModelInfer
    with pytest.raises(ReplayError, match="tfserving requests of Classify cannot be decoded"):
        decode_request(job("keras_cnn", predict, method="Classify"), TF_SERVING)
    # another backend's method: not this sidecar's to replay
    with pytest.raises(ReplayError, match="triton requests of Predict cannot be decoded"):
        decode_request(job("keras_cnn", predict, method="Predict"), TRITON)
    with pytest.raises(ReplayError, match="tfserving requests of ModelInfer cannot be decoded"):
        decode_request(job("simple_cnn", infer), TF_SERVING)
    assert decode_request(job("keras_cnn", b"", method="Predict"), TF_SERVING) is None  # admin


def test_a_predict_request_replays_with_its_own_inputs(repo: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(2).random((2, 3, 32, 32), dtype=np.float32)
    the_job = job("simple_cnn", predict_request("simple_cnn", {"input": x}), method="Predict")
    options = context(repo, tmp_path / "t.db", store_raw_inputs=True, backend="tfserving")
    result = replay_job(the_job, options)
    assert result.outcome == "ok", result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "ok" and trace.batch_size == 2
    assert trace.attributes["method"] == "Predict"
    assert trace.attributes["input_source"] == "request"
    assert trace.attributes["signature_name"] == "serving_default"
    raw = trace.attributes["raw_inputs"]["input"]
    assert raw["shape"] == [2, 3, 32, 32] and base64.b64decode(raw["data_base64"]) == x.tobytes()


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (b"\xff\xfe not protobuf", "PredictDecodeError: bytes are not a PredictRequest"),
        (b"\x0a\x0b\x0a\x09keras_cnn", "PredictDecodeError: the PredictRequest for"),
        (None, "PredictDecodeError: input 'image': shape [1, 32, 32, 3] of DT_FLOAT needs"),
    ],
    ids=["not protobuf", "no inputs", "short tensor_content"],
)
def test_a_malformed_predict_request_is_stored_as_an_error(
    tf_model_base: Path, tmp_path: Path, message: bytes | None, error: str
) -> None:
    if message is None:
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2

        request = predict_pb2.PredictRequest()
        request.model_spec.name = "keras_cnn"
        request.inputs["image"].CopyFrom(tf.make_tensor_proto(np.ones((1, 32, 32, 3), "f4")))
        request.inputs["image"].tensor_content = request.inputs["image"].tensor_content[:-4]
        message = request.SerializeToString()
    the_job = job("keras_cnn", message, method="Predict")
    result = replay_job(the_job, context(tf_model_base, tmp_path / "t.db", backend="tfserving"))
    assert result.outcome == "error" and error in result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "error" and error in trace.error
    assert trace.model == "keras_cnn"


def test_a_predict_request_for_a_missing_version_is_stored_as_an_error(
    repo: Path, tmp_path: Path
) -> None:
    x = np.ones((1, 3, 32, 32), dtype=np.float32)
    message = predict_request("simple_cnn", {"input": x}, version=7)
    result = replay_job(
        job("simple_cnn", message, method="Predict"),
        context(repo, tmp_path / "t.db", backend="tfserving"),
    )
    assert result.outcome == "error" and "no version '7'" in result.error


def test_an_admin_profile_of_a_savedmodel_feeds_its_signature(
    tf_model_base: Path, tmp_path: Path
) -> None:
    """Random inputs come from `serving_default` and the TensorFlow runner profiles them. The
    replay runs in a fresh process, as in the worker: TensorFlow takes its thread settings
    only before its runtime starts, and this test process has already run TensorFlow."""
    the_job = job("keras_cnn", b"", reason="admin", method="Predict")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result = pool.apply(replay_job, (the_job, context(tf_model_base, tmp_path / "t.db")))
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None
    assert result.outcome == "ok", result.error
    assert trace.status == "ok"
    assert trace.attributes["input_source"] == "random"
    assert trace.attributes["inputs"][0]["shape"] == [1, 32, 32, 3]
    assert trace.batch_size == 1
    layers = {s.name for s in TraceStore(tmp_path / "t.db").spans(the_job.trace_id, Level.LAYER)}
    assert {"conv1", "conv2", "fc"} <= layers
