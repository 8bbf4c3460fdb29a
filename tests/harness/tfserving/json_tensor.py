"""TF-Serving's JSON for tensors, as its REST API reads and writes it (the stand-in's REST half).

Follows `tensorflow_serving/util/json_tensor.cc`, the mapping the binary uses:

- a Predict body is a JSON object with an optional `signature_name` and either `instances`
  (row format: one element per example, batched along a new first dimension; a plain value or
  list when the signature has one input, else one object per example keyed by input name) or
  `inputs` (columnar: the whole tensor, a plain value or list for one input, else an object
  keyed by input name). Values are typed by the signature's inputs; a `DT_STRING` value may be
  `{"b64": "..."}`; `NaN` and `Infinity` are read.
- the answer is `{"predictions": ...}` (row: one element per example, an object keyed by output
  name when there are several outputs) or `{"outputs": ...}` (columnar: the whole tensors).
  Floats are written in the shortest `%g` form that reads back to the same value (else 9 or 17
  digits), whole numbers with `.0`; `DT_STRING` outputs whose name ends in `_bytes` as
  `{"b64": ...}`.
- a `:classify` / `:regress` body holds `examples` (and an optional `context`): JSON objects
  of features, read into `tf.train.Example`s.

Errors are `ServingError`s with TF-Serving's codes and messages.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import Any

import grpc
import numpy as np
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import predict_pb2

from tests.harness.tfserving.model_base import ServingError, dtype_name

SIGNATURE_KEY = "signature_name"
INSTANCES = "instances"
INPUTS = "inputs"
PREDICTIONS = "predictions"
OUTPUTS = "outputs"
BASE64 = "b64"
BYTES_SUFFIX = "_bytes"
FLOAT32_MAX_INT = (1 << 24) - 1
FLOAT64_MAX_INT = (1 << 53) - 1
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT32_MAX, UINT64_MAX = (1 << 32) - 1, (1 << 64) - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)

InputMap = Mapping[str, meta_graph_pb2.TensorInfo]


class JsonFormat(Enum):
    """How a Predict body gave its tensors; the answer uses the same format."""

    ROW = "row"
    COLUMNAR = "columnar"


def invalid(*parts: object) -> ServingError:
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, "".join(str(p) for p in parts))


def status_text(error: ServingError) -> str:
    """`Status::ToString()` of an error: its code's name, then its message."""
    return f"{error.code.name}: {error.message}"


# ---- JSON values as TF-Serving prints them in messages ----


def _is_int(value: object) -> bool:
    return type(value) is int and INT64[0] <= value <= UINT64_MAX  # larger: a double


def _is_number(value: object) -> bool:
    return type(value) is float or type(value) is int


def json_type(value: object) -> str:
    """rapidjson's type name of a JSON value."""
    if value is None:
        return "Null"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, dict):
        return "Object"
    if isinstance(value, list):
        return "Array"
    return "String" if isinstance(value, str) else "Number"


def json_text(value: object) -> str:
    """A JSON value written back (for error messages), floats as TF-Serving writes them."""
    if type(value) is float:
        exact32 = not math.isfinite(value) or float(np.float32(value)) == value
        return decimal(value, double=not exact32)
    if isinstance(value, dict | list):
        return json.dumps(value, indent=4)
    return json.dumps(value)


def decimal(value: float, double: bool = False) -> str:
    """A float as TF-Serving's `WriteDecimal`: `%g` if it reads back to the same value, else
    all the type's digits; `.0` after a whole number; `NaN`, `Infinity`, `-Infinity`."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "-Infinity" if value < 0 else "Infinity"
    text = f"{value:g}"
    back = float(text) if double else float(np.float32(float(text)))
    if back != value:
        text = f"{value:.17g}" if double else f"{value:.9g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return text


# ---- reading tensors ----


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (`NaN` and `Infinity` allowed)."""
    if not body:
        raise invalid("JSON Parse error: The document is empty")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        offset = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "Invalid encoding"
        raise invalid(f"JSON Parse error: {reason} at offset: {offset}") from None
    if not isinstance(doc, dict):
        raise invalid("JSON Value: ", json_text(doc), " Is not object")
    return doc


