"""Estimated FLOPs and DRAM bytes of a layer from its op type and tensor shapes.

These are *estimates* (every result says so via `flops_estimated` / `bytes_estimated`): FLOPs
count a multiply-add as 2, bytes assume every input is read once and every output written
once. Measured GPU counters (CUPTI metrics) take precedence where they exist. Op types are
ONNX names; PyTorch module classes and aten ops are mapped onto them first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.trace import schema

Shape = Sequence[int]

# PyTorch module classes and aten ops -> the ONNX op they compute.
_ALIASES = {
    "Conv1d": "Conv",
    "Conv2d": "Conv",
    "Conv3d": "Conv",
    "FusedConv": "Conv",
    "NchwcConv": "Conv",
    "aten::conv1d": "Conv",
    "aten::conv2d": "Conv",
    "aten::conv3d": "Conv",
    "aten::convolution": "Conv",
    "aten::_convolution": "Conv",
    "aten::mkldnn_convolution": "Conv",
    "aten::cudnn_convolution": "Conv",
    "Linear": "Linear",
    "aten::linear": "Linear",
    "aten::addmm": "Gemm",
    "aten::mm": "MatMul",
    "aten::bmm": "MatMul",
    "aten::matmul": "MatMul",
    "FusedMatMul": "MatMul",
    "FusedGemm": "Gemm",
    "ReLU": "Relu",
    "aten::relu": "Relu",
    "aten::relu_": "Relu",
    "aten::clamp_min": "Relu",
    "GELU": "Gelu",
    "aten::gelu": "Gelu",
    "BiasGelu": "Gelu",
    "FastGelu": "Gelu",
    "Sigmoid": "Sigmoid",
    "aten::sigmoid": "Sigmoid",
    "Tanh": "Tanh",
    "aten::tanh": "Tanh",
    "aten::add": "Add",
    "aten::add_": "Add",
    "aten::mul": "Mul",
    "aten::mul_": "Mul",
    "aten::div": "Div",
    "aten::div_": "Div",
    "aten::sub": "Sub",
    "MaxPool2d": "MaxPool",
    "aten::max_pool2d": "MaxPool",
    "aten::max_pool2d_with_indices": "MaxPool",
    "aten::mkldnn_max_pool2d": "MaxPool",
    "AvgPool2d": "AveragePool",
    "aten::avg_pool2d": "AveragePool",
    "AdaptiveAvgPool2d": "GlobalAveragePool",
    "aten::adaptive_avg_pool2d": "GlobalAveragePool",
    "aten::mean": "ReduceMean",
    "BatchNorm2d": "BatchNormalization",
    "BatchNorm1d": "BatchNormalization",
    "aten::batch_norm": "BatchNormalization",
    "aten::native_batch_norm": "BatchNormalization",
    "LayerNorm": "LayerNormalization",
    "aten::layer_norm": "LayerNormalization",
    "aten::native_layer_norm": "LayerNormalization",
    "SkipLayerNormalization": "SkipLayerNormalization",
    "Softmax": "Softmax",
    "aten::softmax": "Softmax",
    "aten::_softmax": "Softmax",
    "Flatten": "Flatten",
    "aten::flatten": "Flatten",
    "aten::view": "Reshape",
    "aten::reshape": "Reshape",
    "aten::transpose": "Reshape",
    "aten::permute": "Reshape",
    "aten::contiguous": "Transpose",
    "aten::clone": "Transpose",
    "aten::copy_": "Transpose",
}

# Elementwise ops: FLOPs per output element.
_ELEMENTWISE = {
    "Relu": 1,
    "LeakyRelu": 2,
    "Clip": 2,
    "Add": 1,
    "Sub": 1,
    "Mul": 1,
    "Div": 1,
    "Neg": 1,
    "Abs": 1,
    "Sqrt": 1,
    "Pow": 1,
    "Max": 1,
    "Min": 1,
    "Where": 1,
    "Cast": 0,
    "Erf": 8,
    "Exp": 8,
    "Log": 8,
    "Sigmoid": 4,
    "Tanh": 8,
    "Gelu": 10,
    "HardSigmoid": 3,
    "Sum": 1,
}
# Normalizations and softmax: FLOPs per output element.
_PER_OUTPUT = {
    "BatchNormalization": 2,
    "InstanceNormalization": 7,
    "LayerNormalization": 8,
    "SkipLayerNormalization": 9,
    "Softmax": 5,
    "LogSoftmax": 5,
}
# Ops that only view or move data: no FLOPs; views touch no memory.
_VIEWS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"}
_MOVES = {
    "Transpose",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "ReorderInput",
    "ReorderOutput",
    "Pad",
    "Expand",
    "Tile",
    "Resize",
    "Upsample",
}
# Reductions and pools: FLOPs per input element.
_PER_INPUT = {
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "LpPool",
}

DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "double": 8,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


@dataclass(frozen=True)
class Estimate:
    """Estimated work of one layer (all fields are estimates)."""

    flops: int
    read_bytes: int
    write_bytes: int


def canonical_op(op_type: str) -> str:
    """The ONNX op name an op type / module class / aten op computes."""
    return _ALIASES.get(op_type, op_type)


def _numel(shape: Shape) -> int:
    return int(math.prod(int(d) for d in shape)) if shape else 1


def estimate(
    op_type: str,
    input_shapes: Sequence[Shape],
    output_shapes: Sequence[Shape],
    dtype_bytes: int = 4,
) -> Estimate | None:
    """Estimate FLOPs and bytes; `None` for op types this module does not know.

    `input_shapes` follow the ONNX input order (x, weight, bias for Conv/Gemm; A, B for MatMul;
    x, weight for a PyTorch `Linear` with weight [out, in]). Unknown dims must not be present.
    """
    op = canonical_op(op_type)
    ins = [list(s) for s in input_shapes if s is not None]
    outs = [list(s) for s in output_shapes if s is not None]
    read = sum(_numel(s) for s in ins) * dtype_bytes
    write = sum(_numel(s) for s in outs) * dtype_bytes
    out = _numel(outs[0]) if outs else 0
    flops: int | None = None
    if op == "Conv" and len(ins) >= 2 and outs:
        weight = ins[1]
        macs_per_out = _numel(weight[1:])  # Cin/groups * kernel volume
        flops = 2 * out * macs_per_out + (out if len(ins) >= 3 else 0)
    elif op in ("MatMul", "Gemm", "Linear") and ins and outs:
        o = outs[0]
        a = ins[0]
        k = int(a[-1]) if a else 1
        if op == "Gemm" and len(ins) >= 2 and len(o) == 2 and len(a) == 2:
            k = _numel(a) // max(int(o[0]), 1)  # handles transA
        flops = 2 * out * k + (out if op in ("Gemm", "Linear") and len(ins) >= 3 else 0)
    elif op in _ELEMENTWISE:
        flops = _ELEMENTWISE[op] * out
    elif op in _PER_OUTPUT:
        flops = _PER_OUTPUT[op] * out
    elif op in _PER_INPUT and ins:
        flops = _numel(ins[0])
    elif op in _VIEWS:
        return Estimate(0, 0, 0)
    elif op in _MOVES:
        flops = 0
    if flops is None:
        return None
    return Estimate(int(flops), int(read), int(write))


def annotate(attributes: dict[str, Any], op_type: str, dtype_bytes: int = 4) -> bool:
    """Add estimated `flops` / `dram_read_bytes` / `dram_write_bytes` to span attributes.

    Reads `input_shapes` / `output_shapes` from `attributes`; values already there (measured,
    or a runner's own estimate) are kept. Returns whether an estimate was added.
    """
    if attributes.get(schema.FLOPS_ESTIMATED) is False or schema.FLOPS in attributes:
        return False  # measured, or estimated by the runner already (summed over ops)
    ins = attributes.get(schema.INPUT_SHAPES) or []
    outs = attributes.get(schema.OUTPUT_SHAPES) or []
    if not outs and not ins:
        return False
    try:
        est = estimate(op_type, ins, outs, dtype_bytes)
    except (TypeError, ValueError):
        return False
    if est is None:
        return False
    attributes.update(
        {
            schema.FLOPS: est.flops,
            schema.FLOPS_ESTIMATED: True,
            schema.DRAM_READ_BYTES: est.read_bytes,
            schema.DRAM_WRITE_BYTES: est.write_bytes,
            schema.BYTES_ESTIMATED: True,
        }
    )
    return True


def dtype_size(name: str | None, default: int = 4) -> int:
    """Bytes per element of a dtype name (`float`, `float16`, `torch.float32`, ...)."""
    if not name:
        return default
    return DTYPE_BYTES.get(name.replace("torch.", ""), default)


def shapes_by_dtype(entries: Sequence[Mapping[str, Sequence[int]]]) -> tuple[list[list[int]], int]:
    """Split ORT profiler `input_type_shape` entries (`[{"float": [1, 3]}]`) into shapes and
    the element size of the first entry."""
    shapes: list[list[int]] = []
    size = 4
    for i, entry in enumerate(entries):
        for dtype, shape in entry.items():
            shapes.append([int(d) for d in shape])
            if i == 0:
                size = dtype_size(dtype)
    return shapes, size
