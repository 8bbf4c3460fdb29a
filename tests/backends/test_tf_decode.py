"""Decoding `PredictRequest` bytes: every dtype round-trips through both encodings (tensors built
by TensorFlow's `make_tensor_proto`, or the typed value fields by hand), checked against
TensorFlow's own C++ decoding (`tf.io.parse_tensor`, what TF-Serving runs) where it has a
kernel for the dtype; malformed requests raise `PredictDecodeError`."""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sidecar.backends.tf_decode import (
    DTYPES,
    MAX_TENSOR_BYTES,
    DecodedPredict,
    PredictDecodeError,
    decode_predict_request,
)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
predict_pb2 = pytest.importorskip("tensorflow_serving.apis.predict_pb2")
tensor_pb2 = pytest.importorskip("tensorflow.core.framework.tensor_pb2")

SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# dtypes TensorFlow's ParseTensor (Tensor::FromProto) has a CPU kernel for
ORACLE = {"DT_FLOAT", "DT_DOUBLE", "DT_INT32", "DT_UINT8", "DT_INT16", "DT_INT8", "DT_STRING",
          "DT_COMPLEX64", "DT_INT64", "DT_BOOL", "DT_BFLOAT16", "DT_UINT16", "DT_COMPLEX128",
          "DT_HALF", "DT_UINT32", "DT_UINT64"}  # fmt: skip


def numpy_dtype(enum: int) -> np.dtype[Any]:
    return np.dtype(tf.dtypes.as_dtype(enum).as_numpy_dtype)


@st.composite
def arrays(draw: st.DrawFn, enum: int) -> np.ndarray:
    """Any array of the dtype: every bit pattern for floats (NaNs included), full int ranges."""
    dtype = numpy_dtype(enum)
    shape = draw(SHAPES)
    name = DTYPES[enum][0]
    if name == "DT_STRING":
        return draw(hnp.arrays(object, shape, elements=st.binary(max_size=8)))
    if name in ("DT_INT4", "DT_UINT4"):
        info = ml_dtypes.iinfo(dtype)
        ints = st.integers(int(info.min), int(info.max))
        return draw(hnp.arrays(np.int8, shape, elements=ints)).astype(dtype)
    if name == "DT_BOOL":
        return draw(hnp.arrays(np.bool_, shape))
    if name.startswith("DT_COMPLEX"):
        part = np.float32 if name == "DT_COMPLEX64" else np.float64
        pairs = draw(hnp.arrays(part, (*shape, 2)))  # (real, imag): any floats, NaNs too
        return np.ascontiguousarray(pairs).view(dtype).reshape(shape)
    if dtype.kind in "iu":
        return draw(hnp.arrays(dtype, shape))
    bits = np.dtype(f"<u{dtype.itemsize}")
    return draw(hnp.arrays(bits, shape)).view(dtype)  # floats: every bit pattern


def through_python_floats(array: np.ndarray) -> np.ndarray:
    """`array` as the typed value fields can hold it: float32 values (`float_val`,
    `scomplex_val`) are set from Python floats (C doubles), and widening a signalling NaN to
    a double quiets it, so the proto itself holds the quiet NaN. `tensor_content` keeps every
    bit, and so does every other typed field."""
    if array.dtype not in (np.float32, np.complex64):
        return array
    bits = np.ascontiguousarray(array).reshape(-1).view(np.uint32).copy()
    signalling = (bits & 0x7F800000 == 0x7F800000) & (bits & 0x007FFFFF != 0)
    bits[signalling] |= 0x00400000
    return bits.view(array.dtype).reshape(array.shape)


def shape_proto(shape: tuple[int, ...]) -> dict[str, Any]:
    return {"dim": [{"size": d} for d in shape]}


def encode_strings(values: list[bytes]) -> bytes:
    """TensorFlow's `EncodeStringList`: varint lengths, then the bytes."""
    out = bytearray()
    for value in values:
        n = len(value)
        while n >= 0x80:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out) + b"".join(values)