def signature_name(doc: dict[str, Any]) -> str:
    """The body's `signature_name` ("" when absent)."""
    name = doc.get(SIGNATURE_KEY, "")
    if not isinstance(name, str):
        raise invalid(
            "JSON Value: ", json_text(doc),
            " not formatted correctly. 'signature_name' key must be a string value.",
        )  # fmt: skip
    return name


def _type_error(value: object, dtype: int) -> ServingError:
    return invalid(
        "JSON Value: ", json_text(value), " Type: ", json_type(value),
        " is not of expected type: ", dtype_name(dtype),
    )  # fmt: skip


def _lossless(value: float | int, max_int: int, limit: float) -> bool:
    if type(value) is int:
        return abs(value) <= max_int
    return not math.isfinite(value) or -limit <= value <= limit


def _lossy(value: object, target: str) -> ServingError:
    return invalid(
        "Cannot convert JSON value: ", json_text(value), " to ", target,
        " without loss of precision.",
    )  # fmt: skip


def _b64(value: dict[str, Any]) -> bytes:
    if not is_b64(value):
        raise invalid("JSON Value: ", json_text(value), " not formatted correctly for base64 data")
    text = value[BASE64]
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise invalid("Unable to base64 decode") from None


def is_b64(value: object) -> bool:
    """`{"b64": "<string>"}` and nothing else."""
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(BASE64), str)


class _Tensor:
    """The values of one tensor being read, in its proto's typed value field."""

    def __init__(self, dtype: int) -> None:
        self.proto = tensor_pb2.TensorProto(dtype=dtype)
        self.values: list[Any] = []
        self.add = self._adder(dtype)

    def _adder(self, dtype: int) -> Callable[[Any], None]:
        values = self.values

        def as_float(v: Any, max_int: int, limit: float, name: str) -> None:
            if not _is_number(v):
                raise _type_error(v, dtype)
            if not _lossless(v, max_int, limit):
                raise _lossy(v, name)
            values.append(v)

        def of(
            check: Callable[[Any], bool], convert: Callable[[Any], Any] = lambda v: v
        ) -> Callable[[Any], None]:
            def add(v: Any) -> None:
                if not check(v):
                    raise _type_error(v, dtype)
                values.append(convert(v))

            return add

        adders: dict[int, Callable[[Any], None]] = {
            types_pb2.DT_FLOAT: lambda v: as_float(v, FLOAT32_MAX_INT, FLOAT32_MAX, "float"),
            types_pb2.DT_DOUBLE: lambda v: as_float(v, FLOAT64_MAX_INT, math.inf, "double"),
            types_pb2.DT_STRING: of(lambda v: isinstance(v, str), lambda v: v.encode()),
            types_pb2.DT_BOOL: of(lambda v: isinstance(v, bool)),
            types_pb2.DT_INT64: of(lambda v: type(v) is int and INT64[0] <= v <= INT64[1]),
            types_pb2.DT_UINT32: of(lambda v: type(v) is int and 0 <= v <= UINT32_MAX),
            types_pb2.DT_UINT64: of(lambda v: type(v) is int and 0 <= v <= UINT64_MAX),
        }
        for small in (types_pb2.DT_INT32, types_pb2.DT_INT16, types_pb2.DT_INT8,
                      types_pb2.DT_UINT8):  # fmt: skip
            adders[small] = of(lambda v: type(v) is int and INT32[0] <= v <= INT32[1])
        if dtype in adders:
            return adders[dtype]

        def unimplemented(v: Any) -> None:
            raise ServingError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"Conversion of JSON Value: {json_text(v)} to type: {dtype_name(dtype)}",
            )

        return unimplemented

    def add_string(self, raw: bytes) -> None:
        self.values.append(raw)

    def finish(self, shape: list[int]) -> tensor_pb2.TensorProto:
        proto = self.proto
        for size in shape:
            proto.tensor_shape.dim.add(size=size)
        field = {
            types_pb2.DT_FLOAT: proto.float_val, types_pb2.DT_DOUBLE: proto.double_val,
            types_pb2.DT_STRING: proto.string_val, types_pb2.DT_BOOL: proto.bool_val,
            types_pb2.DT_INT64: proto.int64_val, types_pb2.DT_UINT32: proto.uint32_val,
            types_pb2.DT_UINT64: proto.uint64_val,
        }.get(proto.dtype, proto.int_val)  # fmt: skip
        field.extend(self.values)
        return proto


