"""Decode a KServe v2 HTTP inference request (Triton's `POST /v2/models/{m}/infer`) into arrays.

Runs in the profiling worker on a sampled request packed by `http_message.pack`. The body is a
JSON object (`inputs`: name, shape, datatype, and either `data` or, in Triton's binary-tensor
extension, `parameters.binary_data_size`), followed where `Inference-Header-Content-Length`
says so by the binary tensors in the order of the inputs that have them. Binary tensors are in
the layout of the gRPC request's `raw_input_contents`, so the arrays are the ones
`kserve_decode` gives for the same tensors: BYTES by `tritonclient.utils.
deserialize_bytes_tensor`, BF16 widened to float32 as `kserve_decode` does it (tritonclient's
`deserialize_bf16_tensor` gives the same numbers one element at a time, in Python), the rest
by `triton_to_np_dtype`. JSON `data` is nested or flat, in row-major order: numbers, `true`/
`false` for BOOL, strings (UTF-8) for BYTES; FP16 and BF16 only as binary data, as Triton
reads them (it answers 400 to either in JSON). The model version is read from the path
(`/versions/{v}`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from sidecar.backends.base import DecodedInputs
from sidecar.backends.http_message import HttpMessageError, target_path, unpack
from sidecar.backends.kserve_decode import NUMPY_DTYPES, SHARED_MEMORY_PARAMETER

BINARY_DATA_SIZE = "binary_data_size"
# datatypes Triton's HTTP endpoint does not read from JSON `data` (it answers 400): a request
# that sends them so was never run, so it is not replayed either
JSON_REFUSED = frozenset({"FP16", "BF16"})
_VERSION = re.compile(r"/versions/([0-9]+)/infer")


class KServeHttpDecodeError(ValueError):
    """The request is not a decodable KServe v2 HTTP inference request (the message says why)."""


def decode_http_infer(message: bytes) -> DecodedInputs:
    """A packed HTTP inference request's inputs, in request order, and the version its path
    names ("" where none)."""
    try:
        http = unpack(message)
    except HttpMessageError as exc:
        raise KServeHttpDecodeError(str(exc)) from None
    request = _json(http.json)
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise KServeHttpDecodeError("the request's JSON has no `inputs` list")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for position, tensor in enumerate(inputs):
        name, datatype, shape, parameters = _header(tensor, position)
        if name in arrays:
            raise KServeHttpDecodeError(f"input {name!r} appears twice in the request")
        if SHARED_MEMORY_PARAMETER in parameters:
            raise KServeHttpDecodeError(
                f"input {name!r} is passed in shared memory region "
                f"{parameters[SHARED_MEMORY_PARAMETER]!r}; its data is not in the request, so it "
                "cannot be decoded (not supported)"
            )
        size = parameters.get(BINARY_DATA_SIZE)
        if size is None:
            if "data" not in tensor:
                raise KServeHttpDecodeError(f"input {name!r} has neither `data` nor binary data")
            arrays[name] = _from_json(tensor["data"], datatype, shape, name)
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise KServeHttpDecodeError(f"input {name!r}: binary_data_size {size!r}")
        if "data" in tensor:
            raise KServeHttpDecodeError(f"input {name!r} has both `data` and binary data")
        if offset + size > len(http.binary):
            raise KServeHttpDecodeError(
                f"input {name!r}: its {size} binary bytes end past the body's binary part "
                f"({len(http.binary) - offset} bytes left); is Inference-Header-Content-Length "
                "right?"
            )
        arrays[name] = _from_binary(http.binary[offset : offset + size], datatype, shape, name)
        offset += size
    if offset != len(http.binary):
        raise KServeHttpDecodeError(
            f"the body has {len(http.binary) - offset} binary bytes no input claims"
        )
    match = _VERSION.search(target_path(http.target))
    return DecodedInputs(arrays, match.group(1) if match else "")


def _json(data: bytes) -> dict[str, Any]:
    try:
        request = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KServeHttpDecodeError(f"the request's JSON part is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise KServeHttpDecodeError("the request's JSON is not an object")
    return request


def _header(tensor: Any, position: int) -> tuple[str, str, tuple[int, ...], dict[str, Any]]:
    if not isinstance(tensor, dict):
        raise KServeHttpDecodeError(f"input {position} is not a JSON object")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise KServeHttpDecodeError(f"input {position} has no name")
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str) or datatype.upper() not in NUMPY_DTYPES:
        known = ", ".join(NUMPY_DTYPES)
        raise KServeHttpDecodeError(
            f"input {name!r} has datatype {datatype!r}; expected one of {known}"
        )
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        or any(d < 0 for d in shape)
    ):
        raise KServeHttpDecodeError(
            f"input {name!r} has shape {shape!r}; a shape is a list of non-negative integers"
        )
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise KServeHttpDecodeError(f"input {name!r}: its parameters are not a JSON object")
    return name, datatype.upper(), tuple(shape), parameters


def _from_binary(raw: bytes, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """One input's binary tensor (the layout of gRPC's `raw_input_contents`)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        try:
            elements = deserialize_bytes_tensor(raw)
        except struct.error:
            raise KServeHttpDecodeError(
                f"input {name!r}: its BYTES data ends inside an element"
            ) from None
        if elements.size != count:
            raise KServeHttpDecodeError(
                f"input {name!r} has shape {list(shape)} ({count} elements) but its binary "
                f"BYTES data holds {elements.size} elements"
            )
        return elements.reshape(shape)
    itemsize = NUMPY_DTYPES[datatype].itemsize
    if len(raw) != count * itemsize:
        raise KServeHttpDecodeError(
            f"input {name!r} has shape {list(shape)} ({count} {datatype} elements = "
            f"{count * itemsize} bytes) but its binary data holds {len(raw)} bytes"
        )
    if datatype == "BF16":  # raw bits, widened as kserve_decode widens them
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
        return (bits << 16).view(np.float32).reshape(shape)
    dtype = np.dtype(triton_to_np_dtype(datatype))
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _from_json(data: Any, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """One input's JSON `data`, nested or flat, row-major."""
    if datatype in JSON_REFUSED:
        raise KServeHttpDecodeError(
            f"input {name!r} is {datatype} in JSON, which Triton refuses (400: receiving "
            f"{datatype} data via JSON is not supported): only binary data carries {datatype}"
        )
    count = math.prod(shape)
    flat = _flatten(data, name)
    if len(flat) != count:
        raise KServeHttpDecodeError(
            f"input {name!r} has shape {list(shape)} ({count} elements) but its data holds "
            f"{len(flat)} values"
        )
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise KServeHttpDecodeError(f"input {name!r} is BYTES: its data must be strings")
        array = np.empty(count, dtype=object)
        array[:] = [v.encode("utf-8") for v in flat]
        return array.reshape(shape)
    if any(isinstance(v, str) for v in flat):
        raise KServeHttpDecodeError(f"input {name!r} is {datatype}: its data holds strings")
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise KServeHttpDecodeError(f"input {name!r} is BOOL: its data must be true/false")
        return np.array(flat, dtype=bool).reshape(shape)
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if dtype.kind in "iu":
        if not all(isinstance(v, int) for v in flat):
            raise KServeHttpDecodeError(f"input {name!r} is {datatype}: its data must be integers")
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise KServeHttpDecodeError(
                f"input {name!r}: a value does not fit {datatype} [{info.min}, {info.max}]"
            )
        return np.array(flat, dtype=dtype).reshape(shape)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise KServeHttpDecodeError(f"input {name!r} is {datatype}: its data must be numbers")
    return np.array(flat, dtype=dtype).reshape(shape)  # FP32, FP64


def _flatten(data: Any, name: str) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(v, list) for v in data):
        return data
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            if isinstance(value, dict):
                raise KServeHttpDecodeError(f"input {name!r}: its data holds an object")
            flat.append(value)
        else:
            stack.pop()
    return flat
