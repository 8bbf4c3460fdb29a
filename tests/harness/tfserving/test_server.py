"""The stand-in for `tensorflow_model_server` answers TF-Serving's gRPC API with real TensorFlow:
Predict as the SavedModel computes it, metadata and status as TF-Serving reports them, and
TF-Serving's error codes."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from tests.harness.tfserving.models import CNN, TRANSFORMER
from tests.harness.tfserving.process import (
    TfServingServer,
    available_versions,
    status_request,
)

pytestmark = [pytest.mark.tfserving]

INPUTS = {CNN: ("image", (2, 32, 32, 3)), TRANSFORMER: ("features", (3, 16, 32))}


@pytest.fixture(scope="module")
def channel(tfserving: TfServingServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(tfserving.grpc_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def predict_stub(channel: grpc.Channel) -> prediction_service_pb2_grpc.PredictionServiceStub:
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


@pytest.fixture(scope="module")
def model_stub(channel: grpc.Channel) -> model_service_pb2_grpc.ModelServiceStub:
    return model_service_pb2_grpc.ModelServiceStub(channel)


def request_for(model: str, **inputs: Any) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for alias, value in inputs.items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return request


def sample(model: str) -> tuple[str, np.ndarray]:
    alias, shape = INPUTS[model]
    return alias, np.random.default_rng(7).standard_normal(shape).astype(np.float32)


def code_and_details(call: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("model", [CNN, TRANSFORMER])
def test_predict_matches_the_saved_model_run_here(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
    model: str,
) -> None:
    alias, value = sample(model)
    response = predict_stub.Predict(request_for(model, **{alias: value}))
    loaded = tf.saved_model.load(str(tfserving.model_base / model / "1"))
    expected = loaded.signatures["serving_default"](**{alias: tf.constant(value)})["output_0"]
    assert list(response.outputs) == ["output_0"]
    np.testing.assert_allclose(
        tf.make_ndarray(response.outputs["output_0"]), expected.numpy(), rtol=1e-5, atol=1e-6
    )
    assert response.model_spec.name == model
    assert response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"


def test_predict_reads_typed_value_fields_as_well_as_tensor_content(
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
) -> None:
    alias, value = sample(CNN)
    packed = predict_stub.Predict(request_for(CNN, **{alias: value}))
    typed = request_for(CNN)
    tensor = typed.inputs[alias]
    tensor.dtype = tf.float32.as_datatype_enum
    tensor.tensor_shape.CopyFrom(tf.TensorShape(value.shape).as_proto())
    tensor.float_val.extend(value.ravel().tolist())
    assert predict_stub.Predict(typed).outputs == packed.outputs


def test_metadata_is_the_saved_models_signature_def_map(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
) -> None:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = TRANSFORMER
    response = predict_stub.GetModelMetadata(request)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    saved = saved_model_pb2.SavedModel.FromString(
        (tfserving.model_base / TRANSFORMER / "1" / "saved_model.pb").read_bytes()
    )
    assert dict(signatures.signature_def) == dict(saved.meta_graphs[0].signature_def)
    serving = signatures.signature_def["serving_default"]
    assert list(serving.inputs) == ["features"] and list(serving.outputs) == ["output_0"]
    assert (response.model_spec.name, response.model_spec.version.value) == (TRANSFORMER, 1)

    request.metadata_field[:] = ["labels"]
    code, details = code_and_details(predict_stub.GetModelMetadata, request)
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT, "Metadata field labels is not supported"
    )  # fmt: skip


def test_model_status_reports_every_model_available(
    model_stub: model_service_pb2_grpc.ModelServiceStub,
) -> None:
    for model in (CNN, TRANSFORMER):
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = model
        [status] = model_stub.GetModelStatus(request).model_version_status
        assert status.version == 1
        assert status.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
        assert status.status.error_code == 0

    request.model_spec.version.value = 2
    assert code_and_details(model_stub.GetModelStatus, request) == (
        grpc.StatusCode.NOT_FOUND, f"Could not find version 2 of model {TRANSFORMER}"
    )  # fmt: skip
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "nope"
    assert code_and_details(model_stub.GetModelStatus, request) == (
        grpc.StatusCode.NOT_FOUND, "Could not find any versions of model nope"
    )  # fmt: skip


def test_the_readiness_poll_speaks_get_model_status_in_raw_bytes() -> None:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "m" * 200  # a two-byte length
    assert status_request("m" * 200) == request.SerializeToString()
    response = get_model_status_pb2.GetModelStatusResponse()
    states = get_model_status_pb2.ModelVersionStatus
    response.model_version_status.add(version=3, state=states.LOADING)
    response.model_version_status.add(version=300, state=states.AVAILABLE).status.error_code = 0
    assert available_versions(response.SerializeToString()) == [300]


def test_predict_errors_are_tf_servings(
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
) -> None:
    alias, value = sample(CNN)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    predict = predict_stub.Predict

    assert code_and_details(predict, request_for("nope", image=value)) == (
        grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"
    )  # fmt: skip
    versioned = request_for(CNN, image=value)
    versioned.model_spec.version.value = 7
    assert code_and_details(predict, versioned) == (
        grpc.StatusCode.NOT_FOUND, f"Servable not found for request: Specific({CNN}, 7)"
    )  # fmt: skip
    assert code_and_details(predict, request_for(CNN, pixels=value)) == (
        invalid, "input tensor alias not found in signature: pixels. "
        "Inputs expected to be in the set {image}."
    )  # fmt: skip
    code, details = code_and_details(predict, request_for(CNN))
    assert code is invalid and "Missing but required: {image}." in details
    assert code_and_details(predict, request_for(CNN, image=value.astype(np.float64))) == (
        invalid, "Expects arg[0] to be float but double is provided"
    )  # fmt: skip
    code, details = code_and_details(predict, request_for(CNN, image=value[..., :2]))
    assert code is invalid and "shape [2, 32, 32, 2]" in details
    short = request_for(CNN, image=value)
    short.inputs[alias].tensor_content = short.inputs[alias].tensor_content[:-4]
    assert code_and_details(predict, short) == (invalid, "tensor parsing error: image")
    unknown_signature = request_for(CNN, image=value)
    unknown_signature.model_spec.signature_name = "classify"
    assert code_and_details(predict, unknown_signature) == (
        grpc.StatusCode.FAILED_PRECONDITION, 'Serving signature key "classify" not found.'
    )  # fmt: skip


def test_unsupported_methods_say_so(
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
    model_stub: model_service_pb2_grpc.ModelServiceStub,
) -> None:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = CNN
    code, details = code_and_details(predict_stub.Classify, request)
    assert code is grpc.StatusCode.UNIMPLEMENTED
    assert details.startswith("Classify is not implemented by this stand-in for ")
    code, details = code_and_details(
        model_stub.HandleReloadConfigRequest, model_management_pb2.ReloadConfigRequest()
    )
    assert code is grpc.StatusCode.UNIMPLEMENTED and "HandleReloadConfigRequest" in details


def test_profiler_server_listens_on_its_own_port(tfserving: TfServingServer) -> None:
    host, port = tfserving.profiler_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2):
        pass
    assert tfserving.log_path.read_text().count("stand-in for tensorflow_model_server") == 1


def test_a_model_base_without_models_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    server = TfServingServer(tmp_path, tmp_path / "log")
    with pytest.raises(RuntimeError, match="no SavedModel under"):
        server.start()
    assert server.process is None
