"""TF-Serving's JSON for tensors (`json_tensor`), checked against the cases of TF-Serving's own
`json_tensor_test.cc` that the stand-in's Keras models cannot reach: strings and `{"b64": ...}`,
several inputs and outputs, integer and bool types, `NaN` and `Infinity`, float formatting."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import predict_pb2

from tests.harness.tfserving.json_tensor import (
    JsonFormat,
    decimal,
    examples,
    fill_predict_request,
    parse_json,
    predict_json,
)
from tests.harness.tfserving.model_base import ServingError

pytestmark = [pytest.mark.tfserving]


def signature(**dtypes: int) -> dict[str, meta_graph_pb2.TensorInfo]:
    return {name: meta_graph_pb2.TensorInfo(dtype=dtype) for name, dtype in dtypes.items()}


def read(body: str, **dtypes: int) -> tuple[JsonFormat, dict[str, np.ndarray]]:
    request = predict_pb2.PredictRequest()
    found = fill_predict_request(parse_json(body.encode()), signature(**dtypes), request)
    return found, {k: tf.make_ndarray(v) for k, v in request.inputs.items()}


def refused(body: str, **dtypes: int) -> str:
    with pytest.raises(ServingError) as info:
        read(body, **dtypes)
    return info.value.message


def test_strings_and_base64_in_both_formats() -> None:
    found, tensors = read('{"instances": ["hello", {"b64": "aGk="}]}', text=types_pb2.DT_STRING)
    assert found is JsonFormat.ROW
    assert tensors["text"].tolist() == [b"hello", b"hi"]
    found, tensors = read('{"inputs": {"b64": "AAEC"}}', raw=types_pb2.DT_STRING)
    assert found is JsonFormat.COLUMNAR and tensors["raw"].item() == b"\x00\x01\x02"
    assert refused('{"inputs": [{"b64": "%%%"}]}', raw=types_pb2.DT_STRING) == (
        "Unable to base64 decode"
    )
    assert "not formatted correctly for base64 data" in refused(
        '{"inputs": [{"b64": "AA", "x": 1}]}', raw=types_pb2.DT_STRING
    )


def test_several_inputs_of_several_types() -> None:
    dtypes = {"ids": types_pb2.DT_INT64, "mask": types_pb2.DT_BOOL, "w": types_pb2.DT_DOUBLE}
    body = (
        '{"instances": [{"ids": [1, 2], "mask": true, "w": NaN},'
        ' {"ids": [3, 4], "mask": false, "w": -Infinity}]}'
    )
    found, tensors = read(body, **dtypes)
    assert found is JsonFormat.ROW
    assert tensors["ids"].tolist() == [[1, 2], [3, 4]] and tensors["ids"].dtype == np.int64
    assert tensors["mask"].tolist() == [True, False]
    assert math.isnan(tensors["w"][0]) and tensors["w"][1] == -math.inf
    columnar = '{"inputs": {"ids": [[1, 2]], "mask": [true], "w": [0.5], "extra": 1}}'
    assert read(columnar, **dtypes)[1]["ids"].shape == (1, 2)
    assert "instances is a plain list, but expecting list of objects" in refused(
        '{"instances": [1]}', **dtypes
    )
    assert "must only have keys: ids,mask,w" in refused(
        '{"instances": [{"ids": [1], "mask": true}]}', **dtypes
    )
    assert refused(
        '{"instances": [{"ids": [1], "mask": true, "w": 1}, {"ids": [1, 2], "mask": true, '
        '"w": 1}]}', **dtypes
    ).endswith("Expecting tensor size: 1 but got: 2")  # fmt: skip
    assert "is not of expected type: int32" in refused('{"inputs": [1.5]}', n=types_pb2.DT_INT32)
    assert "is not of expected type: bool" in refused('{"inputs": [1]}', b=types_pb2.DT_BOOL)
    assert refused('{"inputs": [1]}', h=types_pb2.DT_HALF) == (
        "Conversion of JSON Value: 1 to type: half"
    )


def test_the_answer_in_both_formats_with_bytes_outputs() -> None:
    outputs = {
        "scores": np.array([[0.2, 3.0], [1e-5, 9e6]], np.float32),
        "label_bytes": np.array([b"\xff", b"ok"], object),
        "name": np.array([b"a", b"b"], object),
    }
    rows = json.loads(predict_json(outputs, JsonFormat.ROW))
    assert rows == {"predictions": [
        {"label_bytes": {"b64": "/w=="}, "name": "a", "scores": [0.2, 3.0]},
        {"label_bytes": {"b64": "b2s="}, "name": "b", "scores": [1e-05, 9e06]},
    ]}  # fmt: skip
    columns = json.loads(predict_json(outputs, JsonFormat.COLUMNAR))
    assert columns["outputs"]["scores"] == [[0.2, 3.0], [1e-05, 9e06]]
    single = predict_json({"y": np.array([[1, 2]], np.int32)}, JsonFormat.COLUMNAR)
    assert json.loads(single) == {"outputs": [[1, 2]]}
    with pytest.raises(ServingError, match="has inconsistent batch size: 1 expecting: 2"):
        predict_json({"a": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}, JsonFormat.ROW)


def test_floats_are_written_as_tf_serving_writes_them() -> None:
    cases = {0.2: "0.2", 3.0: "3.0", 1e-5: "1e-05", 9e6: "9e+06", 0.1234567: "0.123456702"}
    for value, text in cases.items():
        assert decimal(float(np.float32(value))) == text
    assert decimal(0.1, double=True) == "0.1"
    assert decimal(1 / 3, double=True) == "0.33333333333333331"
    assert [decimal(v) for v in (math.nan, math.inf, -math.inf)] == [
        "NaN", "Infinity", "-Infinity"
    ]  # fmt: skip


def test_classify_examples() -> None:
    body = b'{"context": {"c": "x"}, "examples": [{"f": [1.5, 2.0], "i": 3}]}'
    found = examples(parse_json(body))
    assert len(found) == 2
    features = found[1].features.feature
    assert list(features["f"].float_list.value) == [1.5, 2.0]
    assert list(features["i"].int64_list.value) == [3]
    with pytest.raises(ServingError, match=r"in feature: g expecting type: int64$"):
        examples(parse_json(b'{"examples": [{"g": [1, 2.5]}]}'))  # a list is of one kind