def content_proto(array: np.ndarray, enum: int) -> Any:
    """`tensor_content` form: TensorFlow's own where it uses it, else the same bytes by hand."""
    proto = tf.make_tensor_proto(array, dtype=tf.dtypes.as_dtype(enum))
    if not proto.tensor_content and array.size:
        for name in [f.name for f, _ in proto.ListFields()]:
            if name.endswith("_val"):
                proto.ClearField(name)
        flat = list(array.reshape(-1))
        proto.tensor_content = (
            encode_strings(flat) if array.dtype == object else np.ascontiguousarray(array).tobytes()
        )
    return proto


def typed_proto(array: np.ndarray, enum: int, values: np.ndarray | None = None) -> Any:
    """The typed value field of the dtype, filled by hand (`values`: fewer, for broadcasting)."""
    name, value_field = DTYPES[enum]
    flat = (array if values is None else values).reshape(-1)
    proto = tensor_pb2.TensorProto(dtype=enum, tensor_shape=shape_proto(array.shape))
    if value_field == "half_val":
        proto.half_val.extend(flat.view(np.uint16).tolist())
    elif value_field == "float8_val":
        proto.float8_val = flat.view(np.uint8).tobytes()
    elif value_field in ("scomplex_val", "dcomplex_val"):
        getattr(proto, value_field).extend(np.stack([flat.real, flat.imag], -1).reshape(-1))
    elif name in ("DT_INT4", "DT_UINT4"):
        proto.int_val.extend(flat.astype(np.int8).tolist())
    else:
        getattr(proto, value_field).extend(flat.tolist())
    return proto


def request(*, model: str = "m", **inputs: Any) -> bytes:
    message = predict_pb2.PredictRequest()
    message.model_spec.name = model
    for name, proto in inputs.items():
        message.inputs[name].CopyFrom(proto)
    return bytes(message.SerializeToString())


def assert_same(decoded: np.ndarray, expected: np.ndarray) -> None:
    assert decoded.shape == expected.shape
    assert decoded.dtype == expected.dtype or expected.dtype == object
    if expected.dtype == object:
        assert decoded.dtype == object and decoded.tolist() == expected.tolist()
    else:  # bit for bit: NaN payloads too
        raw = np.dtype(f"u{expected.dtype.itemsize // (2 if expected.dtype.kind == 'c' else 1)}")
        np.testing.assert_array_equal(as_bits(decoded, raw), as_bits(expected, raw))


def as_bits(array: np.ndarray, raw: np.dtype[Any]) -> np.ndarray:
    if array.dtype.kind == "c":
        return np.stack([array.real, array.imag]).view(raw)
    return np.ascontiguousarray(array).reshape(-1).view(raw)


def decode_one(proto: Any) -> np.ndarray:
    decoded = decode_predict_request(request(x=proto))
    return decoded.inputs["x"]


def parse_tensor(proto: Any) -> np.ndarray:
    """TensorFlow's C++ decoding of a TensorProto (`Tensor::FromProto`)."""
    dtype = tf.dtypes.as_dtype(proto.dtype)
    value = tf.io.parse_tensor(proto.SerializeToString(), out_type=dtype).numpy()
    return np.asarray(value, dtype=object if dtype == tf.string else None)


DTYPE_ENUMS = pytest.mark.parametrize("enum", sorted(DTYPES), ids=lambda e: DTYPES[e][0])


@DTYPE_ENUMS
@PROPERTY
@given(data=st.data())
def test_tensor_content_round_trips(enum: int, data: st.DataObject) -> None:
    array = data.draw(arrays(enum))
    proto = content_proto(array, enum)
    assert_same(decode_one(proto), array)
    if DTYPES[enum][0] in ORACLE:
        assert_same(parse_tensor(proto), array)


