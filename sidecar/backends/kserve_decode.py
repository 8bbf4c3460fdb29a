"""Decode a KServe v2 `inference.ModelInferRequest` into named numpy arrays.

Runs in the profiling worker on the sampled copy of a request's bytes (not on the hot path).
Inputs come either all from `raw_input_contents` (little-endian, row-major; BYTES elements are
4-byte little-endian length-prefixed) or from each input's typed `contents`. FP16 and BF16 only
exist as raw bytes; BF16 is returned widened to float32 (numpy has no bfloat16), with the
datatype still reported as `BF16`.
"""

from __future__ import annotations

import gzip
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

GRPC_PREFIX_BYTES = 5

# KServe datatype -> numpy dtype (little-endian, as on the wire)
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),  # raw bits; widened to float32 after reading
    "BYTES": np.dtype(object),
}

# KServe datatype -> the `InferTensorContents` field that may carry it
CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

SHARED_MEMORY_PARAMETER = "shared_memory_region"


class KServeDecodeError(ValueError):
    """The bytes are not a decodable `ModelInferRequest` (the message says what is wrong)."""


@dataclass
class DecodedRequest:
    """A `ModelInferRequest` as arrays: `inputs` in request order, `datatypes` the KServe names."""

    model_name: str
    model_version: str
    request_id: str
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    datatypes: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    input_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    requested_outputs: list[str] = field(default_factory=list)

    @property
    def batch_size(self) -> int | None:
        """Leading dimension shared by all inputs, if any (a guess: configs decide batching)."""
        leading = {a.shape[0] for a in self.inputs.values() if a.ndim > 0}
        return leading.pop() if len(leading) == 1 else None


def strip_grpc_prefix(data: bytes, compression: str | None = None) -> bytes:
    """The protobuf bytes of a message, with or without gRPC's 5-byte length prefix.

    A protobuf message never starts with byte 0 or 1 (field number 0 is invalid), so a leading
    0/1 followed by the right big-endian length is the gRPC prefix. A compressed message
    (flag 1) needs `compression` (the call's `grpc-encoding`: `gzip` or `deflate`).
    """
    if len(data) < GRPC_PREFIX_BYTES or data[0] not in (0, 1):
        return bytes(data)
    length = int.from_bytes(data[1:5], "big")
    if length != len(data) - GRPC_PREFIX_BYTES:
        raise KServeDecodeError(
            f"gRPC frame says {length} message bytes but {len(data) - GRPC_PREFIX_BYTES} follow; "
            "pass exactly one complete message"
        )
    body = bytes(data[GRPC_PREFIX_BYTES:])
    if data[0] == 0:
        return body
    if compression == "gzip":
        try:
            return gzip.decompress(body)
        except (OSError, EOFError, zlib.error) as exc:
            raise KServeDecodeError(f"bad gzip-compressed gRPC message: {exc}") from None
    if compression == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error as exc:
            raise KServeDecodeError(f"bad deflate-compressed gRPC message: {exc}") from None
    raise KServeDecodeError(
        f"the gRPC message is compressed (grpc-encoding {compression or 'unknown'}); "
        "only gzip and deflate can be decoded"
    )


