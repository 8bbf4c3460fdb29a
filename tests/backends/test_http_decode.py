"""Decoding sampled HTTP requests (`http_message`, `kserve_http_decode`, `tf_rest_decode`).

Triton's bodies are built by `tritonclient.http`'s own request builder (JSON and the
binary-tensor extension) and must decode to the arrays `kserve_decode` gives for the gRPC
request of the same tensors (built by `tritonclient.grpc`). TF-Serving's REST bodies (row and
columnar formats) must decode to what `tf_decode` gives for the equivalent `PredictRequest`
(built by TensorFlow's `make_tensor_proto`). Bad bodies raise the decoder's error, naming what
is wrong."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import os
import zlib
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from sidecar.backends import TF_SERVING, TRITON
from sidecar.backends.base import DecodedInputs
from sidecar.backends.http_message import HttpMessage, HttpMessageError, pack, unpack
from sidecar.backends.kserve_http_decode import (
    JSON_REFUSED,
    KServeHttpDecodeError,
    decode_http_infer,
)
from sidecar.backends.tf_rest_decode import UNNAMED_INPUT, TfRestDecodeError, decode_rest_predict
from sidecar.trace import schema
from tests.backends.test_kserve_decode import RAW_CASES, make_input, request_bytes

INFER = "/v2/models/m/infer"


def assert_same(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    assert list(ours) == list(theirs)
    for name, array in theirs.items():
        assert ours[name].dtype == array.dtype, name
        assert ours[name].shape == array.shape, name
        np.testing.assert_array_equal(ours[name], array)


# -- http_message -----------------------------------------------------------------------------


def test_a_packed_request_unpacks_to_its_parts() -> None:
    body = b'{"inputs":[]}' + b"\x00\x01binary"
    assert unpack(pack(body, 13, target="/v2/models/m/infer?x")) == HttpMessage(
        b'{"inputs":[]}', b"\x00\x01binary", "/v2/models/m/infer?x"
    )
    assert unpack(pack(b'{"a":1}', None)) == HttpMessage(b'{"a":1}', b"", "")
    assert unpack(pack(b"", 0)) == HttpMessage(b"", b"", "")


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "GZip "])
def test_a_compressed_body_is_decompressed(encoding: str) -> None:
    body = b'{"inputs":[]}xyz'
    compressed = gzip.compress(body) if "zip" in encoding.lower() else zlib.compress(body)
    assert unpack(pack(compressed, 13, encoding=encoding)) == HttpMessage(
        b'{"inputs":[]}', b"xyz", ""
    )


def test_bad_packing_is_refused_with_a_reason() -> None:
    with pytest.raises(HttpMessageError, match="said to be 10 bytes"):
        pack(b"{}", 10)
    with pytest.raises(HttpMessageError, match="-1"):
        pack(b"{}", -1)
    with pytest.raises(HttpMessageError, match="br"):
        pack(b"{}", None, encoding="br")
    with pytest.raises(HttpMessageError, match="not an HTTP request packed"):
        unpack(b"\x0a\x01m")  # a protobuf message, not a packed request
    with pytest.raises(HttpMessageError, match="cut short"):
        unpack(pack(b"{}", None)[:20])
    with pytest.raises(HttpMessageError, match="cannot be decompressed"):
        unpack(pack(b"not gzip", None, encoding="gzip"))
    with pytest.raises(HttpMessageError, match="said to be 100 bytes"):
        unpack(pack(gzip.compress(b"{}"), 100, encoding="gzip"))


# -- Triton: KServe v2 HTTP -------------------------------------------------------------------


def http_body(
    tensors: dict[str, tuple[str, np.ndarray]], binary: bool, **request: Any
) -> tuple[bytes, int | None]:
    """The body `tritonclient.http` sends for these tensors, and its JSON length."""
    inputs = []
    for name, (datatype, data) in tensors.items():
        tensor = httpclient.InferInput(name, list(data.shape), datatype)
        tensor.set_data_from_numpy(data, binary_data=binary)
        inputs.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, **request)
    return bytes(body), json_size


def grpc_arrays(tensors: dict[str, tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    message = request_bytes([make_input(n, dt, data) for n, (dt, data) in tensors.items()])
    decoded = TRITON.decoders["ModelInfer"](message)
    return decoded.inputs


@pytest.mark.parametrize(
    ("datatype", "binary"),
    [(dt, True) for dt in sorted(RAW_CASES)]
    + [(dt, False) for dt in sorted(RAW_CASES) if dt not in JSON_REFUSED],
    ids=lambda v: {True: "binary", False: "json"}.get(v, v) if isinstance(v, bool) else v,
)
def test_each_datatype_decodes_as_the_grpc_request_of_the_same_tensor(
    datatype: str, binary: bool
) -> None:
    data = RAW_CASES[datatype]
    tensors = {"x": (datatype, data)}
    body, json_size = http_body(tensors, binary)
    decoded = TRITON.decoders["HttpModelInfer"](pack(body, json_size, target=INFER))
    assert decoded.version == ""
    assert_same(decoded.inputs, grpc_arrays(tensors))


@pytest.mark.triton
@pytest.mark.parametrize("datatype", sorted(JSON_REFUSED))
def test_fp16_and_bf16_in_json_are_refused_as_the_real_triton_refuses_them(
    triton: Any, datatype: str
) -> None:
    def body(dt: str) -> bytes:
        inputs = [{"name": n, "shape": [2], "datatype": dt, "data": [0.5, 1.0]}
                  for n in ("INPUT0", "INPUT1")]  # fmt: skip
        return json.dumps({"inputs": inputs}).encode()

    def triton_answers(data: bytes) -> tuple[int, dict[str, Any]]:
        host, port = triton.http_address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", "/v2/models/add_sub/infer", data)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    status, answer = triton_answers(body(datatype))
    assert status == 400
    assert f"receiving {datatype} data via JSON is not supported" in answer["error"]
    with pytest.raises(KServeHttpDecodeError, match=f"is {datatype} in JSON, which Triton"):
        decode_http_infer(pack(body(datatype), None, target="/v2/models/add_sub/infer"))
    # the same body as FP32: Triton runs it, and it decodes
    assert triton_answers(body("FP32"))[0] == 200
    decoded = decode_http_infer(pack(body("FP32"), None, target="/v2/models/add_sub/infer"))
    np.testing.assert_array_equal(decoded.inputs["INPUT0"], np.array([0.5, 1.0], np.float32))


def test_bf16_binary_is_widened_as_the_grpc_decoder_widens_it() -> None:
    data = np.array([[1.5, -2.0, 3.140625]], dtype=np.float32)  # bfloat16 values
    tensors = {"b": ("BF16", data)}
    body, json_size = http_body(tensors, True)
    decoded = decode_http_infer(pack(body, json_size, target=INFER))
    assert decoded.inputs["b"].dtype == np.float32
    np.testing.assert_array_equal(decoded.inputs["b"], [[1.5, -2.0, 3.140625]])
    assert_same(decoded.inputs, grpc_arrays(tensors))


def test_mixed_binary_and_json_inputs_in_request_order() -> None:
    images = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ids = np.array([[3], [9]], dtype=np.int64)
    words = np.array([b"a", b"bc"], dtype=object)
    inputs = []
    for name, datatype, data, binary in (
        ("images", "FP32", images, True),
        ("ids", "INT64", ids, False),
        ("words", "BYTES", words, True),
    ):
        tensor = httpclient.InferInput(name, list(data.shape), datatype)
        tensor.set_data_from_numpy(data, binary_data=binary)
        inputs.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        inputs, request_id="7", parameters={"priority_hint": 1}
    )
    decoded = decode_http_infer(pack(bytes(body), json_size, target=INFER))
    assert list(decoded.inputs) == ["images", "ids", "words"]
    assert_same(
        decoded.inputs,
        grpc_arrays({"images": ("FP32", images), "ids": ("INT64", ids), "words": ("BYTES", words)}),
    )


def test_flat_json_data_and_the_version_from_the_path() -> None:
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}]}
    ).encode()
    decoded = decode_http_infer(pack(body, None, target="/v2/models/m/versions/3/infer?q=1"))
    assert decoded.version == "3"
    np.testing.assert_array_equal(decoded.inputs["x"], [[1, 2], [3, 4]])
    assert decoded.inputs["x"].dtype == np.int32


@pytest.mark.parametrize(
    ("inputs", "binary", "error"),
    [
        ("nope", b"", "no `inputs` list"),
        ([], b"", "no `inputs` list"),
        ([{"shape": [1], "datatype": "FP32", "data": [1]}], b"", "input 0 has no name"),
        ([{"name": "x", "shape": [1], "datatype": "FP8", "data": [1]}], b"", "datatype 'FP8'"),
        ([{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}], b"", "shape \\[-1\\]"),
        ([{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}], b"", "holds 1 values"),
        ([{"name": "x", "shape": [1], "datatype": "FP32"}], b"", "neither `data` nor binary"),
        ([{"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}], b"", "holds strings"),
        ([{"name": "x", "shape": [1], "datatype": "BYTES", "data": [1]}], b"", "must be strings"),
        ([{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}], b"", "true/false"),
        ([{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}], b"", "does not fit"),
        ([{"name": "x", "shape": [1], "datatype": "INT8", "data": [1.5]}], b"", "integers"),
        ([{"name": "x", "shape": [1], "datatype": "FP32", "data": [None]}], b"", "numbers"),
        ([{"name": "x", "shape": [1], "datatype": "FP32", "data": [{"a": 1}]}], b"", "numbers"),
        ([{"name": "x", "shape": [2], "datatype": "FP32", "data": [[1], [{}]]}], b"", "object"),
        (
            [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
             {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
            b"", "appears twice",
        ),
        (
            [{"name": "x", "shape": [1], "datatype": "FP32",
              "parameters": {"shared_memory_region": "r"}}],
            b"", "shared memory",
        ),
        (
            [{"name": "x", "shape": [2], "datatype": "FP32",
              "parameters": {"binary_data_size": 8}}],
            b"\x00" * 4, "end past the body's binary part",
        ),
        (
            [{"name": "x", "shape": [2], "datatype": "FP32",
              "parameters": {"binary_data_size": 4}}],
            b"\x00" * 4, "8 bytes\\) but its binary data holds 4",
        ),
        (
            [{"name": "x", "shape": [1], "datatype": "FP32",
              "parameters": {"binary_data_size": 4}}],
            b"\x00" * 6, "2 binary bytes no input claims",
        ),
        (
            [{"name": "x", "shape": [1], "datatype": "BYTES",
              "parameters": {"binary_data_size": 6}}],
            b"\x05\x00\x00\x00ab", "ends inside an element",
        ),
        (
            [{"name": "x", "shape": [2], "datatype": "BYTES",
              "parameters": {"binary_data_size": 5}}],
            b"\x01\x00\x00\x00a", "holds 1 elements",
        ),
        (
            [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1],
              "parameters": {"binary_data_size": 4}}],
            b"\x00" * 4, "both `data` and binary",
        ),
        (
            [{"name": "x", "shape": [1], "datatype": "FP32",
              "parameters": {"binary_data_size": "4"}}],
            b"\x00" * 4, "binary_data_size '4'",
        ),
    ],
)  # fmt: skip
def test_bad_kserve_bodies_are_refused_with_a_reason(
    inputs: Any, binary: bytes, error: str
) -> None:
    text = json.dumps({"inputs": inputs}).encode()
    with pytest.raises(KServeHttpDecodeError, match=error):
        decode_http_infer(pack(text + binary, len(text), target=INFER))


def test_a_body_that_is_not_json_or_not_packed() -> None:
    with pytest.raises(KServeHttpDecodeError, match="not JSON"):
        decode_http_infer(pack(b"\x00\x01", None))
    with pytest.raises(KServeHttpDecodeError, match="not an object"):
        decode_http_infer(pack(b"[1]", None))
    with pytest.raises(KServeHttpDecodeError, match="packed"):
        decode_http_infer(b"\x0a\x01m")


def test_a_json_length_past_the_binary_part_fails_cleanly() -> None:
    body, json_size = http_body({"x": ("FP32", np.ones((1, 2), np.float32))}, True)
    assert json_size is not None
    with pytest.raises(KServeHttpDecodeError, match="JSON part is not JSON"):
        decode_http_infer(pack(body, len(body), target=INFER))  # all of it read as JSON
    with pytest.raises(KServeHttpDecodeError, match="Inference-Header-Content-Length"):
        decode_http_infer(pack(body[:-1], json_size, target=INFER))  # a byte short


# -- TF-Serving REST --------------------------------------------------------------------------

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def grpc_predict(inputs: dict[str, Any], **spec: Any) -> DecodedInputs:
    """`tf_decode` of the PredictRequest TensorFlow makes of the same Python values."""
    tf = pytest.importorskip("tensorflow")
    predict_pb2 = pytest.importorskip("tensorflow_serving.apis.predict_pb2")
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "m"
    if "version" in spec:
        request.model_spec.version.value = spec["version"]
    if "label" in spec:
        request.model_spec.version_label = spec["label"]
    request.model_spec.signature_name = spec.get("signature", "")
    for name, values in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(values))
    decoded: DecodedInputs = TF_SERVING.decoders["Predict"](request.SerializeToString())
    return decoded


def rest(body: dict[str, Any], target: str = "/v1/models/m:predict") -> DecodedInputs:
    decoded: DecodedInputs = TF_SERVING.decoders["HttpPredict"](
        pack(json.dumps(body).encode(), None, target=target)
    )
    return decoded


COLUMNS = {
    "floats": [[1.5, -2.25, 0.1], [3.0, 4.0, 5.0]],
    "ints": [[1, 2], [3, 4]],
    "wide": [[2**40], [-1]],
    "flags": [True, False],
    "words": [["a", "bc"], ["", "é"]],
}


def test_columnar_named_inputs_decode_as_the_equivalent_predict_request() -> None:
    ours = rest({"inputs": COLUMNS, "signature_name": "sig"}, "/v1/models/m/versions/4:predict")
    theirs = grpc_predict(
        {k: np.array(v, dtype=object) if k == "words" else v for k, v in COLUMNS.items()},
        version=4,
        signature="sig",
    )
    assert_same(ours.inputs, theirs.inputs)
    assert ours.version == theirs.version == "4"
    assert ours.attributes == theirs.attributes == {schema.SIGNATURE_NAME: "sig"}


def test_rows_stack_into_the_columns_they_make() -> None:
    rows = [{"floats": [1.5, 2.0], "words": "a"}, {"floats": [3.0, 4.5], "words": "bc"}]
    ours = rest({"instances": rows}, "/v1/models/m/labels/canary:predict")
    theirs = grpc_predict(
        {"floats": [[1.5, 2.0], [3.0, 4.5]], "words": np.array([b"a", b"bc"], dtype=object)},
        label="canary",
    )
    assert_same(ours.inputs, theirs.inputs)
    assert ours.version == ""
    assert (
        ours.attributes
        == theirs.attributes
        == {
            schema.SIGNATURE_NAME: "serving_default",
            schema.VERSION_LABEL: "canary",
        }
    )


def test_b64_values_are_bytes() -> None:
    raw = b"\x00\xffimage"
    encoded = {"b64": base64.b64encode(raw).decode()}
    ours = rest({"instances": [{"image": encoded}, {"image": encoded}]})
    assert_same(ours.inputs, grpc_predict({"image": np.array([raw, raw], dtype=object)}).inputs)
    unnamed = rest({"inputs": [encoded, "text"]})
    assert unnamed.inputs[UNNAMED_INPUT].tolist() == [raw, b"text"]


def test_unnamed_values_are_the_signatures_one_input() -> None:
    rows = rest({"instances": [[1.0, 2.0], [3.0, 4.0]]})
    columns = rest({"inputs": [[1.0, 2.0], [3.0, 4.0]]})
    for decoded in (rows, columns):
        assert list(decoded.inputs) == [UNNAMED_INPUT]
        assert decoded.inputs[UNNAMED_INPUT].dtype == np.float32
        assert decoded.inputs[UNNAMED_INPUT].shape == (2, 2)
    assert rest({"inputs": 7}).inputs[UNNAMED_INPUT].shape == ()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({}, "exactly one of `instances`"),
        ({"instances": [1], "inputs": [1]}, "exactly one of `instances`"),
        ({"instances": []}, "non-empty list"),
        ({"instances": {"x": 1}}, "non-empty list"),
        ({"instances": [{"x": 1}, {"y": 1}]}, "row 1 of `instances`"),
        ({"instances": [{"x": 1}, 2]}, "row 1 of `instances`"),
        ({"instances": [1, {"x": 2}]}, "mixes rows"),
        ({"instances": [{}]}, "name no input"),
        ({"inputs": {}}, "names no input"),
        ({"inputs": {"x": [[1, 2], [3]]}}, "not a tensor"),
        ({"inputs": {"x": [["a"], ["b", "c"]]}}, "not a tensor"),
        ({"inputs": {"x": [1, "a"]}}, "mixes strings and numbers"),
        ({"inputs": {"x": [1, True]}}, "mixes booleans"),
        ({"inputs": {"x": [1, None]}}, "null"),
        ({"inputs": {"x": [{"a": 1}]}}, "no `b64` value"),
        ({"inputs": {"x": {"b64": "***"}}}, "not base64"),
        ({"inputs": {"x": {"b64": 1}}}, "not a string"),
        ({"inputs": {"x": [2**70]}}, "not a tensor"),
        ({"inputs": {"x": 1}, "signature_name": 3}, "signature_name 3"),
    ],
)
def test_bad_rest_bodies_are_refused_with_a_reason(body: dict[str, Any], error: str) -> None:
    with pytest.raises(TfRestDecodeError, match=error):
        rest(body)


def test_a_rest_body_that_is_not_json() -> None:
    with pytest.raises(TfRestDecodeError, match="not JSON"):
        decode_rest_predict(pack(b"{", None))
    with pytest.raises(TfRestDecodeError, match="not a JSON object"):
        decode_rest_predict(pack(b"[]", None))
    with pytest.raises(TfRestDecodeError, match="packed"):
        decode_rest_predict(b"")


def test_grpc_clients_are_unaffected() -> None:
    """The HTTP decoders sit beside the gRPC ones: a gRPC message still decodes as before."""
    data = np.ones((1, 2), np.float32)
    message = request_bytes([make_input("x", "FP32", data)])
    assert_same(TRITON.decoders["ModelInfer"](message).inputs, {"x": data})
    assert isinstance(grpcclient.InferInput("x", [1], "FP32"), grpcclient.InferInput)
