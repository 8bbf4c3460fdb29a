"""TensorFlow op events as Keras layers: name scopes, layer classes and estimated FLOPs.

Pure Python (no TensorFlow import), so it is tested on its own. The runner hands it the op
events of TensorFlow's profiler (`node_name:op_type`, input shapes as the host tracer writes
them, `(float[2,32,32,3];float[3,3,3,16])`) and the SavedModel's node attributes.

- Scopes: an op named `StatefulPartitionedCall/keras_cnn_1/conv1_1/Relu` (the call prefix is
  what grappler's function inlining adds) belongs to the scope directly under the model,
  `conv1_1`. Keras 3 exports trace the model in a graph where every scope was used once
  before, so every scope carries TensorFlow's `_1` uniquifier; when all of them (and the
  model's) do, and none is the name of a layer that owns variables, one suffix is removed:
  `conv1_1` -> `conv1`. Ops with no layer scope (`Identity`, `_Arg`) are outside layers.
- Layer class: Keras metadata is not in a Keras 3 export, so the class is inferred from the
  op types a scope contains (`Conv2D` + `BiasAdd` -> `Conv2D`, `Einsum` + `Softmax` ->
  `MultiHeadAttention`); traces say so (`layer_class_source: op_types`).
- FLOPs: each op is estimated with `flops.estimate` after its TensorFlow shapes are put in
  ONNX order (a filter `[kh, kw, Cin, Cout]` becomes `[Cout, Cin, kh, kw]`); a layer's FLOPs
  are the sum over its ops. All of it is an estimate (`flops_estimated`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.profiling import flops
from sidecar.profiling.flops import Estimate

_CALL = re.compile(r"^(Stateful)?PartitionedCall(_\d+)?$")
_UNIQUIFIER = re.compile(r"_\d+$")
_SHAPE = re.compile(r"^([A-Za-z0-9_]+)\[([0-9,\s]*)\]$")
_RUNTIME_PREFIX = re.compile(r"^_(Mkl)?(Native)?(Fused)?")

# Ops that move variables and arguments around: they run whenever they are ready (variable
# reads at the very start of a call), so they do not stretch a layer's envelope.
PLUMBING = frozenset(
    {"_Arg", "_Retval", "ReadVariableOp", "VarHandleOp", "Const", "NoOp", "Identity"}
)

# TensorFlow op -> the ONNX op `flops.estimate` knows (same name where not listed).
_ONNX = {
    "AddV2": "Add",
    "BiasAdd": "Add",
    "AddN": "Sum",
    "Rsqrt": "Sqrt",
    "SquaredDifference": "Sub",
    "Erfc": "Erf",
    "Relu6": "Clip",
    "Mean": "ReduceMean",
    "Max": "ReduceMax",
    "Maximum": "Max",
    "Minimum": "Min",
    "Sum": "ReduceSum",
    "MaxPool": "MaxPool",
    "AvgPool": "AveragePool",
    "FusedBatchNormV3": "BatchNormalization",
    "FusedBatchNorm": "BatchNormalization",
    "BatchNormV3": "BatchNormalization",
    "ConcatV2": "Concat",
    "GatherV2": "Gather",
    "MirrorPad": "Pad",
    "Select": "Where",
    "SelectV2": "Where",
}
_CONV = frozenset({"Conv2D", "DepthwiseConv2dNative"})
_MATMUL = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3", "BatchMatMul"})
_SHAPE_OUT_SAME = frozenset({"Softmax", "BatchNormalization"})
_REDUCE = frozenset({"ReduceMean", "ReduceMax", "ReduceSum", "MaxPool", "AveragePool"})


def node_path(op_name: str) -> list[str]:
    """The op's name scopes without the call prefixes inlining added."""
    parts = [p for p in op_name.split("/") if p]
    while len(parts) > 1 and _CALL.match(parts[0]):
        parts = parts[1:]
    return parts


def scope_of(op_name: str) -> tuple[str, str] | None:
    """`(model scope, layer scope)` of an op, or None for an op outside any layer."""
    parts = node_path(op_name)
    return (parts[0], parts[1]) if len(parts) >= 3 else None


def base_op(op_type: str) -> str:
    """The standard op a runtime kernel implements: `_MklNativeFusedConv2D` -> `Conv2D`."""
    if op_type.startswith("_Mkl") or op_type.startswith("_Fused"):
        stripped = _RUNTIME_PREFIX.sub("", op_type)
        if stripped.startswith("BatchNorm"):
            return "Fused" + stripped
        return stripped or op_type
    return op_type


