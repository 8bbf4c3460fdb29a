"""The stand-in for `tensorflow_model_server` answers TF-Serving's gRPC API with real TensorFlow:
Predict as the SavedModel computes it, metadata and status as TF-Serving reports them, and
TF-Serving's error codes."""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
from google.protobuf import json_format

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
    regression_pb2,
)

from tests.harness.tfserving import json_tensor
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


def test_classify_and_regress_fail_as_on_a_model_without_their_signatures(
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
    model_stub: model_service_pb2_grpc.ModelServiceStub,
) -> None:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = CNN
    code, details = code_and_details(predict_stub.Classify, request)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(
        'No classification inputs found in SignatureDef: inputs {\n  key: "image"'
    )
    regression = regression_pb2.RegressionRequest()
    regression.model_spec.name = TRANSFORMER
    code, details = code_and_details(predict_stub.Regress, regression)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("No regression inputs found in SignatureDef: inputs {")
    regression.model_spec.signature_name = "nope"
    assert code_and_details(predict_stub.Regress, regression) == (
        grpc.StatusCode.INVALID_ARGUMENT, "No signature was found with the name: nope"
    )  # fmt: skip
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


# ---- TF-Serving's REST API (rest.py): the same answers as gRPC, in TF-Serving's JSON ----


def rest(tfserving: TfServingServer, path: str, body: Any = None, **kwargs: Any) -> Any:
    """A REST call to the stand-in: GET, or POST of `body` as JSON."""
    url = tfserving.rest_url + path
    if body is None and "data" not in kwargs:
        return requests.get(url, timeout=60, **kwargs)
    return requests.post(url, json=body, timeout=60, **kwargs)


def grpc_outputs(stub: Any, model: str, value: np.ndarray) -> dict[str, np.ndarray]:
    alias = INPUTS[model][0]
    response = stub.Predict(request_for(model, **{alias: value}))
    return {k: tf.make_ndarray(v) for k, v in response.outputs.items()}


@pytest.mark.parametrize("model", [CNN, TRANSFORMER])
def test_rest_predict_gives_grpcs_numbers_in_row_and_columnar_format(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
    model: str,
) -> None:
    alias, value = sample(model)
    expected = grpc_outputs(predict_stub, model, value)["output_0"]
    rows = value.tolist()  # float32 values, written exactly as doubles
    bodies = {
        "predictions": [
            {"instances": rows},
            {"instances": [{alias: row} for row in rows]},
            {"instances": rows, "signature_name": "serving_default"},
        ],
        "outputs": [{"inputs": rows}, {"inputs": {alias: rows}}],
    }
    paths = [f"/v1/models/{model}:predict", f"/v1/models/{model}/versions/1:predict"]
    for key, variants in bodies.items():
        for body in variants:
            for path in paths:
                reply = rest(tfserving, path, body)
                assert reply.status_code == 200, reply.text
                assert reply.headers["Content-Type"].startswith("application/json")
                got = np.asarray(reply.json()[key], dtype=np.float32)  # one output: no names
                np.testing.assert_array_equal(got, expected)


def test_rest_predict_reads_its_own_json_back_to_the_same_numbers(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
) -> None:
    """Floats written short (`%g`, else 9 digits) read back to the same float32 inputs."""
    alias, value = sample(CNN)
    text = json_tensor.predict_json({alias: value}, json_tensor.JsonFormat.COLUMNAR)
    short = json.loads(text)["outputs"]
    assert np.asarray(short, dtype=np.float32).tobytes() == value.tobytes()
    body = '{"inputs": ' + json.dumps(short) + "}"
    reply = rest(tfserving, f"/v1/models/{CNN}:predict", data=body)
    expected = grpc_outputs(predict_stub, CNN, value)["output_0"]
    np.testing.assert_array_equal(np.asarray(reply.json()["outputs"], np.float32), expected)


