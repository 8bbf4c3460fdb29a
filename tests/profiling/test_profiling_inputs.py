from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from sidecar.profiling.inputs import (
    InputError,
    InputSpec,
    load_npz,
    onnx_input_specs,
    parse_input_spec,
    random_inputs,
)


def test_parse_input_spec_forms() -> None:
    assert parse_input_spec("input:1x3x224x224:float32") == InputSpec("input", (1, 3, 224, 224))
    assert parse_input_spec("ids:2,128:int64") == InputSpec("ids", (2, 128), "int64")
    assert parse_input_spec("x:4") == InputSpec("x", (4,), "float32")
    assert parse_input_spec("in:0:1x2:float16") == InputSpec("in:0", (1, 2), "float16")


@pytest.mark.parametrize("bad", ["input", ":1x2", "x:1xa:float32", "x:1x2:notatype", "x:0x3"])
def test_parse_input_spec_errors(bad: str) -> None:
    with pytest.raises(InputError, match="bad --input"):
        parse_input_spec(bad)


def test_random_inputs_have_requested_shape_and_dtype() -> None:
    out = random_inputs([InputSpec("a", (2, 3)), InputSpec("b", (4,), "int64")])
    assert out["a"].shape == (2, 3) and out["a"].dtype == np.float32
    assert out["b"].dtype == np.int64


def test_onnx_specs_take_batch_and_reject_other_dynamic_dims(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    assert onnx_input_specs(cnn_onnx, 8) == [InputSpec("input", (8, 3, 32, 32), "float32")]
    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "seq"])],
    )
    path = tmp_path / "dyn.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(InputError, match=r"dynamic dimension 1 \('seq'\).*--input x:SHAPE"):
        onnx_input_specs(path, 1)


def test_load_npz(tmp_path: Path) -> None:
    path = tmp_path / "in.npz"
    np.savez(path, input=np.ones((1, 3), np.float32))
    assert load_npz(path)["input"].shape == (1, 3)
    with pytest.raises(InputError, match="not found"):
        load_npz(tmp_path / "missing.npz")
