"""Decode a TF-Serving `PredictRequest` into named numpy arrays.

Runs in the profiling worker on the sampled copy of a Predict request (not on the hot path).
Each input is a `TensorProto`: either `tensor_content` (little-endian, row-major raw bytes) or
the typed value field of its dtype (`float_val`, `int_val`, `half_val`, ...). As in TensorFlow,
a typed field with fewer values than elements is padded with its last value (one value
broadcasts) and an empty one gives zeros. `tf.make_ndarray` does the decoding; this module
checks first what TensorFlow would silently truncate or zero-fill (a value field of the wrong
dtype, too many values, integers out of range, a short `tensor_content`) and reports it as a
`PredictDecodeError`. TensorFlow (and the protos of `tensorflow-serving-api`) load on first use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_SIGNATURE = "serving_default"
MAX_TENSOR_BYTES = 1 << 30  # one decoded input; TF-Serving's gRPC limit is far below

# TensorFlow DataType enum -> (name, the TensorProto value field that carries it)
DTYPES: dict[int, tuple[str, str]] = {
    1: ("DT_FLOAT", "float_val"),
    2: ("DT_DOUBLE", "double_val"),
    3: ("DT_INT32", "int_val"),
    4: ("DT_UINT8", "int_val"),
    5: ("DT_INT16", "int_val"),
    6: ("DT_INT8", "int_val"),
    7: ("DT_STRING", "string_val"),
    8: ("DT_COMPLEX64", "scomplex_val"),
    9: ("DT_INT64", "int64_val"),
    10: ("DT_BOOL", "bool_val"),
    14: ("DT_BFLOAT16", "half_val"),
    17: ("DT_UINT16", "int_val"),
    18: ("DT_COMPLEX128", "dcomplex_val"),
    19: ("DT_HALF", "half_val"),
    22: ("DT_UINT32", "uint32_val"),
    23: ("DT_UINT64", "uint64_val"),
    24: ("DT_FLOAT8_E5M2", "float8_val"),
    25: ("DT_FLOAT8_E4M3FN", "float8_val"),
    29: ("DT_INT4", "int_val"),
    30: ("DT_UINT4", "int_val"),
}
VALUE_FIELDS = ("half_val", "float_val", "double_val", "int_val", "string_val", "scomplex_val",
                "int64_val", "bool_val", "dcomplex_val", "resource_handle_val", "variant_val",
                "uint32_val", "uint64_val", "float8_val")  # fmt: skip
HALF_BITS = (0, 0xFFFF)  # half_val holds float16 / bfloat16 bit patterns in int32s


class PredictDecodeError(ValueError):
    """The bytes are not a decodable `PredictRequest` (the message says what is wrong)."""


@dataclass
class DecodedPredict:
    """A `PredictRequest` as arrays; `signature_name` is `serving_default` when left empty."""

    model_name: str
    model_version: str = ""  # model_spec.version, "" when not set
    version_label: str = ""
    signature_name: str = DEFAULT_SIGNATURE
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # input -> `DT_FLOAT`, ...
    output_filter: list[str] = field(default_factory=list)

    @property
    def batch_size(self) -> int | None:
        """Leading dimension shared by all inputs, if any (a guess: signatures decide)."""
        leading = {a.shape[0] for a in self.inputs.values() if a.ndim > 0}
        return leading.pop() if len(leading) == 1 else None


def _tensorflow() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def _shape(name: str, proto: Any) -> tuple[int, ...]:
    if proto.tensor_shape.unknown_rank:
        raise PredictDecodeError(f"input {name!r} has an unknown rank; give its shape")
    shape = tuple(int(d.size) for d in proto.tensor_shape.dim)
    if any(d < 0 for d in shape):
        raise PredictDecodeError(
            f"input {name!r} has shape {list(shape)}; request shapes must be non-negative"
        )
    return shape


def _check_size(name: str, shape: tuple[int, ...], itemsize: int) -> int:
    count = math.prod(shape)
    if count * itemsize > MAX_TENSOR_BYTES:
        raise PredictDecodeError(
            f"input {name!r} has shape {list(shape)}: {count} elements are more than the "
            f"{MAX_TENSOR_BYTES >> 20} MiB a replayed input may take"
        )
    return count


def _decode_string_content(name: str, content: bytes, count: int) -> np.ndarray:
    """TensorFlow's `EncodeStringList`: `count` varint32 lengths, then the bytes."""
    lengths, pos = [], 0
    for _ in range(count):
        value, shift = 0, 0
        while True:
            if pos >= len(content) or shift > 28:
                raise PredictDecodeError(
                    f"input {name!r}: tensor_content does not hold {count} string lengths"
                )
            byte = content[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        lengths.append(value)
    if pos + sum(lengths) != len(content):
        raise PredictDecodeError(
            f"input {name!r}: tensor_content holds {len(content) - pos} string bytes after "
            f"the lengths, the lengths say {sum(lengths)}"
        )
    out = np.empty(count, dtype=object)
    for i, length in enumerate(lengths):
        out[i] = content[pos : pos + length]
        pos += length
    return out


def _check_values(name: str, proto: Any, dtype_name: str, value_field: str, count: int) -> None:
    """Reject what TensorFlow would truncate or zero-fill instead of decoding."""
    populated = [f for f in VALUE_FIELDS if len(getattr(proto, f))]
    if proto.tensor_content:
        if populated:
            raise PredictDecodeError(
                f"input {name!r} has tensor_content and {', '.join(populated)}; "
                "a tensor carries its values in one of them"
            )
        return
    if populated and populated != [value_field]:
        raise PredictDecodeError(
            f"input {name!r} is {dtype_name} (values in {value_field}) but carries "
            f"{', '.join(populated)}"
        )
    values = getattr(proto, value_field)
    per_element = 2 if value_field in ("scomplex_val", "dcomplex_val") else 1
    if len(values) % per_element:
        raise PredictDecodeError(
            f"input {name!r}: {value_field} holds {len(values)} numbers, not (real, imag) pairs"
        )
    if len(values) > count * per_element:
        raise PredictDecodeError(
            f"input {name!r} has shape {list(_shape(name, proto))} ({count} elements) but "
            f"{value_field} holds {len(values) // per_element} values"
        )


def _check_range(name: str, values: Any, value_field: str, dtype: np.dtype[Any]) -> None:
    """Integers (and half_val's bit patterns) must fit the dtype: TensorFlow would wrap them."""
    import ml_dtypes  # TensorFlow's own dependency; its iinfo knows int4 too

    if value_field == "half_val":
        low, high = HALF_BITS
    elif value_field == "int_val":
        info = ml_dtypes.iinfo(dtype)
        low, high = int(info.min), int(info.max)
    else:
        return
    if values and (min(values) < low or max(values) > high):
        raise PredictDecodeError(
            f"input {name!r}: a value in {value_field} does not fit {dtype} [{low}, {high}]"
        )


def _decode_tensor(name: str, proto: Any) -> tuple[np.ndarray, str]:
    if proto.dtype not in DTYPES:
        known = ", ".join(n for n, _ in DTYPES.values())
        raise PredictDecodeError(
            f"input {name!r} has dtype {proto.dtype}, which cannot be replayed (one of {known})"
        )
    dtype_name, value_field = DTYPES[proto.dtype]
    shape = _shape(name, proto)
    tf = _tensorflow()
    dtype = np.dtype(tf.dtypes.as_dtype(proto.dtype).as_numpy_dtype)
    count = _check_size(name, shape, max(dtype.itemsize, 1))
    _check_values(name, proto, dtype_name, value_field, count)
    if proto.tensor_content and dtype_name == "DT_STRING":
        return _decode_string_content(name, proto.tensor_content, count).reshape(shape), dtype_name
    if proto.tensor_content and len(proto.tensor_content) != count * dtype.itemsize:
        raise PredictDecodeError(
            f"input {name!r}: shape {list(shape)} of {dtype_name} needs "
            f"{count * dtype.itemsize} bytes, tensor_content has {len(proto.tensor_content)}"
        )
    if not proto.tensor_content:
        _check_range(name, getattr(proto, value_field), value_field, dtype)
    try:
        array = tf.make_ndarray(proto)
    except (ValueError, TypeError, OverflowError) as exc:
        raise PredictDecodeError(f"input {name!r} ({dtype_name}): {exc}") from None
    return np.asarray(array).reshape(shape), dtype_name


def decode_predict_request(message: bytes) -> DecodedPredict:
    """Parse a serialized `PredictRequest` (without the gRPC prefix) into arrays."""
    _tensorflow()
    from google.protobuf import unknown_fields
    from google.protobuf.message import DecodeError
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    try:
        request.ParseFromString(bytes(message))
    except DecodeError as exc:
        raise PredictDecodeError(f"bytes are not a PredictRequest: {exc}") from None
    if len(unknown_fields.UnknownFieldSet(request)):
        raise PredictDecodeError("bytes are not a PredictRequest: they carry unknown fields")
    spec = request.model_spec
    if not spec.name:
        raise PredictDecodeError("the PredictRequest names no model (model_spec.name is empty)")
    if not request.inputs:
        raise PredictDecodeError(f"the PredictRequest for {spec.name!r} has no inputs")
    decoded = DecodedPredict(
        model_name=spec.name,
        model_version=str(spec.version.value) if spec.HasField("version") else "",
        version_label=spec.version_label,
        signature_name=spec.signature_name or DEFAULT_SIGNATURE,
        output_filter=list(request.output_filter),
    )
    for name in sorted(request.inputs):
        decoded.inputs[name], decoded.dtypes[name] = _decode_tensor(name, request.inputs[name])
    return decoded