class LayerNames:
    """Keras layer names from name scopes (see the module docstring for the uniquifier)."""

    def __init__(self, scopes: Iterable[tuple[str, str]], variable_layers: Iterable[str]) -> None:
        pairs = set(scopes)
        owners = set(variable_layers)
        layer_scopes = {layer for _, layer in pairs}
        self.uniquified = bool(pairs) and (
            all(_UNIQUIFIER.search(m) and _UNIQUIFIER.search(s) for m, s in pairs)
            and not (layer_scopes & owners)
        )

    def name(self, scope: str) -> str:
        return _UNIQUIFIER.sub("", scope) if self.uniquified else scope


def parse_shapes(text: str) -> list[tuple[str, list[int]]]:
    """`(float[2,32];int32[2])` -> `[("float", [2, 32]), ("int32", [2])]`; non-tensors
    (resources) are left out."""
    body = text.strip().removeprefix("(").removesuffix(")")
    out = []
    for item in body.split(";"):
        m = _SHAPE.match(item.strip())
        if m:
            dims = [int(d) for d in m.group(2).split(",") if d.strip()]
            out.append((m.group(1), dims))
    return out


def keras_class(op_types: Iterable[str], input_rank: int | None = None) -> str | None:
    """The Keras layer class a scope's ops say, or None when they do not say it."""
    types = {base_op(t) for t in op_types} - PLUMBING
    if not types:
        return None
    if "Conv2DBackpropInput" in types:
        return "Conv2DTranspose"
    if "DepthwiseConv2dNative" in types:
        return "DepthwiseConv2D"
    if "Conv3D" in types:
        return "Conv3D"
    if any("Conv2D" in t for t in types):  # also grappler's PadWithFusedConv2D
        return "Conv1D" if "ExpandDims" in types else "Conv2D"
    if "Einsum" in types and "Softmax" in types:
        return "MultiHeadAttention"
    if types & {"FusedBatchNormV3", "FusedBatchNorm"}:
        return "BatchNormalization"
    if "Rsqrt" in types:
        return (
            "LayerNormalization"
            if types & {"Mean", "SquaredDifference"}
            else ("BatchNormalization")
        )
    if types & (_MATMUL | {"Einsum"}):
        return "Dense"
    pools = {"MaxPool": "MaxPooling2D", "AvgPool": "AveragePooling2D", "MaxPool3D":
             "MaxPooling3D", "AvgPool3D": "AveragePooling3D"}  # fmt: skip
    for op, cls in pools.items():
        if op in types:
            return cls
    rank = f"{input_rank - 2}D" if input_rank and input_rank >= 3 else ""
    if types <= {"Mean", "Cast"}:
        return f"GlobalAveragePooling{rank}"
    if types <= {"Max", "Cast"}:
        return f"GlobalMaxPooling{rank}"
    if types <= {"AddV2", "Add", "AddN"}:
        return "Add"
    single = {
        "Mul": "Multiply",
        "Sub": "Subtract",
        "ConcatV2": "Concatenate",
        "Pad": "ZeroPadding2D",
        "Reshape": "Reshape",
        "Transpose": "Permute",
        "Softmax": "Softmax",
    }
    if len(types) == 1 and next(iter(types)) in single:
        return single[next(iter(types))]
    if types <= {"Relu", "Relu6", "Sigmoid", "Tanh", "Elu", "Selu", "Gelu", "Softplus",
                 "LeakyRelu", "Mul", "Erfc", "Erf", "Neg", "Exp"}:  # fmt: skip
        return "Activation"
    return None


@dataclass(frozen=True)
class OpWork:
    """An op's estimated work and the output shape it was estimated with (if known)."""

    estimate: Estimate
    output_shape: list[int] | None