@DTYPE_ENUMS
@PROPERTY
@given(data=st.data())
def test_typed_value_fields_round_trip(enum: int, data: st.DataObject) -> None:
    array = through_python_floats(data.draw(arrays(enum)))
    proto = typed_proto(array, enum)
    assert_same(decode_one(proto), array)
    if DTYPES[enum][0] in ORACLE:
        assert_same(parse_tensor(proto), array)


@DTYPE_ENUMS
@PROPERTY
@given(data=st.data())
def test_a_short_value_list_is_padded_with_its_last_value_as_in_tensorflow(
    enum: int, data: st.DataObject
) -> None:
    array = through_python_floats(data.draw(arrays(enum).filter(lambda a: a.size > 0)))
    given_count = data.draw(st.integers(1, array.size))
    flat = array.reshape(-1)
    expected = np.concatenate([flat[:given_count], np.repeat(flat[given_count - 1 :][:1],
                              array.size - given_count)]).reshape(array.shape)  # fmt: skip
    proto = typed_proto(array, enum, values=flat[:given_count])
    assert_same(decode_one(proto), expected)
    if DTYPES[enum][0] in ORACLE:
        assert_same(parse_tensor(proto), expected)


def test_a_signalling_nan_in_float_val_decodes_as_the_proto_holds_it() -> None:
    """Found by the property test above: float32 sNaN 0x7F800001 drawn, the proto held the
    quiet 0x7FC00001 (set through a Python float), and the expectation must say so."""
    snan = np.array([0x7F800001], np.uint32).view(np.float32)
    proto = typed_proto(snan, 1)
    quiet = through_python_floats(snan)
    assert quiet.view(np.uint32)[0] == 0x7FC00001
    assert_same(decode_one(proto), quiet)
    assert_same(parse_tensor(proto), quiet)


def test_one_value_broadcasts_and_no_values_give_zeros() -> None:
    one = tensor_pb2.TensorProto(dtype=1, tensor_shape=shape_proto((2, 3)), float_val=[2.5])
    np.testing.assert_array_equal(decode_one(one), np.full((2, 3), 2.5, np.float32))
    none = tensor_pb2.TensorProto(dtype=9, tensor_shape=shape_proto((4,)))
    np.testing.assert_array_equal(decode_one(none), np.zeros(4, np.int64))
    scalar = tensor_pb2.TensorProto(dtype=7, string_val=[b"hi"])
    assert decode_one(scalar).shape == () and decode_one(scalar).item() == b"hi"


def test_string_tensor_content_matches_tensorflow() -> None:
    values = [b"", b"a" * 200, "café".encode(), b"\x00\xff"]
    proto = tensor_pb2.TensorProto(
        dtype=7, tensor_shape=shape_proto((2, 2)), tensor_content=encode_strings(values)
    )
    assert decode_one(proto).tolist() == parse_tensor(proto).tolist() == [values[:2], values[2:]]


def test_the_request_fields_are_decoded() -> None:
    message = predict_pb2.PredictRequest()
    message.model_spec.name = "keras_cnn"
    message.model_spec.version.value = 3
    message.model_spec.signature_name = "predict_images"
    message.output_filter.extend(["output_0", "logits"])
    message.inputs["b"].CopyFrom(tf.make_tensor_proto(np.ones((2, 4), np.float32)))
    message.inputs["a"].CopyFrom(tf.make_tensor_proto(np.arange(2, dtype=np.int64)))
    decoded = decode_predict_request(message.SerializeToString())
    assert isinstance(decoded, DecodedPredict)
    assert (decoded.model_name, decoded.model_version, decoded.version_label) == (
        "keras_cnn", "3", "",
    )  # fmt: skip
    assert decoded.signature_name == "predict_images"
    assert decoded.output_filter == ["output_0", "logits"]
    assert list(decoded.inputs) == ["a", "b"] and decoded.batch_size == 2
    assert decoded.dtypes == {"a": "DT_INT64", "b": "DT_FLOAT"}

    labelled = predict_pb2.PredictRequest()
    labelled.model_spec.name = "m"
    labelled.model_spec.version_label = "stable"
    labelled.inputs["x"].CopyFrom(tf.make_tensor_proto(np.float32(1)))
    decoded = decode_predict_request(labelled.SerializeToString())
    assert (decoded.model_version, decoded.version_label) == ("", "stable")
    assert decoded.signature_name == "serving_default" and decoded.batch_size is None


