"""Decode a TF-Serving REST Predict (`POST /v1/models/{m}[...]:predict`) into named arrays.

Runs in the profiling worker on a sampled request packed by `http_message.pack`. The body is
TF-Serving's JSON (`tensorflow_serving/util/json_tensor.h`):

- row format, `{"instances": [...]}`: one entry per batch row, either an object of named
  inputs (every row names the same ones; each input stacks its rows) or a plain value (the
  signature's one input);
- columnar format, `{"inputs": ...}`: an object of named inputs, each a whole tensor, or a
  plain value (the signature's one input);
- a string is UTF-8 bytes, `{"b64": "..."}` base64 bytes; `signature_name` (default
  `serving_default`).

JSON carries no dtype (TF-Serving reads it off the signature): values take the dtype TensorFlow
gives the same Python values (`tf.constant`, `tf.make_tensor_proto`): bool, int32 (int64 where a
value does not fit), float32, bytes; the replay feeds them to the signature, which casts
them to its own. An input given without a name (a plain value) is named `UNNAMED_INPUT`: the
TensorFlow runner feeds it to a signature of one input (`profiling.runners.tensorflow`). The
version and the version label are read from the path (`/versions/{v}`, `/labels/{l}`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

import numpy as np

from sidecar.backends.base import DecodedInputs
from sidecar.backends.http_message import HttpMessageError, target_path, unpack
from sidecar.profiling.vocabulary import UNNAMED_INPUT
from sidecar.trace import schema

DEFAULT_SIGNATURE = "serving_default"
_VERSION = re.compile(r"/versions/([0-9]+)(?::|$)", re.IGNORECASE)
_LABEL = re.compile(r"/labels/([^/:]+)(?::|$)", re.IGNORECASE)
_INT32 = np.iinfo(np.int32)

__all__ = ["UNNAMED_INPUT", "TfRestDecodeError", "decode_rest_predict"]


class TfRestDecodeError(ValueError):
    """The request is not a decodable TF-Serving REST Predict (the message says why)."""


def decode_rest_predict(message: bytes) -> DecodedInputs:
    """A packed REST Predict's inputs (sorted by name, as `tf_decode` gives them), the version
    its path names and its signature and version label as trace attributes."""
    try:
        http = unpack(message)
    except HttpMessageError as exc:
        raise TfRestDecodeError(str(exc)) from None
    try:
        request = json.loads(http.json)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TfRestDecodeError(f"the request body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise TfRestDecodeError("the request body is not a JSON object")
    if ("instances" in request) == ("inputs" in request):
        raise TfRestDecodeError(
            "a Predict request has exactly one of `instances` (row format) or `inputs` "
            "(columnar format)"
        )
    signature = request.get("signature_name", DEFAULT_SIGNATURE)
    if not isinstance(signature, str):
        raise TfRestDecodeError(f"signature_name {signature!r} is not a string")
    rows = "instances" in request
    inputs = _rows(request["instances"]) if rows else _columns(request["inputs"])
    path = target_path(http.target)
    attributes = {schema.SIGNATURE_NAME: signature or DEFAULT_SIGNATURE}
    version = _VERSION.search(path)
    label = _LABEL.search(path)
    if label is not None:
        attributes[schema.VERSION_LABEL] = label.group(1)
    return DecodedInputs(
        {name: inputs[name] for name in sorted(inputs)},
        version.group(1) if version else "",
        attributes,
    )


def _named(value: Any) -> bool:
    """An object of named inputs (a `{"b64": ...}` object is a value)."""
    return isinstance(value, dict) and not _is_b64(value)


def _is_b64(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and "b64" in value


def _rows(instances: Any) -> dict[str, np.ndarray]:
    if not isinstance(instances, list) or not instances:
        raise TfRestDecodeError("`instances` must be a non-empty list of rows")
    if not _named(instances[0]):
        if any(_named(row) for row in instances):
            raise TfRestDecodeError("`instances` mixes rows of named inputs and plain values")
        return {UNNAMED_INPUT: _array(instances, "instances")}
    names = set(instances[0])
    for index, row in enumerate(instances):
        if not _named(row) or set(row) != names:
            raise TfRestDecodeError(
                f"row {index} of `instances` does not name the inputs row 0 names ({sorted(names)})"
            )
    if not names:
        raise TfRestDecodeError("the rows of `instances` name no input")
    return {name: _array([row[name] for row in instances], name) for name in names}


def _columns(inputs: Any) -> dict[str, np.ndarray]:
    if not _named(inputs):
        return {UNNAMED_INPUT: _array(inputs, "inputs")}
    if not inputs:
        raise TfRestDecodeError("`inputs` names no input")
    return {name: _array(value, name) for name, value in inputs.items()}


def _array(value: Any, name: str) -> np.ndarray:
    """One tensor from its JSON value, typed as TensorFlow types the same Python values."""
    try:
        leaves = _leaves(value, name)
        kinds = {type(v) for v in leaves}
        if kinds <= {bytes}:
            shaped = np.array(_convert(value), dtype=object)
            if shaped.shape != _shape(value):
                raise ValueError("the rows are not all the same length")
            return shaped if kinds else shaped.astype(np.float32)
        if bytes in kinds:
            raise TfRestDecodeError(f"input {name!r} mixes strings and numbers")
        if kinds == {bool}:
            return np.array(value, dtype=bool)
        if bool in kinds:
            raise TfRestDecodeError(f"input {name!r} mixes booleans and numbers")
        if kinds == {int}:
            wide = np.array(value, dtype=np.int64)
            if wide.size and (wide.min() < _INT32.min or wide.max() > _INT32.max):
                return wide
            return wide.astype(np.int32)
        return np.array(value, dtype=np.float32)
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, TfRestDecodeError):
            raise
        raise TfRestDecodeError(f"input {name!r} is not a tensor: {exc}") from None


def _leaves(value: Any, name: str) -> list[Any]:
    """The tensor's scalars in order, strings as bytes; ragged rows are numpy's to refuse."""
    out: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str):
            out.append(item.encode("utf-8"))
        elif _is_b64(item):
            out.append(_b64(item["b64"], name))
        elif isinstance(item, dict):
            raise TfRestDecodeError(f"input {name!r} holds an object that is no `b64` value")
        elif item is None:
            raise TfRestDecodeError(f"input {name!r} holds null")
        else:
            out.append(item)
    return out


def _b64(text: Any, name: str) -> bytes:
    if not isinstance(text, str):
        raise TfRestDecodeError(f"input {name!r}: a `b64` value is not a string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise TfRestDecodeError(f"input {name!r}: a `b64` value is not base64") from None


def _convert(value: Any) -> Any:
    """Strings and `b64` objects as bytes, the nesting kept (for an object array's shape)."""
    if isinstance(value, list):
        return [_convert(v) for v in value]
    if isinstance(value, str):
        return value.encode("utf-8")
    if _is_b64(value):
        return base64.b64decode(value["b64"])
    return value


def _shape(value: Any) -> tuple[int, ...]:
    shape: list[int] = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return tuple(shape)