def op_work(
    op_type: str, shapes: Sequence[tuple[str, list[int]]], attrs: Mapping[str, Any] | None = None
) -> OpWork | None:
    """Estimated FLOPs and bytes of one TensorFlow op from its input shapes, or None.

    `attrs` are the node's attributes where the op needs them (convolution strides and
    padding, an einsum's equation); without them those ops are not estimated.
    """
    attrs = attrs or {}
    op = base_op(op_type)
    dims = [list(s) for _, s in shapes]
    size = flops.dtype_size(shapes[0][0]) if shapes else 4
    try:
        if op in _CONV:
            return _conv(op, dims, attrs, size)
        if op in _MATMUL:
            return _matmul(op, dims, attrs, size)
        if op == "Einsum":
            return _einsum(dims, str(attrs.get("equation", "")), size)
        onnx = _ONNX.get(op, op)
        data = [d for (dtype, d) in shapes if not dtype.startswith("int")] or dims[:1]
        if onnx in _REDUCE:
            out: list[int] | None = None
            est = flops.estimate(onnx, dims[:1], [], size)
        elif onnx in _SHAPE_OUT_SAME:
            out = dims[0] if dims else None
            est = flops.estimate(onnx, dims[:1], [out] if out is not None else [], size)
        else:
            out = list(np.broadcast_shapes(*[tuple(d) for d in data])) if data else None
            est = flops.estimate(onnx, data, [out] if out is not None else [], size)
    except (ValueError, IndexError, ZeroDivisionError):
        return None
    return OpWork(est, out) if est is not None else None


def _conv(op: str, dims: list[list[int]], attrs: Mapping[str, Any], size: int) -> OpWork | None:
    if len(dims) < 2 or len(dims[0]) != 4 or len(dims[1]) != 4 or "strides" not in attrs:
        return None
    nchw = str(attrs.get("data_format", "NHWC")) == "NCHW"
    x, (kh, kw, cin, cout) = dims[0], dims[1]
    n, h, w, _ = (x[0], x[2], x[3], x[1]) if nchw else tuple(x)
    strides = list(attrs["strides"])
    dil = list(attrs.get("dilations") or [1, 1, 1, 1])
    sh, sw = (strides[2], strides[3]) if nchw else (strides[1], strides[2])
    dh, dw = (dil[2], dil[3]) if nchw else (dil[1], dil[2])
    padding = str(attrs.get("padding", ""))
    if padding == "SAME":
        ho, wo = math.ceil(h / sh), math.ceil(w / sw)
    elif padding == "VALID":
        ho = math.ceil((h - (kh - 1) * dh) / sh)
        wo = math.ceil((w - (kw - 1) * dw) / sw)
    else:
        return None
    channels = cin * cout if op == "DepthwiseConv2dNative" else cout
    weight = [channels, 1, kh, kw] if op == "DepthwiseConv2dNative" else [cout, cin, kh, kw]
    out = [n, channels, ho, wo] if nchw else [n, ho, wo, channels]
    est = flops.estimate("Conv", [x, weight, *dims[2:3]], [out], size)
    return OpWork(est, out) if est is not None else None


def _matmul(op: str, dims: list[list[int]], attrs: Mapping[str, Any], size: int) -> OpWork | None:
    if len(dims) < 2 or len(dims[0]) < 2 or len(dims[1]) < 2:
        return None
    a, b = list(dims[0]), list(dims[1])
    if attrs.get("transpose_a") or attrs.get("adj_x"):
        a[-2], a[-1] = a[-1], a[-2]
    if attrs.get("transpose_b") or attrs.get("adj_y"):
        b[-2], b[-1] = b[-1], b[-2]
    if a[-1] != b[-2] and a[-1] == b[-1] and not attrs:  # attributes unknown: a transposed B
        b[-2], b[-1] = b[-1], b[-2]
    if a[-1] != b[-2]:
        return None
    batch = list(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    out = [*batch, a[-2], b[-1]]
    onnx = "Gemm" if op == "MatMul" and len(dims) >= 3 and len(a) == 2 else "MatMul"
    est = flops.estimate(onnx, [a, b, *dims[2:3]] if onnx == "Gemm" else [a, b], [out], size)
    return OpWork(est, out) if est is not None else None


def _einsum(dims: list[list[int]], equation: str, size: int) -> OpWork | None:
    if "->" not in equation or "." in equation:
        return None
    lhs, rhs = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(dims):
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, dims, strict=True):
        if len(term) != len(shape):
            return None
        sizes.update(zip(term, shape, strict=True))
    out = [sizes[c] for c in rhs]
    work = 2 * math.prod(sizes.values()) if len(terms) > 1 else math.prod(out)
    read = sum(math.prod(d) for d in dims) * size
    return OpWork(Estimate(int(work), int(read), int(math.prod(out) * size)), out)
