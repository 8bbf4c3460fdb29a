"""Builders for the test and benchmark models: built locally with random weights, no downloads.

- `small_cnn_onnx()` / `small_cnn_torch()` / `small_cnn_torchscript()`: a 9-layer CNN for tests
  (input `input` [N, 3, 32, 32] float32, output `probs` [N, 10]); without its Softmax it is
  also the `simple_cnn` sample model the local Triton serves.
- `resnet50_onnx()`: a ResNet-50 v1.5-shaped graph (stride in the 3x3 conv of each
  bottleneck, BatchNormalization nodes kept so graph optimizations have something to fuse).
- `transformer_encoder_onnx()`: a BERT-style encoder (attention-sized MatMuls, Softmax,
  LayerNormalization, GELU via Erf) over input `hidden` [N, seq, d_model].
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _GraphBuilder:
    """Tiny helper that names nodes and initializers deterministically."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.counts: dict[str, int] = {}

    def name(self, op: str) -> str:
        n = self.counts.get(op, 0)
        self.counts[op] = n + 1
        return f"{op}_{n}"

    def weight(self, name: str, shape: tuple[int, ...], scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        std = scale if scale is not None else math.sqrt(2.0 / max(fan_in, 1))
        arr = (self.rng.standard_normal(shape) * std).astype(np.float32)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def const(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> list[str]:
        name = self.name(op)
        outs = [f"{name}_out{i}" if n_out > 1 else f"{name}_out" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs

    def one(self, op: str, inputs: list[str], **attrs: Any) -> str:
        return self.node(op, inputs, 1, **attrs)[0]

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1, bias: bool = True) -> str:
        name = f"w{len(self.inits)}"
        w = self.weight(name, (cout, cin, k, k))
        ins = [x, w]
        if bias:
            ins.append(self.const(f"b{len(self.inits)}", np.zeros(cout, np.float32)))
        pad = k // 2
        return self.one(
            "Conv", ins, kernel_shape=[k, k], strides=[stride, stride], pads=[pad, pad, pad, pad]
        )

    def bn(self, x: str, c: int) -> str:
        base = len(self.inits)
        scale = self.const(f"bn{base}_s", np.ones(c, np.float32))
        bias = self.const(f"bn{base}_b", np.zeros(c, np.float32))
        mean = self.const(f"bn{base}_m", (self.rng.standard_normal(c) * 0.01).astype(np.float32))
        var = self.const(f"bn{base}_v", np.ones(c, np.float32))
        return self.one("BatchNormalization", [x, scale, bias, mean, var], epsilon=1e-5)

    def model(
        self, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto], name: str
    ) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def small_cnn_onnx(
    seed: int = 0, *, softmax: bool = True, output: str = "probs", name: str = "small_cnn"
) -> onnx.ModelProto:
    """Conv-Relu-MaxPool-Conv-Relu-GlobalAveragePool-Flatten-Gemm-Softmax, 10 classes.

    Input `input` [N, 3, 32, 32], output tensor named `output` [N, 10]. `softmax=False` ends
    at the Gemm's logits (the `simple_cnn` the local Triton serves: `triton.model_repo`).
    """
    g = _GraphBuilder(seed)
    x = g.conv("input", 3, 8, 3)
    x = g.one("Relu", [x])
    x = g.one("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = g.conv(x, 8, 16, 3)
    x = g.one("Relu", [x])
    x = g.one("GlobalAveragePool", [x])
    x = g.one("Flatten", [x], axis=1)
    w = g.weight("fc_w", (10, 16))
    b = g.const("fc_b", np.zeros(10, np.float32))
    if softmax:
        x = g.one("Gemm", [x, w, b], transB=1)
        g.nodes.append(helper.make_node("Softmax", [x], [output], name="Softmax_0", axis=1))
    else:
        g.nodes.append(helper.make_node("Gemm", [x, w, b], [output], name="Gemm_0", transB=1))
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])
    out = helper.make_tensor_value_info(output, TensorProto.FLOAT, ["N", 10])
    return g.model([inp], [out], name)


def resnet50_onnx(seed: int = 0, image_size: int = 224, classes: int = 1000) -> onnx.ModelProto:
    """ResNet-50 v1.5: bottlenecks [3, 4, 6, 3], stride on the 3x3 conv, random weights."""
    g = _GraphBuilder(seed)
    x = g.conv("input", 3, 64, 7, stride=2, bias=False)
    x = g.one("Relu", [g.bn(x, 64)])
    x = g.one("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            cout = width * 4
            y = g.one("Relu", [g.bn(g.conv(x, cin, width, 1, bias=False), width)])
            y = g.one("Relu", [g.bn(g.conv(y, width, width, 3, stride, bias=False), width)])
            y = g.bn(g.conv(y, width, cout, 1, bias=False), cout)
            if block == 0:
                x = g.bn(g.conv(x, cin, cout, 1, stride, bias=False), cout)
            x = g.one("Relu", [g.one("Add", [x, y])])
            cin = cout
    x = g.one("GlobalAveragePool", [x])
    x = g.one("Flatten", [x], axis=1)
    w = g.weight("fc_w", (classes, 2048))
    b = g.const("fc_b", np.zeros(classes, np.float32))
    g.nodes.append(helper.make_node("Gemm", [x, w, b], ["logits"], name="Gemm_fc", transB=1))
    inp = helper.make_tensor_value_info(
        "input", TensorProto.FLOAT, ["N", 3, image_size, image_size]
    )
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])
    return g.model([inp], [out], "resnet50_v1_5")


