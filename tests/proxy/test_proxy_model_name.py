"""Model names from the first bytes of real Triton messages and hand-encoded TF-Serving ones."""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2

from sidecar.backends import TF_SERVING
from sidecar.backends import TRITON as TRITON_BACKEND
from sidecar.proxy.model_name import NEED_MORE, extract_model_name, method_info
from tests.proxy.proxy_h2build import grpc_message

TRITON = "/inference.GRPCInferenceService/"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_bytes(num: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2), encoded by hand."""
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def field_varint(num: int, value: int) -> bytes:
    return _varint(num << 3) + _varint(value)


def tf_model_spec(name: str, version: int | None = None, signature: str = "") -> bytes:
    out = b""
    if signature:  # signature_name = 3 written first: order must not matter
        out += field_bytes(3, signature.encode())
    if version is not None:
        out += field_bytes(2, field_varint(1, version))  # google.protobuf.Int64Value
    return out + field_bytes(1, name.encode())


def tf_predict_request(name: str) -> bytes:
    tensor = field_varint(1, 1) + field_bytes(2, field_bytes(2, field_varint(1, 3)))  # dtype+shape
    inputs_entry = field_bytes(1, b"x") + field_bytes(2, tensor)  # map<string, TensorProto>
    return field_bytes(1, tf_model_spec(name, 7, "serving_default")) + field_bytes(2, inputs_entry)


@pytest.mark.parametrize(
    ("method", "message", "expected"),
    [
        ("ModelInfer", service_pb2.ModelInferRequest(model_name="add_sub", id="1"), "add_sub"),
        ("ModelMetadata", service_pb2.ModelMetadataRequest(name="simple_cnn"), "simple_cnn"),
        ("ModelReady", service_pb2.ModelReadyRequest(name="sleep", version="2"), "sleep"),
        ("ModelConfig", service_pb2.ModelConfigRequest(name="add_sub"), "add_sub"),
        ("ModelStatistics", service_pb2.ModelStatisticsRequest(name="add_sub"), "add_sub"),
        ("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(model_name="m"), "m"),
        ("ModelStatistics", service_pb2.ModelStatisticsRequest(), None),  # all models
    ],
)  # fmt: skip
def test_triton_requests(method: str, message: object, expected: str | None) -> None:
    info = method_info((TRITON + method).encode(), TRITON_BACKEND.by_path)
    assert info.name == method and info.model_field is not None
    body = grpc_message(message.SerializeToString())  # type: ignore[attr-defined]
    assert extract_model_name(body, info.model_field) == expected


def test_infer_request_with_big_tensor_needs_only_the_head() -> None:
    req = service_pb2.ModelInferRequest(model_name="simple_cnn", id="abc")
    req.raw_input_contents.append(b"\0" * 100_000)
    body = grpc_message(req.SerializeToString())
    field = method_info((TRITON + "ModelInfer").encode(), TRITON_BACKEND.by_path).model_field
    assert field is not None
    assert extract_model_name(body[:40], field) == "simple_cnn"
    for cut in range(0, 5 + 2 + len("simple_cnn")):
        assert extract_model_name(body[:cut], field) is NEED_MORE


@pytest.mark.parametrize(
    "path",
    [
        "/tensorflow.serving.PredictionService/Predict",
        "/tensorflow.serving.PredictionService/Classify",
        "/tensorflow.serving.PredictionService/Regress",
        "/tensorflow.serving.PredictionService/GetModelMetadata",
        "/tensorflow.serving.ModelService/GetModelStatus",
    ],
)
def test_tf_serving_requests(path: str) -> None:
    info = method_info(path.encode(), TF_SERVING.by_path)
    assert info.model_field == (1, 1)
    body = grpc_message(tf_predict_request("resnet50"))
    assert extract_model_name(body, info.model_field) == "resnet50"
    # truncated inside model_spec: more bytes needed, never a wrong answer
    assert extract_model_name(body[:12], info.model_field) is NEED_MORE


def test_tf_multi_inference_first_task() -> None:
    task = field_bytes(1, tf_model_spec("ranker"))
    body = grpc_message(field_bytes(1, task) + field_bytes(1, field_bytes(1, tf_model_spec("x"))))
    assert extract_model_name(body, (1, 1, 1)) == "ranker"


def test_unknown_and_compressed() -> None:
    info = method_info(b"/my.Service/DoThing", TRITON_BACKEND.by_path)
    assert info.name == "DoThing" and info.model_field is None
    body = grpc_message(service_pb2.ModelInferRequest(model_name="a").SerializeToString(), True)
    assert extract_model_name(body, (1,)) is None
    assert extract_model_name(grpc_message(b""), (1,)) is None  # empty message: no name
    assert extract_model_name(grpc_message(b"\xff\xff\xff"), (1,)) is NEED_MORE
    garbage = grpc_message(b"\x0b\x01\x02")  # start-group wire type
    assert extract_model_name(garbage, (1,)) is None


def test_another_backends_method_names_no_model() -> None:
    """The table is the configured backend's: under Triton's, TF-Serving's Predict is a
    method of no known model (its short name only), and the other way round."""
    predict = b"/tensorflow.serving.PredictionService/Predict"
    assert method_info(predict, TF_SERVING.by_path).model_field == (1, 1)
    assert method_info(predict, TRITON_BACKEND.by_path) == method_info(predict, {})
    infer = (TRITON + "ModelInfer").encode()
    assert method_info(infer, TRITON_BACKEND.by_path).model_field == (1,)
    other = method_info(infer, TF_SERVING.by_path)
    assert (other.name, other.model_field, other.per_message) == ("ModelInfer", None, False)