def dense_shape(value: Any) -> list[int]:
    """The shape a JSON value gives, read along the first element of every list."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def fill(value: Any, level: int, shape: list[int], tensor: _Tensor) -> int:
    """Add `value`'s leaves to `tensor`, checked against `shape`; how many were added."""
    rank = len(shape)
    if not isinstance(value, list):
        if level != rank:
            raise invalid(
                "JSON Value: ", json_text(value), " found at incorrect level: ", level + 1,
                " in the JSON DOM. Expected at level: ", rank,
            )  # fmt: skip
        if isinstance(value, dict):
            if tensor.proto.dtype != types_pb2.DT_STRING:
                raise _type_error(value, tensor.proto.dtype)
            tensor.add_string(_b64(value))
        else:
            tensor.add(value)
        return 1
    if level >= rank:
        raise invalid("Encountered list at unexpected level: ", level, " expected < ", rank)
    if len(value) != shape[level]:
        raise invalid(
            "Encountered list at unexpected size: ", len(value), " at level: ", level,
            " expected size: ", shape[level],
        )  # fmt: skip
    if level == rank - 1 and not any(isinstance(v, list | dict) for v in value):
        for v in value:  # the innermost list: scalars only
            tensor.add(v)
        return len(value)
    return sum(fill(v, level + 1, shape, tensor) for v in value)


def _instances(items: list[Any], inputs: InputMap) -> dict[str, tensor_pb2.TensorProto]:
    """Row format: every element gives one example of each input."""
    if not isinstance(items[0], dict) and len(inputs) > 1:
        raise invalid(
            "instances is a plain list, but expecting list of objects as multiple input "
            "tensors required as per tensorinfo_map"
        )

    def named(value: Any) -> bool:
        return isinstance(value, dict) and not is_b64(value)

    objects = named(items[0])
    names = sorted(inputs)
    tensors: dict[str, _Tensor] = {}
    shapes: dict[str, tuple[int, list[int]]] = {}

    def add(item: Any, name: str) -> None:
        if name not in inputs:
            raise invalid("JSON object: does not have named input: ", name)
        tensor = tensors.setdefault(name, _Tensor(inputs[name].dtype))
        shape = dense_shape(item)
        size = fill(item, 0, shape, tensor)
        if name not in shapes:
            shapes[name] = (size, shape)
        elif shapes[name][0] != size:
            raise invalid("Expecting tensor size: ", shapes[name][0], " but got: ", size)
        elif shapes[name][1] != shape:
            raise invalid(
                "Expecting shape ", _shape_text(shapes[name][1]), " but got: ", _shape_text(shape)
            )

    for index, element in enumerate(items):
        if objects:
            if not named(element):
                raise invalid("Expecting object but got list at item ", index, " of input list")
            for name, item in element.items():
                try:
                    add(item, name)
                except ServingError as error:
                    raise invalid(
                        "Failed to process element: ", index, " key: ", name,
                        " of 'instances' list. Error: ", status_text(error),
                    ) from None  # fmt: skip
            if set(element) != set(names):
                raise invalid(
                    "Failed to process element: ", index, " of 'instances' list. JSON object: ",
                    json_text(element), " must only have keys: ", ",".join(names),
                )  # fmt: skip
        else:
            if named(element):
                raise invalid(
                    "Expecting value/list but got object at item ", index, " of input list"
                )
            try:
                add(element, names[0])
            except ServingError as error:
                raise invalid(
                    "Failed to process element: ", index, " of 'instances' list. Error: ",
                    status_text(error),
                ) from None  # fmt: skip
    return {name: t.finish([len(items), *shapes[name][1]]) for name, t in tensors.items()}


