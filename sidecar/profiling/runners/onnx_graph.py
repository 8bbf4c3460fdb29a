"""Attribute optimized ONNX Runtime nodes to the original graph's nodes.

ORT's graph optimizations fuse and rename nodes (Conv+BatchNorm+Relu -> one NCHWc Conv named
after the Relu's output, MatMul+Add+LayerNorm -> SkipLayerNormalization, ...). ORT can write
the optimized graph; tensors that survive optimization keep their names, so each original
node is followed forward through removed tensors until a surviving tensor names the
optimized node that now computes it. Layout-only nodes ORT inserts (`ReorderInput`,
`ReorderOutput`) are looked through. A node folded into a constant maps to nothing.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import onnx

TRANSPARENT_OPS = frozenset({"ReorderInput", "ReorderOutput"})


def original_nodes(graph: onnx.GraphProto) -> dict[str, str]:
    """Node name -> op type of a graph, in graph order."""
    return {node.name: node.op_type for node in graph.node}


def attribute(original: onnx.GraphProto, optimized: onnx.GraphProto) -> dict[str, list[str]]:
    """Optimized node name -> the original node names it computes (graph order)."""
    producer: dict[str, onnx.NodeProto] = {}
    for node in optimized.node:
        for out in node.output:
            if out:
                producer[out] = node
    for node in optimized.node:  # NCHWc nodes are named after the original tensor they compute
        if node.name.endswith("_nchwc"):
            producer.setdefault(node.name[: -len("_nchwc")], node)
    folded = {init.name for init in optimized.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in original.node:
        for inp in node.input:
            consumers.setdefault(inp, []).append(node)

    def compute_node(tensor: str) -> str | None:
        node = producer.get(tensor)
        for _ in range(8):  # look through layout-only nodes
            if node is None or node.op_type not in TRANSPARENT_OPS:
                break
            node = producer.get(node.input[0]) if node.input else None
        return node.name if node is not None else None

    result: dict[str, list[str]] = {node.name: [] for node in optimized.node}
    owner: dict[str, str] = {}
    for node in original.node:
        targets: set[str] = set()
        queue = deque((out, 0) for out in node.output if out)
        seen: set[str] = set()
        while queue:
            tensor, depth = queue.popleft()
            if tensor in seen or depth > 16:
                continue
            seen.add(tensor)
            if tensor in folded:
                continue
            if tensor in producer:
                name = compute_node(tensor)
                if name is not None:
                    targets.add(name)
                continue
            for consumer in consumers.get(tensor, []):
                queue.extend((out, depth + 1) for out in consumer.output if out)
        if len(targets) == 1:
            owner[node.name] = targets.pop()
    # Second pass, graph order: a node whose result vanished into a fused node downstream of
    # several others (Conv+BN+Add+Relu with the residual as an extra input) belongs to the
    # one producer of its inputs that consumes the other producers' outputs.
    opt_inputs = {n.name: set(n.input) for n in optimized.node}
    opt_outputs = {n.name: set(n.output) for n in optimized.node}
    orig_producer = {out: n.name for n in original.node for out in n.output}
    for node in original.node:
        if node.name in owner or any(out in producer for out in node.output):
            continue
        cands = set()
        for inp in node.input:
            name = compute_node(inp) if inp in producer else owner.get(orig_producer.get(inp, ""))
            if name is not None:
                cands.add(name)
        fused = [c for c in cands if all(o == c or opt_outputs[o] & opt_inputs[c] for o in cands)]
        if len(fused) == 1:
            owner[node.name] = fused[0]
    for node in original.node:
        if node.name in owner:
            result[owner[node.name]].append(node.name)
    return result


def complete_input_shapes(
    graph: onnx.GraphProto, node_name: str, recorded: list[list[int]]
) -> list[list[int]]:
    """The input shapes of a node with the ones ORT's profiler left out restored.

    ORT does not report an input it pre-packed (a Gemm's or MatMul's weight, a Conv's
    filter on some builds): that input is an initializer of the graph, so its shape is
    read from there, in the node's input order.
    """
    node = next((n for n in graph.node if n.name == node_name), None)
    if node is None:
        return recorded
    inputs = [i for i in node.input if i]
    if len(recorded) >= len(inputs):
        return recorded
    init = {t.name: list(t.dims) for t in graph.initializer}
    out: list[list[int]] = []
    pending = list(recorded)
    for k, name in enumerate(inputs):
        left = len(inputs) - k
        if name in init and len(pending) < left:
            out.append([int(d) for d in init[name]])
        elif pending:
            out.append(pending.pop(0))
    return out


def load_graph(path: str | Path) -> onnx.GraphProto:
    """The graph of an ONNX file without loading external weights."""
    return onnx.load(str(path), load_external_data=False).graph