def transformer_encoder_onnx(
    seed: int = 0,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 4,
    seq: int = 128,
    ffn: int = 1024,
) -> onnx.ModelProto:
    """A post-LN BERT-style encoder; input `hidden` [N, seq, d_model] (seq fixed)."""
    g = _GraphBuilder(seed)
    dh = d_model // heads
    x = "hidden"
    split_shape = g.const("shape_split", np.array([0, seq, heads, dh], np.int64))
    merge_shape = g.const("shape_merge", np.array([0, seq, d_model], np.int64))
    scale = g.const("attn_scale", np.array(1.0 / math.sqrt(dh), np.float32))
    half = g.const("half", np.array(0.5, np.float32))
    one = g.const("one", np.array(1.0, np.float32))
    sqrt2 = g.const("sqrt2", np.array(math.sqrt(2.0), np.float32))
    for i in range(layers):
        heads_out = []
        for proj in ("q", "k", "v"):
            w = g.weight(f"l{i}_w{proj}", (d_model, d_model), scale=0.02)
            b = g.const(f"l{i}_b{proj}", np.zeros(d_model, np.float32))
            h = g.one("Add", [g.one("MatMul", [x, w]), b])
            h = g.one("Reshape", [h, split_shape])
            perm = [0, 2, 3, 1] if proj == "k" else [0, 2, 1, 3]
            heads_out.append(g.one("Transpose", [h], perm=perm))
        q, k, v = heads_out
        scores = g.one("Mul", [g.one("MatMul", [q, k]), scale])  # [N, H, S, S]
        probs = g.one("Softmax", [scores], axis=-1)
        ctx = g.one("Transpose", [g.one("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = g.one("Reshape", [ctx, merge_shape])
        wo = g.weight(f"l{i}_wo", (d_model, d_model), scale=0.02)
        bo = g.const(f"l{i}_bo", np.zeros(d_model, np.float32))
        attn = g.one("Add", [g.one("MatMul", [ctx, wo]), bo])
        x = _layer_norm(g, g.one("Add", [x, attn]), d_model, f"l{i}_ln1")
        w1 = g.weight(f"l{i}_w1", (d_model, ffn), scale=0.02)
        b1 = g.const(f"l{i}_b1", np.zeros(ffn, np.float32))
        h = g.one("Add", [g.one("MatMul", [x, w1]), b1])
        erf = g.one("Erf", [g.one("Div", [h, sqrt2])])
        h = g.one("Mul", [g.one("Mul", [h, half]), g.one("Add", [erf, one])])  # GELU
        w2 = g.weight(f"l{i}_w2", (ffn, d_model), scale=0.02)
        b2 = g.const(f"l{i}_b2", np.zeros(d_model, np.float32))
        h = g.one("Add", [g.one("MatMul", [h, w2]), b2])
        x = _layer_norm(g, g.one("Add", [x, h]), d_model, f"l{i}_ln2")
    g.nodes.append(helper.make_node("Identity", [x], ["encoded"], name="Identity_out"))
    inp = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["N", seq, d_model])
    out = helper.make_tensor_value_info("encoded", TensorProto.FLOAT, ["N", seq, d_model])
    return g.model([inp], [out], "transformer_encoder")


def _layer_norm(g: _GraphBuilder, x: str, d: int, prefix: str) -> str:
    gamma = g.const(f"{prefix}_g", np.ones(d, np.float32))
    beta = g.const(f"{prefix}_b", np.zeros(d, np.float32))
    return g.one("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)


def save_onnx(model: onnx.ModelProto, path: str | Path) -> Path:
    """Write `model` to `path` (parent folders created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def small_cnn_torch(seed: int = 0) -> Any:
    """The small CNN as a `torch.nn.Module` (same layer sequence as `small_cnn_onnx`)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class SmallCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.relu1 = nn.ReLU()
            self.pool = nn.MaxPool2d(2)
            self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
            self.relu2 = nn.ReLU()
            self.gap = nn.AdaptiveAvgPool2d(1)
            self.flatten = nn.Flatten()
            self.fc = nn.Linear(16, 10)
            self.softmax = nn.Softmax(dim=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.pool(self.relu1(self.conv1(x)))
            x = self.gap(self.relu2(self.conv2(x)))
            return self.softmax(self.fc(self.flatten(x)))

    return SmallCNN().eval()


def small_cnn_torchscript(path: str | Path, seed: int = 0) -> Path:
    """Script the small CNN and save it as a TorchScript `.pt` (as Triton's backend loads)."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # torch.jit is deprecated, but Triton's backend loads it
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(small_cnn_torch(seed))
        torch.jit.save(scripted, str(path))
    return path


SMALL_CNN_LAYERS: tuple[str, ...] = (
    "Conv",
    "Relu",
    "MaxPool",
    "Conv",
    "Relu",
    "GlobalAveragePool",
    "Flatten",
    "Gemm",
    "Softmax",
)
"""Op types of the small CNN's nodes, in execution order."""