def _shape_text(shape: list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _inputs(value: Any, inputs: InputMap) -> dict[str, tensor_pb2.TensorProto]:
    """Columnar format: each input's whole tensor."""
    if not isinstance(value, dict) or is_b64(value):
        if len(inputs) > 1:
            raise invalid(
                "inputs is a plain value/list, but expecting an object as multiple input "
                "tensors required as per tensorinfo_map"
            )
        columns = {next(iter(inputs)): value}
    else:
        columns = {}
        for name in sorted(inputs):
            if name not in value:
                raise invalid("Missing named input: ", name, " in 'inputs' object.")
            columns[name] = value[name]
    tensors = {}
    for name, column in columns.items():
        tensor, shape = _Tensor(inputs[name].dtype), dense_shape(column)
        fill(column, 0, shape, tensor)
        tensors[name] = tensor.finish(shape)
    return tensors


def fill_predict_request(
    doc: dict[str, Any], inputs: InputMap, request: predict_pb2.PredictRequest
) -> JsonFormat:
    """Fill `request.inputs` from a Predict body read by `parse_json`, typed by the
    signature's `inputs`; the format it used."""
    if not inputs:
        name = request.model_spec.signature_name or "DEFAULT"
        raise invalid("Failed to get input map for signature: ", name)
    if INSTANCES in doc:
        if INPUTS in doc:
            raise invalid(
                "JSON Value: ", json_text(doc), " Not formatted correctly expecting only one of "
                f"'{INPUTS}' or '{INSTANCES}' keys to exist ",
            )  # fmt: skip
        items = doc[INSTANCES]
        if not isinstance(items, list):
            raise invalid("JSON Value: ", json_text(doc), f" Excepting '{INSTANCES}' to be an "
                          "list/array")  # fmt: skip
        if not items:
            raise invalid("JSON Value: ", json_text(doc), f" No values in '{INSTANCES}' array")
        tensors, found = _instances(items, inputs), JsonFormat.ROW
    elif INPUTS in doc:
        tensors, found = _inputs(doc[INPUTS], inputs), JsonFormat.COLUMNAR
    else:
        raise invalid("Missing 'inputs' or 'instances' key")
    for name, tensor in tensors.items():
        request.inputs[name].CopyFrom(tensor)
    return found


# ---- writing tensors ----


def _scalars(array: np.ndarray, name: str) -> list[str]:
    """Every value of `array` as JSON text, in order."""
    kind = array.dtype
    flat = array.ravel()
    if kind == np.float32:
        return [decimal(v) for v in flat.tolist()]
    if kind == np.float64:
        return [decimal(v, double=True) for v in flat.tolist()]
    if kind == np.bool_:
        return ["true" if v else "false" for v in flat.tolist()]
    if kind.kind in "iu" and kind.itemsize <= 8 and kind != np.uint16:
        return [str(v) for v in flat.tolist()]
    if kind.kind == "O":  # DT_STRING
        if name.endswith(BYTES_SUFFIX):
            return [json.dumps({BASE64: base64.b64encode(v).decode()}) for v in flat.tolist()]
        return [json.dumps(v.decode(errors="replace")) for v in flat.tolist()]
    raise invalid("Failed to write JSON value for tensor type: ", _tf_type_name(kind))


def _tf_type_name(kind: np.dtype) -> str:
    names = {np.dtype(np.float16): "half", np.dtype(np.uint16): "uint16"}
    return names.get(kind, str(kind))


def _nest(values: Iterator[str], shape: tuple[int, ...]) -> str:
    if not shape:
        return next(values)
    return "[" + ", ".join(_nest(values, shape[1:]) for _ in range(shape[0])) + "]"


def _tensor_json(array: np.ndarray, name: str, skip_batch: bool) -> list[str]:
    """One JSON text per example (`skip_batch`) or one for the whole tensor."""
    values = iter(_scalars(array, name))
    if skip_batch:
        return [_nest(values, array.shape[1:]) for _ in range(array.shape[0])]
    return [_nest(values, array.shape)]


def predict_json(outputs: Mapping[str, np.ndarray], found: JsonFormat) -> str:
    """The JSON answer of a Predict whose body used `found`."""
    if not outputs:
        raise invalid("Cannot convert empty tensor map to JSON")
    names = sorted(outputs)
    if found is JsonFormat.COLUMNAR:
        columns = {name: _tensor_json(outputs[name], name, False)[0] for name in names}
        if len(names) == 1:
            return f'{{\n    "{OUTPUTS}": {columns[names[0]]}\n}}'
        inner = ",\n".join(f"        {json.dumps(n)}: {v}" for n, v in columns.items())
        return f'{{\n    "{OUTPUTS}": {{\n{inner}\n    }}\n}}'
    batch = 0
    for name in names:
        shape = outputs[name].shape
        if not shape:
            raise invalid("Tensor name: ", name, " has no shape information ")
        if shape[0] < 1:
            raise invalid("Tensor name: ", name, " has invalid batch size: ", shape[0])
        if batch and shape[0] != batch:
            raise invalid(
                "Tensor name: ", name, " has inconsistent batch size: ", shape[0],
                " expecting: ", batch,
            )  # fmt: skip
        batch = shape[0]
    rows = {name: _tensor_json(outputs[name], name, True) for name in names}
    if len(names) == 1:
        items = rows[names[0]]
    else:
        items = [
            "{" + ", ".join(f"{json.dumps(n)}: {rows[n][i]}" for n in names) + "}"
            for i in range(batch)
        ]
    return f'{{\n    "{PREDICTIONS}": [' + ", ".join(items) + "\n    ]\n}"


# ---- :classify and :regress bodies ----


def _add_feature(value: Any, name: str, feature: feature_pb2.Feature) -> None:
    kind = feature.WhichOneof("kind")

    def want(wanted: str) -> None:
        if kind not in (None, wanted):
            raise invalid(
                "Unexpected element type in feature: ", name, " expecting type: ",
                kind.removesuffix("_list"),
            )  # fmt: skip

    if value is None or isinstance(value, list) or (isinstance(value, dict) and not is_b64(value)):
        raise invalid(
            "Feature: ", name, " has element with unexpected JSON type: ", json_type(value)
        )
    if isinstance(value, bool):
        want("int64_list")
        feature.int64_list.value.append(int(value))
    elif isinstance(value, dict):
        want("bytes_list")
        feature.bytes_list.value.append(_b64(value))
    elif isinstance(value, str):
        want("bytes_list")
        feature.bytes_list.value.append(value.encode())
    elif type(value) is float or not _is_int(value):
        want("float_list")
        if not _lossless(value, FLOAT32_MAX_INT, FLOAT32_MAX):
            raise _lossy(value, "float")
        feature.float_list.value.append(value)
    else:
        want("int64_list")
        if value > INT64[1]:
            raise invalid("Feature: ", name, " has uint64 element. Only int64 is supported.")
        feature.int64_list.value.append(value)


def example(value: Any) -> example_pb2.Example:
    """A `tf.train.Example` from a JSON object of features."""
    if not isinstance(value, dict):
        raise invalid("Example must be JSON object but got JSON ", json_type(value))
    result = example_pb2.Example()
    for name, content in value.items():
        feature = feature_pb2.Feature()
        for item in content if isinstance(content, list) else [content]:
            _add_feature(item, name, feature)
        result.features.feature[name].CopyFrom(feature)
    return result


def examples(doc: dict[str, Any]) -> list[example_pb2.Example]:
    """The `context` (when given) and `examples` of a :classify / :regress body."""
    found = [example(doc["context"])] if "context" in doc else []
    items = doc.get("examples")
    if "examples" not in doc:
        raise invalid(
            "JSON Value: ", json_text(doc),
            " When method is classify, key 'examples' is expected and was not found",
        )  # fmt: skip
    if not isinstance(items, list):
        raise invalid("JSON Value: ", json_text(doc), " Expecting 'examples' value to be an "
                      "list/array")  # fmt: skip
    if not items:
        raise invalid("JSON Value: ", json_text(doc), " 'examples' value is an empty array")
    return found + [example(item) for item in items]