def test_rest_model_status_and_metadata_are_grpcs_answers_as_json(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
    model_stub: model_service_pb2_grpc.ModelServiceStub,
) -> None:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = CNN
    status = json_format.MessageToDict(
        model_stub.GetModelStatus(request), always_print_fields_with_no_presence=True
    )
    assert status == {"model_version_status": [{
        "version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""},
    }]}  # fmt: skip
    for path in (f"/v1/models/{CNN}", f"/v1/models/{CNN}/versions/1", "/V1/Models/keras%5Fcnn"):
        assert rest(tfserving, path).json() == status  # the name percent-decoded, as curl does

    meta_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    meta_request.model_spec.name = TRANSFORMER
    response = predict_stub.GetModelMetadata(meta_request)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    response.metadata["signature_def"].Unpack(signatures)
    as_dict = json_format.MessageToDict(
        signatures, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for path in (
        f"/v1/models/{TRANSFORMER}/metadata",
        f"/v1/models/{TRANSFORMER}/versions/1/metadata",
    ):
        meta = rest(tfserving, path).json()
        assert meta["model_spec"] == {"name": TRANSFORMER, "version": "1", "signature_name": ""}
        assert meta["metadata"] == {"signature_def": as_dict}
    serving = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert serving["inputs"]["features"]["dtype"] == "DT_FLOAT"
    assert serving["method_name"] == "tensorflow/serving/predict"


def error_of(reply: Any) -> tuple[int, str]:
    assert reply.headers["Content-Type"].startswith("application/json")
    return reply.status_code, reply.json()["error"]


def test_rest_errors_are_tf_servings_json_with_its_status_codes(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
) -> None:
    _, value = sample(CNN)
    rows = value.tolist()
    predict = f"/v1/models/{CNN}:predict"
    grpc_code, details = code_and_details(predict_stub.Predict, request_for("nope", image=value))
    assert grpc_code is grpc.StatusCode.NOT_FOUND
    assert error_of(rest(tfserving, "/v1/models/nope:predict", {"instances": rows})) == (
        404, details
    )  # fmt: skip
    assert error_of(rest(tfserving, f"/v1/models/{CNN}/versions/7:predict", {"inputs": rows})) == (
        404, f"Servable not found for request: Specific({CNN}, 7)"
    )  # fmt: skip
    assert error_of(rest(tfserving, f"/v1/models/{CNN}/labels/canary:predict", {"inputs": 1})) == (
        400, "Unrecognized servable version label: canary"
    )  # fmt: skip
    cases = {
        "": "JSON Parse error: The document is empty",
        "[1]": "JSON Value: [\n    1\n] Is not object",
        '{"inputs": 1, "instances": [1]}': "Not formatted correctly expecting only one of",
        '{"instances": []}': "No values in 'instances' array",
        '{"instances": 1}': "Excepting 'instances' to be an list/array",
        '{"values": [1]}': "Missing 'inputs' or 'instances' key",
        '{"signature_name": 3, "inputs": 1}': "'signature_name' key must be a string value.",
        '{"signature_name": "x", "inputs": 1}': 'Serving signature name: "x" not found in '
        "signature def",
        '{"instances": [{"pixels": 1}]}': "Failed to process element: 0 key: pixels of "
        "'instances' list. Error: INVALID_ARGUMENT: JSON object: does not have named input: "
        "pixels",
        '{"instances": ["a"]}': "Failed to process element: 0 of 'instances' list. Error: "
        'INVALID_ARGUMENT: JSON Value: "a" Type: String is not of expected type: float',
        '{"inputs": {"pixels": 1}}': "Missing named input: image in 'inputs' object.",
        '{"inputs": [[1], [1, 2]]}': "Encountered list at unexpected size: 2 at level: 1 "
        "expected size: 1",
        '{"inputs": [16777217]}': "Cannot convert JSON value: 16777217 to float without loss "
        "of precision.",
        '{"inputs": [{"b64": "AAAA"}]}': 'JSON Value: {\n    "b64": "AAAA"\n} Type: Object is '
        "not of expected type: float",
    }
    for body, message in cases.items():
        status, error = error_of(rest(tfserving, predict, data=body))
        assert status == 400 and message in error, (body, error)
    # shapes the JSON reads but the signature refuses: the Predict's own error, as over gRPC
    code, details = code_and_details(predict_stub.Predict, request_for(CNN, image=value[..., :2]))
    reply = rest(tfserving, predict, {"inputs": value[..., :2].tolist()})
    assert error_of(reply) == (400, details) and code is grpc.StatusCode.INVALID_ARGUMENT
    # what TF-Serving's router refuses
    assert error_of(rest(tfserving, "/v1/models/keras_cnn:explain", {})) == (
        400, "Malformed request: POST /v1/models/keras_cnn:explain"
    )  # fmt: skip
    reply = requests.put(tfserving.rest_url + predict, json={}, timeout=10)
    assert error_of(reply) == (400, f"Malformed request: PUT {predict}")
    assert error_of(rest(tfserving, "/v1/models")) == (400, "Missing model name in request.")
    assert error_of(rest(tfserving, "/v1/models/nope")) == (
        404, "Could not find any versions of model nope"
    )  # fmt: skip
    assert error_of(rest(tfserving, f"/v1/models/{CNN}/versions/2/metadata")) == (
        404, f"Servable not found for request: Specific({CNN}, 2)"
    )  # fmt: skip
    assert rest(tfserving, "/v2/health/ready").status_code == 404  # not TF-Serving's API
    reply = rest(tfserving, f"/v1/models/{CNN}/versions/99999999999999999999:predict", {})
    assert (reply.status_code, reply.text) == (400, "")  # an unparsed version: no body


@pytest.mark.parametrize("method", ["classify", "regress"])
def test_rest_classify_and_regress_answer_as_grpc_does(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
    method: str,
) -> None:
    body = {"examples": [{"x": [1.5, 2.0]}, {"x": 3}], "context": {"tag": "a"}}
    request = (classification_pb2.ClassificationRequest() if method == "classify"
               else regression_pb2.RegressionRequest())  # fmt: skip
    request.model_spec.name = CNN
    call = predict_stub.Classify if method == "classify" else predict_stub.Regress
    code, details = code_and_details(call, request)
    assert error_of(rest(tfserving, f"/v1/models/{CNN}:{method}", body)) == (400, details)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert error_of(rest(tfserving, f"/v1/models/nope:{method}", body))[0] == 404
    assert error_of(rest(tfserving, f"/v1/models/{CNN}:{method}", {"context": {}})) == (
        400, 'JSON Value: {\n    "context": {}\n} When method is classify, key \'examples\' is '
        "expected and was not found",
    )  # fmt: skip
    status, error = error_of(rest(tfserving, f"/v1/models/{CNN}:{method}", {"examples": [[1]]}))
    assert (status, error) == (400, "Example must be JSON object but got JSON Array")


def test_rest_speaks_http_1_1_keep_alive_chunked_and_expect_continue(
    tfserving: TfServingServer,
    predict_stub: prediction_service_pb2_grpc.PredictionServiceStub,
) -> None:
    _, value = sample(TRANSFORMER)
    expected = grpc_outputs(predict_stub, TRANSFORMER, value)["output_0"]
    body = json.dumps({"instances": value.tolist()}).encode()
    path = f"/v1/models/{TRANSFORMER}:predict"
    with requests.Session() as session:  # one connection, kept alive
        chunked = session.post(tfserving.rest_url + path, data=iter([body[:100], body[100:]]))
        again = session.post(tfserving.rest_url + path, data=body)
    for reply in (chunked, again):
        assert reply.status_code == 200
        np.testing.assert_array_equal(np.asarray(reply.json()["predictions"], np.float32), expected)
    connection = http.client.HTTPConnection(tfserving.rest_address, timeout=60)
    try:
        connection.request("POST", path, body, {"Expect": "100-continue"})
        continued = connection.getresponse()
        answer = json.loads(continued.read())
    finally:
        connection.close()
    assert continued.status == 200
    np.testing.assert_array_equal(np.asarray(answer["predictions"], np.float32), expected)
