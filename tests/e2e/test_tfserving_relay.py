"""The real sidecar (`xsp-sidecar serve --backend-protocol tfserving`) in front of the stand-in for
`tensorflow_model_server` (real TensorFlow): replies through the relay are byte-identical to
the backend's own, calls are counted per method and model, malformed PredictRequests reach the
backend untouched and its own error reaches the client, and health follows the backend."""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    predict_pb2,
)

from tests.harness.sidecar_process import SidecarProcess
from tests.harness.tfserving.models import CNN, TRANSFORMER
from tests.harness.tfserving.process import TfServingServer

pytestmark = [pytest.mark.tfserving]

PREDICT = "/tensorflow.serving.PredictionService/Predict"
METADATA = "/tensorflow.serving.PredictionService/GetModelMetadata"
STATUS = "/tensorflow.serving.ModelService/GetModelStatus"
INPUTS = {CNN: ("image", (2, 32, 32, 3)), TRANSFORMER: ("features", (1, 16, 32))}


@pytest.fixture(scope="module")
def relay(
    tfserving: TfServingServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SidecarProcess]:
    """The sidecar relaying to the stand-in; sampling is off (no model repository)."""
    root = tmp_path_factory.mktemp("tfserving-relay")
    args = ["--backend-protocol", "tfserving", "--db", str(root / "traces.db"), "--otlp-port", "0"]
    with SidecarProcess(tfserving.grpc_address, root / "sidecar.log", args=args) as proc:
        yield proc


def predict_request(model: str) -> bytes:
    alias, shape = INPUTS[model]
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    value = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return request.SerializeToString()


def call(address: str, method: str, request: bytes) -> bytes:
    """One unary call in raw bytes: what the client sends and gets, unparsed."""
    with grpc.insecure_channel(address) as channel:
        reply: bytes = channel.unary_unary(method, None, None)(request, timeout=30)
        return reply


def failure(address: str, method: str, request: bytes) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(address, method, request)
    return info.value.code(), info.value.details()


def metadata_request(model: str) -> bytes:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = model
    return request.SerializeToString()


def status_request(model: str) -> bytes:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = model
    return request.SerializeToString()


@pytest.mark.parametrize(
    ("method", "request_for"),
    [(PREDICT, predict_request), (METADATA, metadata_request), (STATUS, status_request)],
    ids=["Predict", "GetModelMetadata", "GetModelStatus"],
)
@pytest.mark.parametrize("model", [CNN, TRANSFORMER])
def test_replies_through_the_relay_are_the_backends_bytes(
    tfserving: TfServingServer, relay: SidecarProcess, method: str, request_for: object, model: str
) -> None:
    request = request_for(model)  # type: ignore[operator]
    direct = call(tfserving.grpc_address, method, request)
    assert direct  # a real reply, not an empty message
    assert call(relay.address, method, request) == direct


def test_calls_are_counted_per_method_and_model(
    tfserving: TfServingServer, relay: SidecarProcess
) -> None:
    def count(**labels: str) -> float:
        return relay.metric("xsp_requests_total", **labels)

    before = {
        model: count(method="Predict", model=model, grpc_code="OK") for model in (CNN, TRANSFORMER)
    }
    status_before = count(method="GetModelStatus", model=TRANSFORMER, grpc_code="OK")
    missing_before = count(method="Predict", model="nope", grpc_code="NOT_FOUND")
    for _ in range(3):
        call(relay.address, PREDICT, predict_request(CNN))
    call(relay.address, PREDICT, predict_request(TRANSFORMER))
    call(relay.address, STATUS, status_request(TRANSFORMER))
    missing = predict_pb2.PredictRequest()
    missing.model_spec.name = "nope"
    assert failure(relay.address, PREDICT, missing.SerializeToString()) == (
        grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"
    )  # fmt: skip
    assert count(method="Predict", model=CNN, grpc_code="OK") == before[CNN] + 3
    assert count(method="Predict", model=TRANSFORMER, grpc_code="OK") == before[TRANSFORMER] + 1
    assert count(method="GetModelStatus", model=TRANSFORMER, grpc_code="OK") == status_before + 1
    assert count(method="Predict", model="nope", grpc_code="NOT_FOUND") == missing_before + 1


def test_malformed_requests_reach_the_backend_untouched_and_the_relay_keeps_serving(
    tfserving: TfServingServer, relay: SidecarProcess
) -> None:
    garbage = b"\xff\xfe not a PredictRequest \x00\x01"
    direct = failure(tfserving.grpc_address, PREDICT, garbage)
    assert direct == (grpc.StatusCode.INTERNAL, "Exception deserializing request!")  # grpcio's
    assert failure(relay.address, PREDICT, garbage) == direct

    short = predict_pb2.PredictRequest.FromString(predict_request(CNN))
    short.inputs["image"].tensor_content = short.inputs["image"].tensor_content[:-3]
    ill_shaped = short.SerializeToString()
    expected = (grpc.StatusCode.INVALID_ARGUMENT, "tensor parsing error: image")
    assert failure(tfserving.grpc_address, PREDICT, ill_shaped) == expected
    assert failure(relay.address, PREDICT, ill_shaped) == expected

    request = predict_request(CNN)
    assert call(relay.address, PREDICT, request) == call(tfserving.grpc_address, PREDICT, request)
    assert relay.alive() and "Traceback" not in relay.log(100_000)


def test_health_is_serving_while_the_stand_in_is_up(relay: SidecarProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{relay.grpc_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert relay.metric("xsp_backend_up") == 1