def parameter_value(parameter: Any) -> Any:
    """The Python value of an `InferParameter` (None when unset)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def _parameters(mapping: Any) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in mapping.items()}


def _shape(tensor: Any) -> tuple[int, ...]:
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise KServeDecodeError(
            f"input {tensor.name!r} has shape {list(shape)}; request shapes must be non-negative"
        )
    return shape


def _decode_bytes_elements(raw: bytes, name: str) -> list[bytes]:
    """BYTES tensors on the wire: each element is a 4-byte little-endian length, then data."""
    out: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise KServeDecodeError(
                f"input {name!r}: BYTES data ends inside a 4-byte length prefix at offset {offset}"
            )
        size = int.from_bytes(raw[offset : offset + 4], "little")
        offset += 4
        if offset + size > len(raw):
            raise KServeDecodeError(
                f"input {name!r}: BYTES element at offset {offset - 4} claims {size} bytes but "
                f"only {len(raw) - offset} remain"
            )
        out.append(raw[offset : offset + size])
        offset += size
    return out


def _object_array(elements: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(shape)


def _bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def decode_raw(raw: bytes, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """One input from its `raw_input_contents` entry."""
    count = math.prod(shape)
    if datatype == "BYTES":
        elements = _decode_bytes_elements(raw, name)
        if len(elements) != count:
            raise KServeDecodeError(
                f"input {name!r} has shape {list(shape)} ({count} elements) but its raw BYTES "
                f"data holds {len(elements)} elements"
            )
        return _object_array(elements, shape)
    dtype = _dtype(datatype, name)
    if len(raw) != count * dtype.itemsize:
        raise KServeDecodeError(
            f"input {name!r} has shape {list(shape)} ({count} {datatype} elements = "
            f"{count * dtype.itemsize} bytes) but its raw_input_contents holds {len(raw)} bytes"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if datatype == "BF16":
        return _bf16_to_float32(array)
    return array.astype(dtype.newbyteorder("="), copy=True)


def _dtype(datatype: str, name: str) -> np.dtype[Any]:
    try:
        return NUMPY_DTYPES[datatype]
    except KeyError:
        known = ", ".join(NUMPY_DTYPES)
        raise KServeDecodeError(
            f"input {name!r} has datatype {datatype!r}; expected one of {known}"
        ) from None


def decode_contents(tensor: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """One input from its typed `contents` field."""
    name = tensor.name
    field_name = CONTENTS_FIELDS.get(datatype)
    if field_name is None:
        _dtype(datatype, name)  # unknown datatypes get the list of known ones
        raise KServeDecodeError(
            f"input {name!r} is {datatype}, which has no typed contents field; "
            "send it in raw_input_contents"
        )
    populated = [f.name for f, _ in tensor.contents.ListFields()]
    if populated and populated != [field_name]:
        raise KServeDecodeError(
            f"input {name!r} is {datatype} (expects contents.{field_name}) but carries "
            f"contents.{', contents.'.join(populated)}"
        )
    values = list(getattr(tensor.contents, field_name))
    count = math.prod(shape)
    if len(values) != count:
        raise KServeDecodeError(
            f"input {name!r} has shape {list(shape)} ({count} elements) but "
            f"contents.{field_name} holds {len(values)} values"
        )
    if datatype == "BYTES":
        return _object_array(values, shape)
    dtype = NUMPY_DTYPES[datatype].newbyteorder("=")
    if dtype.kind in "iu":
        wide = np.array(values, dtype=np.int64 if dtype.kind == "i" else np.uint64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise KServeDecodeError(
                f"input {name!r}: a value in contents.{field_name} does not fit {datatype} "
                f"[{info.min}, {info.max}]"
            )
        return wide.astype(dtype).reshape(shape)
    return np.array(values, dtype=dtype).reshape(shape)


def decode_model_infer_request(data: bytes, *, compression: str | None = None) -> DecodedRequest:
    """Parse a serialized `ModelInferRequest` (optionally gRPC-framed) into arrays."""
    message = service_pb2.ModelInferRequest()
    try:
        message.ParseFromString(strip_grpc_prefix(data, compression))
    except DecodeError as exc:
        raise KServeDecodeError(f"bytes are not a ModelInferRequest: {exc}") from None
    request = DecodedRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        request_id=message.id,
        parameters=_parameters(message.parameters),
        requested_outputs=[output.name for output in message.outputs],
    )
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(message.inputs):
        raise KServeDecodeError(
            f"the request has {len(message.inputs)} inputs but {len(raw)} raw_input_contents "
            "entries; when raw contents are used every input needs exactly one"
        )
    for position, tensor in enumerate(message.inputs):
        name = tensor.name
        if name in request.inputs:
            raise KServeDecodeError(f"input {name!r} appears twice in the request")
        input_parameters = _parameters(tensor.parameters)
        if SHARED_MEMORY_PARAMETER in input_parameters:
            raise KServeDecodeError(
                f"input {name!r} is passed in shared memory region "
                f"{input_parameters[SHARED_MEMORY_PARAMETER]!r}; its data is not in the request, "
                "so it cannot be decoded (not supported)"
            )
        datatype = tensor.datatype.upper()
        shape = _shape(tensor)
        if raw:
            if tensor.HasField("contents") and tensor.contents.ListFields():
                raise KServeDecodeError(
                    f"input {name!r} has typed contents while the request also uses "
                    "raw_input_contents; a request must use one or the other"
                )
            array = decode_raw(raw[position], datatype, shape, name)
        else:
            array = decode_contents(tensor, datatype, shape)
        request.inputs[name] = array
        request.datatypes[name] = datatype
        if input_parameters:
            request.input_parameters[name] = input_parameters
    return request
