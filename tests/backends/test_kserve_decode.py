"""Decoding `ModelInferRequest` bytes built by tritonclient (the real client's serialization)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from sidecar.backends.kserve_decode import (
    CONTENTS_FIELDS,
    KServeDecodeError,
    decode_model_infer_request,
    strip_grpc_prefix,
)

RAW_CASES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 7, 255]], dtype=np.uint8),
    "UINT16": np.array([[0, 7, 65535]], dtype=np.uint16),
    "UINT32": np.array([[0, 7, 2**32 - 1]], dtype=np.uint32),
    "UINT64": np.array([[0, 7, 2**64 - 1]], dtype=np.uint64),
    "INT8": np.array([[-128, 0, 127]], dtype=np.int8),
    "INT16": np.array([[-32768, 0, 32767]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], dtype=np.int64),
    "FP16": np.array([[-1.5, 0.0, 65504.0]], dtype=np.float16),
    "FP32": np.array([[-1.5, 0.1, 3.4e38]], dtype=np.float32),
    "FP64": np.array([[-1.5, 0.1, 1e300]], dtype=np.float64),
    "BYTES": np.array([[b"", b"caf\xc3\xa9", b"\x00\x01\x02"]], dtype=object),
}


def request_bytes(
    inputs: list[grpcclient.InferInput],
    *,
    model: str = "m",
    version: str = "",
    request_id: str = "",
    parameters: dict[str, object] | None = None,
    outputs: list[grpcclient.InferRequestedOutput] | None = None,
    priority: int = 0,
) -> bytes:
    message = _get_inference_request(
        model, inputs, version, request_id, outputs, 0, False, False, priority, None, parameters
    )
    return bytes(message.SerializeToString())


def grpc_frame(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


def make_input(name: str, datatype: str, data: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    return tensor


@pytest.mark.parametrize("datatype", sorted(RAW_CASES))
@pytest.mark.parametrize("framed", [False, True])
def test_raw_contents_every_datatype(datatype: str, framed: bool) -> None:
    data = RAW_CASES[datatype]
    body = request_bytes([make_input("x", datatype, data)], model="cnn", version="3")
    decoded = decode_model_infer_request(grpc_frame(body) if framed else body)
    assert (decoded.model_name, decoded.model_version) == ("cnn", "3")
    assert decoded.datatypes == {"x": datatype}
    got = decoded.inputs["x"]
    assert got.shape == data.shape
    if datatype == "BYTES":
        assert got.dtype == object and got.tolist() == data.tolist()
    else:
        assert got.dtype == data.dtype.newbyteorder("=")
        np.testing.assert_array_equal(got, data)


def bf16_input(name: str, data: np.ndarray) -> tuple[grpcclient.InferInput, np.ndarray]:
    """A BF16 input of float32 `data` and the float32 values its bits hold: since Triton's
    r26.06 the client takes `ml_dtypes.bfloat16` arrays (rounded to nearest); older clients
    (2.51 among them) took float32 and kept its 16 high bits."""
    try:
        import ml_dtypes

        bf16 = data.astype(ml_dtypes.bfloat16)
        return make_input(name, "BF16", bf16), bf16.astype(np.float32)
    except (ImportError, InferenceServerException):
        truncated = (data.view(np.uint32) & 0xFFFF0000).view(np.float32)
        return make_input(name, "BF16", data), truncated


def test_bf16_from_raw_is_widened_to_float32() -> None:
    data = np.array([[1.0, -2.5, 3.14159, 1e20]], dtype=np.float32)
    tensor, sent = bf16_input("x", data)
    decoded = decode_model_infer_request(request_bytes([tensor]))
    got = decoded.inputs["x"]
    assert decoded.datatypes == {"x": "BF16"} and got.dtype == np.float32
    np.testing.assert_array_equal(got, sent)
    np.testing.assert_allclose(got, data, rtol=1e-2)


def test_several_inputs_metadata_parameters_outputs() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[1], [2]], dtype=np.int64)
    body = request_bytes(
        [make_input("a", "FP32", a), make_input("b", "INT64", b)],
        model="add_sub",
        version="1",
        request_id="req-42",
        parameters={"tag": "x", "n": 3, "flag": True, "w": 0.5},
        outputs=[grpcclient.InferRequestedOutput("OUTPUT0")],
        priority=2,
    )
    decoded = decode_model_infer_request(body)
    assert decoded.request_id == "req-42"
    assert list(decoded.inputs) == ["a", "b"]
    np.testing.assert_array_equal(decoded.inputs["a"], a)
    np.testing.assert_array_equal(decoded.inputs["b"], b)
    assert decoded.parameters == {"tag": "x", "n": 3, "flag": True, "w": 0.5, "priority": 2}
    assert decoded.requested_outputs == ["OUTPUT0"]
    assert decoded.batch_size == 2


TYPED_CASES: dict[str, list[object]] = {
    "BOOL": [True, False, True, True],
    "INT8": [-128, 0, 5, 127],
    "INT16": [-32768, 0, 5, 32767],
    "INT32": [-(2**31), 0, 5, 2**31 - 1],
    "INT64": [-(2**63), 0, 5, 2**63 - 1],
    "UINT8": [0, 1, 5, 255],
    "UINT16": [0, 1, 5, 65535],
    "UINT32": [0, 1, 5, 2**32 - 1],
    "UINT64": [0, 1, 5, 2**64 - 1],
    "FP32": [-1.5, 0.0, 0.25, 2.0],
    "FP64": [-1.5, 0.0, 0.1, 1e300],
    "BYTES": [b"a", b"", b"\xff", b"long" * 10],
}


def typed_request(datatype: str, values: list[object], shape: list[int]) -> bytes:
    message = service_pb2.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="x", datatype=datatype, shape=shape)
    getattr(tensor.contents, CONTENTS_FIELDS[datatype]).extend(values)
    return bytes(message.SerializeToString())


@pytest.mark.parametrize("datatype", sorted(TYPED_CASES))
def test_typed_contents_every_datatype(datatype: str) -> None:
    values = TYPED_CASES[datatype]
    decoded = decode_model_infer_request(typed_request(datatype, values, [2, 2]))
    got = decoded.inputs["x"]
    assert got.shape == (2, 2)
    if datatype == "BYTES":
        assert got.ravel().tolist() == values
    else:
        expected = np.array(values, dtype=RAW_CASES[datatype].dtype).reshape(2, 2)
        assert got.dtype == expected.dtype
        if datatype == "FP32":
            np.testing.assert_array_equal(got, expected)
        else:
            assert got.ravel().tolist() == expected.ravel().tolist()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (typed_request("INT32", [1, 2, 3], [2, 2]), "4 elements.*3 values"),
        (typed_request("INT8", [1, 300, 3, 4], [2, 2]), "does not fit INT8"),
        (typed_request("UINT8", [1, 256, 3, 4], [2, 2]), "does not fit UINT8"),
        (b"\x00\x00\x00\x00\x09abc", "frame says 9"),
        (b"\x0a\xff\xff", "not a ModelInferRequest"),
    ],
)
def test_clear_errors(body: bytes, message: str) -> None:
    with pytest.raises(KServeDecodeError, match=message):
        decode_model_infer_request(body)


def test_raw_size_mismatch_names_the_input() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="img", datatype="FP32", shape=[1, 3])
    message.raw_input_contents.append(np.zeros(2, np.float32).tobytes())
    with pytest.raises(KServeDecodeError, match=r"'img'.*12 bytes.*holds 8 bytes"):
        decode_model_infer_request(message.SerializeToString())


def test_raw_bytes_wrong_count_and_truncated() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="s", datatype="BYTES", shape=[3])
    two = serialize_byte_tensor(np.array([b"a", b"b"], dtype=object)).item()
    message.raw_input_contents.append(two)
    with pytest.raises(KServeDecodeError, match=r"3 elements.*holds 2"):
        decode_model_infer_request(message.SerializeToString())
    message.raw_input_contents[0] = two[:-1]
    with pytest.raises(KServeDecodeError, match="claims 1 bytes"):
        decode_model_infer_request(message.SerializeToString())


def test_raw_contents_count_must_match_inputs() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="a", datatype="FP32", shape=[1])
    message.inputs.add(name="b", datatype="FP32", shape=[1])
    message.raw_input_contents.append(np.zeros(1, np.float32).tobytes())
    with pytest.raises(KServeDecodeError, match="2 inputs but 1 raw"):
        decode_model_infer_request(message.SerializeToString())


def test_fp16_typed_contents_not_possible_and_shared_memory_not_supported() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="h", datatype="FP16", shape=[1])
    with pytest.raises(KServeDecodeError, match="raw_input_contents"):
        decode_model_infer_request(message.SerializeToString())
    message = service_pb2.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="x", datatype="FP32", shape=[4])
    tensor.parameters["shared_memory_region"].string_param = "region0"
    with pytest.raises(KServeDecodeError, match=r"shared memory.*not supported"):
        decode_model_infer_request(message.SerializeToString())


def test_unknown_datatype_and_negative_shape() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="FP8", shape=[1])
    with pytest.raises(KServeDecodeError, match="'FP8'; expected one of"):
        decode_model_infer_request(message.SerializeToString())
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="FP32", shape=[-1])
    message.raw_input_contents.append(b"")
    with pytest.raises(KServeDecodeError, match="non-negative"):
        decode_model_infer_request(message.SerializeToString())


def test_compressed_grpc_message() -> None:
    import gzip

    body = request_bytes([make_input("x", "FP32", RAW_CASES["FP32"])])
    packed = gzip.compress(body)
    framed = b"\x01" + len(packed).to_bytes(4, "big") + packed
    assert strip_grpc_prefix(framed, "gzip") == body
    with pytest.raises(KServeDecodeError, match="compressed"):
        decode_model_infer_request(framed)
    decoded = decode_model_infer_request(framed, compression="gzip")
    np.testing.assert_array_equal(decoded.inputs["x"], RAW_CASES["FP32"])
