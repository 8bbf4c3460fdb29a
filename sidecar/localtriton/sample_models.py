"""The sample models served by the local Triton: ONNX graphs built here, no downloads."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIMPLE_CNN_INPUT = "input"
SIMPLE_CNN_OUTPUT = "output"
SIMPLE_CNN_CLASSES = 10


def _weight(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    values = rng.standard_normal(shape).astype(np.float32) / np.sqrt(max(fan_in, 1))
    return numpy_helper.from_array(values, name)


def simple_cnn(seed: int = 0) -> onnx.ModelProto:
    """A small image classifier, input `input` [N,3,32,32] -> `output` [N,10].

    Conv-Relu-MaxPool twice, then GlobalAveragePool, Flatten and Gemm: enough distinct op
    types for layer-level analyses while running in about a millisecond on a CPU.
    """
    rng = np.random.default_rng(seed)
    initializers = [
        _weight("conv1.w", (8, 3, 3, 3), rng),
        _weight("conv1.b", (8,), rng),
        _weight("conv2.w", (16, 8, 3, 3), rng),
        _weight("conv2.b", (16,), rng),
        _weight("fc.w", (SIMPLE_CNN_CLASSES, 16), rng),
        _weight("fc.b", (SIMPLE_CNN_CLASSES,), rng),
    ]
    conv: dict[str, Any] = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    pool: dict[str, Any] = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", [SIMPLE_CNN_INPUT, "conv1.w", "conv1.b"], ["c1"], "conv1", **conv),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], "pool1", **pool),
        helper.make_node("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], "conv2", **conv),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"], "gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], "flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], [SIMPLE_CNN_OUTPUT], "fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "simple_cnn",
        [helper.make_tensor_value_info(SIMPLE_CNN_INPUT, TensorProto.FLOAT, ["N", 3, 32, 32])],
        [
            helper.make_tensor_value_info(
                SIMPLE_CNN_OUTPUT, TensorProto.FLOAT, ["N", SIMPLE_CNN_CLASSES]
            )
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