def kserve_request() -> bytes:
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="FP32", shape=[1])
    message.raw_input_contents.append(b"\0\0\0\0")
    return bytes(message.SerializeToString())


def tensor(dtype: int, shape: tuple[int, ...] = (2,), **values: Any) -> Any:
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape_proto(shape), **values)


MALFORMED = {
    "garbage": (b"\xff\xff\xff", "not a PredictRequest"),
    "a KServe request": (kserve_request(), "not a PredictRequest"),
    "unknown fields": (request(x=tensor(1, float_val=[1])) + b"\xa0\x06\x01", "unknown fields"),
    "no model": (request(model="", x=tensor(1, float_val=[1])), "names no model"),
    "no inputs": (request(), "has no inputs"),
    "short tensor_content": (request(x=tensor(1, tensor_content=b"\0" * 7)), "needs 8 bytes"),
    "long tensor_content": (request(x=tensor(3, tensor_content=b"\0" * 12)), "needs 8 bytes"),
    "unknown dtype": (request(x=tensor(99, float_val=[1])), "dtype 99"),
    "invalid dtype": (request(x=tensor(0, float_val=[1])), "dtype 0"),
    "quantized dtype": (request(x=tensor(11, int_val=[1])), "dtype 11"),
    "resource dtype": (request(x=tensor(20)), "dtype 20"),
    "negative dim": (request(x=tensor(1, (2, -1), float_val=[1])), "non-negative"),
    "unknown rank": (
        request(x=tensor_pb2.TensorProto(dtype=1, tensor_shape={"unknown_rank": True})),
        "unknown rank",
    ),
    "shape too large": (request(x=tensor(1, (1 << 20, 1 << 20), float_val=[1])), "MiB"),
    "too many values": (request(x=tensor(1, (2,), float_val=[1, 2, 3])), "holds 3 values"),
    "wrong value field": (request(x=tensor(1, int_val=[1, 2])), "carries int_val"),
    "content and values": (
        request(x=tensor(1, float_val=[1, 2], tensor_content=b"\0" * 8)),
        "tensor_content and float_val",
    ),
    "int8 out of range": (request(x=tensor(6, int_val=[1, 300])), "does not fit int8"),
    "uint16 negative": (request(x=tensor(17, int_val=[-1])), "does not fit uint16"),
    "half bits out of range": (request(x=tensor(19, half_val=[70000])), "does not fit"),
    "odd complex": (request(x=tensor(8, scomplex_val=[1, 2, 3])), "(real, imag) pairs"),
    "string content cut short": (
        request(x=tensor(7, tensor_content=encode_strings([b"ab", b"c"])[:-1])),
        "string bytes",
    ),
    "string lengths missing": (request(x=tensor(7, tensor_content=b"\x81")), "string lengths"),
}


@pytest.mark.parametrize(("message", "reason"), MALFORMED.values(), ids=list(MALFORMED))
def test_malformed_requests_raise_a_clear_error(message: bytes, reason: str) -> None:
    with pytest.raises(PredictDecodeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode_predict_request(message)


@PROPERTY
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_the_decode_error(message: bytes) -> None:
    try:
        decoded = decode_predict_request(message)
    except PredictDecodeError:
        return
    assert decoded.model_name and decoded.inputs  # what a replay needs, or an error


def test_the_size_limit_counts_bytes_not_elements() -> None:
    fits = MAX_TENSOR_BYTES // 8
    with pytest.raises(PredictDecodeError, match="MiB"):
        decode_predict_request(request(x=tensor(2, (fits + 1,), double_val=[1])))
