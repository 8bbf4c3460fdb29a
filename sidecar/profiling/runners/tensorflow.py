"""TensorFlow runner: a SavedModel's signature, profiled with TensorFlow's own profiler.

- M: wall time around the signature's concrete function, outputs forced to host memory
  with `.numpy()` so the time is complete; no profiler.
- L: `tf.profiler.experimental` with the host tracer only (level 2: op events; no Python
  tracer, no device tracer). Its op events (`tf_trace`) are grouped into Keras layers by
  name scope (`tf_ops`): a layer span is the envelope of its ops in one call, typed by the
  Keras class its op types say, with the FLOPs of its ops summed (estimated). Ops outside
  any layer (arguments, the output `Identity`) and variable reads that ran outside their
  layer's envelope are layer-level spans of their own, never dropped.
- K (CPU): the op events themselves (`cpu_op`), placed under their layers by containment,
  like PyTorch's aten ops on a CPU.
- Clock: event times are converted with the profile's own start time and every op of a
  timed call must lie inside that call's host wall, or the level fails with the reason
  (`tf_trace.TFClockError`) rather than storing wrong numbers.
- Threads: `threads` sets TensorFlow's intra- and inter-op thread pools. TensorFlow fixes
  them when its runtime starts (the first op it runs, e.g. loading any SavedModel), so a
  process that already ran TensorFlow with other values gets a `ProfilingError`.
- GPU: TensorFlow's profiler is itself a CUPTI client, so GPU kernels would have to come from
  its own trace (never `CuptiTracer` in the same process, see `gpu.owner`); not supported
  yet: on a machine with a GPU the runner claims CUPTI for TensorFlow's profiler.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.devices import cpu_name
from sidecar.profiling.formats import savedmodel_dir, savedmodel_name
from sidecar.profiling.gpu.owner import PROCESS_OWNER
from sidecar.profiling.runners import tf_ops
from sidecar.profiling.runners.tf_trace import TFEvent, assign, read_xspace
from sidecar.profiling.runners.timing import check_iterations, timed_loop
from sidecar.profiling.vocabulary import (
    UNNAMED_INPUT,
    Iteration,
    LevelNotSupportedError,
    LevelRun,
    ProfilingError,
    RawSpan,
    RuntimeInfo,
    keyed,
    model_span,
)
from sidecar.trace import schema
from sidecar.trace.spans import Level

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TF_PROFILER = "tf.profiler"
HOST_TRACER_LEVEL = 3  # op events with their input shapes


class TensorFlowRunner:
    """Profile one signature of a TensorFlow SavedModel on the CPU."""

    name = "tensorflow"

    def __init__(
        self,
        saved_model_dir: str | Path,
        signature: str = "serving_default",
        threads: int | None = None,
        name: str | None = None,
    ) -> None:
        path = Path(saved_model_dir)
        found = savedmodel_dir(path)
        if found is None:
            raise ProfilingError(
                f"{path} is not a SavedModel: no saved_model.pb in it (nor in a numeric "
                "version folder under it)"
            )
        import tensorflow as tf

        self.tf = tf
        self.path = found
        self.model_name = name or savedmodel_name(found)
        set_threads(tf, threads)
        try:
            self.loaded = tf.saved_model.load(str(found))
        except Exception as exc:  # TensorFlow raises many types here
            raise ProfilingError(f"TensorFlow cannot load the SavedModel {found}: {exc}") from None
        signatures = dict(self.loaded.signatures)
        if signature not in signatures:
            raise ProfilingError(
                f"{found} has no signature {signature!r} (it has: {sorted(signatures) or 'none'})"
            )
        self.signature = signature
        self.function = signatures[signature]
        self.function_name = _text(self.function.name)
        self.input_signature: dict[str, Any] = dict(self.function.structured_input_signature[1])
        self.node_attrs, scopes, self.data_nodes = _graph_nodes(self.function)
        self.scope_types: dict[str, set[str]] = {}
        for node_name, node in self.node_attrs.items():
            scope = tf_ops.scope_of(node_name)
            if scope is not None:
                self.scope_types.setdefault(scope[1], set()).add(str(node["_op"]))
        owners = {_text(v.name).split("/")[0] for v in self.loaded.variables}
        self.names = tf_ops.LayerNames(scopes, owners)
        self.gpus = bool(tf.config.list_physical_devices("GPU"))

    # -- Runner interface ---------------------------------------------------------------
    def describe(self) -> RuntimeInfo:
        notes = {}
        if self.gpus:
            notes[Level.KERNEL.value] = "CPU ops only: GPU kernels of TensorFlow not supported yet"
        return RuntimeInfo(
            "tensorflow",
            self.tf.__version__,
            f"cpu, SavedModel signature {self.signature}",
            cpu_name(),
            notes,
        )

    def supported_levels(self) -> tuple[Level, ...]:
        return (Level.MODEL, Level.LAYER, Level.KERNEL)

    def input_specs(self) -> list[tuple[str, list[int | None], str]]:
        """(name, shape with None for dynamic dims, numpy dtype name) of each input."""
        return [
            (key, list(spec.shape.as_list()), spec.dtype.as_numpy_dtype().dtype.name)
            for key, spec in self.input_signature.items()
        ]

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        check_iterations(iterations, warmup)
        feed = self._feed(inputs)
        step = self._step(feed)
        if level is Level.MODEL:
            walls, _ = timed_loop(step, iterations, warmup)
            its = [Iteration(e - s, [model_span(self.model_name, s, e)]) for s, e in walls]
            return LevelRun(level, its, warmup, self._attributes())
        if level in (Level.LAYER, Level.KERNEL):
            return self._profiled_run(step, level, iterations, warmup)
        raise LevelNotSupportedError(f"level {level.value!r} is not a replay level")

    def outputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One unprofiled call of the signature on `inputs`: its outputs by name."""
        return {k: v.numpy() for k, v in self.function(**self._feed(inputs)).items()}

    # -- internals ----------------------------------------------------------------------
    def _attributes(self) -> dict[str, Any]:
        return {schema.LAYER_NAMES: "original", schema.GRAPH_OPTIMIZATIONS: "enabled"}

    def _feed(self, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        expected = set(self.input_signature)
        if set(inputs) == {UNNAMED_INPUT} and len(expected) == 1:  # a request naming none
            inputs = {next(iter(expected)): inputs[UNNAMED_INPUT]}
        if set(inputs) != expected:
            raise ProfilingError(
                f"signature {self.signature!r} takes inputs {sorted(expected)}, "
                f"got {sorted(inputs)}"
            )
        feed = {}
        for key, arr in inputs.items():
            spec = self.input_signature[key]
            if not spec.shape.is_compatible_with(arr.shape):
                raise ProfilingError(
                    f"input {key!r} has shape {list(arr.shape)}, the signature wants "
                    f"{spec.shape.as_list()}"
                )
            try:
                feed[key] = self.tf.constant(arr, dtype=spec.dtype)
            except (TypeError, ValueError) as exc:
                raise ProfilingError(f"input {key!r} is not {spec.dtype.name}: {exc}") from None
        return feed

    def _step(self, feed: dict[str, Any]) -> Any:
        function = self.function

        def step() -> None:
            for out in function(**feed).values():
                out.numpy()

        try:
            step()
        except Exception as exc:  # the model's own error, e.g. a bad shape
            raise ProfilingError(f"the SavedModel failed on these inputs: {exc}") from None
        return step

    def _profiled_run(self, step: Any, level: Level, iterations: int, warmup: int) -> LevelRun:
        profiler = self.tf.profiler.experimental
        if self.gpus:
            PROCESS_OWNER.claim(TF_PROFILER)
        options = profiler.ProfilerOptions(
            host_tracer_level=HOST_TRACER_LEVEL, python_tracer_level=0, device_tracer_level=0
        )
        for _ in range(warmup):
            step()
        with tempfile.TemporaryDirectory(prefix="xsp-tf-") as logdir:
            try:
                profiler.start(logdir, options=options)
            except Exception as exc:  # another profiler session is running in the process
                raise LevelNotSupportedError(
                    f"TensorFlow's profiler did not start: {exc}"
                ) from None
            try:  # warm up inside the profiler too: its first call pays for its start-up
                walls, _ = timed_loop(step, iterations, 1)
            finally:
                profiler.stop()
            trace = read_xspace(logdir)
        assigned = assign(trace, self.function_name, walls)
        kernels = level is Level.KERNEL
        its = [
            Iteration(w1 - w0, self._spans(ops, w0, w1, kernels))
            for (w0, w1), ops in zip(walls, assigned.ops, strict=True)
        ]
        attrs = self._attributes()
        attrs.update(
            {
                schema.LAYER_CLASS_SOURCE: "op_types",
                schema.TF_PROFILER_CLOCK: assigned.clock,
                schema.TF_SCOPE_UNIQUIFIER_REMOVED: self.names.uniquified,
            }
        )
        if kernels:
            attrs[schema.KERNEL_LEVEL] = "captured"
        return LevelRun(level, its, warmup, attrs)

    def _spans(self, ops: list[TFEvent], w0: int, w1: int, kernels: bool) -> list[RawSpan]:
        spans = [model_span(self.model_name, w0, w1)]
        by_scope: dict[str, list[TFEvent]] = {}
        outside: list[TFEvent] = []
        for op in ops:
            scope = tf_ops.scope_of(op.name)
            if scope is None:
                outside.append(op)
            else:
                by_scope.setdefault(scope[1], []).append(op)
        param_shapes = {
            tuple(map(tuple, (d for _, d in tf_ops.parse_shapes(o.shapes))))
            for o in ops
            if self._in_graph(o) and not self._computes(o, set())
        }
        known = {shape for group in param_shapes for shape in group}
        layers: list[RawSpan] = []
        for layer_scope, members in by_scope.items():
            compute = [o for o in members if self._computes(o, known)]
            if not compute:
                outside.extend(members)
                continue
            start = min(o.start_ns for o in compute)
            end = max(o.end_ns for o in compute)
            inside = [o for o in members if start <= o.start_ns and o.end_ns <= end]
            outside.extend(o for o in members if not (start <= o.start_ns and o.end_ns <= end))
            layers.append(self._layer_span(layer_scope, compute, inside, start, end))
        for op in outside:
            path = tf_ops.node_path(op.name)
            scope = tf_ops.scope_of(op.name)
            scopes = [self.names.name(p) for p in path[1:-1]]
            name = "/".join([*scopes, path[-1]] if scope else path)
            attrs = {
                schema.OP_TYPE: op.op_type,
                schema.PROVIDER: "cpu",
                schema.OUTSIDE_LAYERS: True,
            }
            if scope is not None:
                attrs[schema.LAYER] = self.names.name(scope[1])
            layers.append(
                RawSpan(Level.LAYER, name, op.op_type, op.start_ns, op.end_ns, attributes=attrs)
            )
        layers.sort(key=lambda s: s.start_ns)
        for span, key in zip(layers, keyed([s.key for s in layers]), strict=True):
            span.key = key
        spans.extend(layers)
        if kernels:
            spans.extend(self._op_span(op) for op in sorted(ops, key=lambda o: o.start_ns))
        return spans

    def _in_graph(self, op: TFEvent) -> bool:
        return "/".join(tf_ops.node_path(op.name)) in self.node_attrs

    def _computes(self, op: TFEvent, param_shapes: set[tuple[int, ...]]) -> bool:
        """Whether an op works on the model's inputs (not a variable read or an op that only
        prepares parameters, which runs whenever it is ready, often long before its layer).

        Ops grappler created (`ArithmeticOptimizer/AddOpsRewrite_Leaf_0_Add`) are not in the
        SavedModel's graph: they count as parameter work when every tensor they read has a
        shape that only parameter work reads in this call (a heuristic)."""
        if op.op_type in tf_ops.PLUMBING:
            return False
        path = "/".join(tf_ops.node_path(op.name))
        if path in self.node_attrs:
            return path in self.data_nodes
        shapes = [tuple(d) for dtype, d in tf_ops.parse_shapes(op.shapes) if d]
        return not shapes or any(s not in param_shapes for s in shapes)

    def _layer_span(
        self, scope: str, compute: list[TFEvent], members: list[TFEvent], start: int, end: int
    ) -> RawSpan:
        name = self.names.name(scope)
        compute.sort(key=lambda o: o.start_ns)
        first = tf_ops.parse_shapes(compute[0].shapes)
        types = sorted({o.op_type for o in members})
        graph_types = self.scope_types.get(scope, set())
        cls = tf_ops.keras_class([*types, *graph_types], len(first[0][1]) if first else None)
        dominant = max(compute, key=lambda o: o.end_ns - o.start_ns)
        attrs: dict[str, Any] = {
            schema.OP_TYPE: cls or "Layer",
            schema.RUNTIME_OP_TYPE: dominant.op_type,
            schema.TF_OP_TYPES: types,
            schema.TF_OPS: len(members),
            schema.SCOPE: scope,
            schema.PROVIDER: "cpu",
            schema.INPUT_SHAPES: [s for _, s in first],
        }
        if first:
            attrs[schema.DTYPE] = first[0][0]
        work = [self._op_work(o) for o in compute]
        known = [w for w in work if w is not None]
        if known:
            attrs.update(
                {
                    schema.FLOPS: sum(w.estimate.flops for w in known),
                    schema.FLOPS_ESTIMATED: True,
                    schema.DRAM_READ_BYTES: sum(w.estimate.read_bytes for w in known),
                    schema.DRAM_WRITE_BYTES: sum(w.estimate.write_bytes for w in known),
                    schema.BYTES_ESTIMATED: True,
                    schema.FLOPS_OPS_ESTIMATED: f"{len(known)} of {len(compute)}",
                }
            )
            last = next((w.output_shape for w in reversed(work) if w and w.output_shape), None)
            if last is not None:
                attrs[schema.OUTPUT_SHAPES] = [last]
        return RawSpan(
            Level.LAYER, name, attrs[schema.OP_TYPE], start, end, key=name, attributes=attrs
        )

    def _op_work(self, op: TFEvent) -> tf_ops.OpWork | None:
        shapes = tf_ops.parse_shapes(op.shapes)
        if not shapes:
            return None
        return tf_ops.op_work(op.op_type, shapes, self._attrs_for(op))

    def _attrs_for(self, op: TFEvent) -> dict[str, Any]:
        """The graph node's attributes; a fused kernel is named after the last node it fused
        (`conv1_1/Relu`), so a convolution takes those of the one conv node in its scope."""
        path = "/".join(tf_ops.node_path(op.name))
        node = self.node_attrs.get(path)
        base = tf_ops.base_op(op.op_type)
        if node is not None and node.get("_op") == base:
            return node
        scope = tf_ops.scope_of(op.name)
        if base in ("Conv2D", "DepthwiseConv2dNative") and scope is not None:
            same = [
                n
                for p, n in self.node_attrs.items()
                if n.get("_op") == base and tf_ops.scope_of(p) == scope
            ]
            if len(same) == 1:
                return same[0]
        return {}

    def _op_span(self, op: TFEvent) -> RawSpan:
        path = "/".join(tf_ops.node_path(op.name))
        return RawSpan(
            Level.KERNEL,
            op.op_type,
            "cpu_op",
            op.start_ns,
            op.end_ns,
            key=path,
            attributes={
                schema.TF_NODE: path,
                schema.INPUT_SHAPES: [s for _, s in tf_ops.parse_shapes(op.shapes)],
                schema.DEVICE: "cpu",
            },
        )


def set_threads(tf: Any, threads: int | None) -> None:
    """Size TensorFlow's intra- and inter-op pools; only possible before TF runs anything."""
    if threads is None:
        return
    if threads < 1:
        raise ProfilingError(f"threads must be at least 1, got {threads}")
    cfg = tf.config.threading
    try:
        cfg.set_intra_op_parallelism_threads(threads)
        cfg.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        current = (cfg.get_intra_op_parallelism_threads(), cfg.get_inter_op_parallelism_threads())
        if current != (threads, threads):
            raise ProfilingError(
                f"cannot set TensorFlow to {threads} threads: its runtime already started in "
                f"this process with intra/inter-op threads {current} (0 = TensorFlow's "
                "default); set threads before TensorFlow runs anything, e.g. in a fresh process"
            ) from None


def _graph_nodes(
    function: Any,
) -> tuple[dict[str, dict[str, Any]], set[tuple[str, str]], set[str]]:
    """Attributes of the nodes of the functions a signature calls, by node name, the
    (model, layer) scopes they use, and the nodes that depend on a data (non-resource)
    input of their function."""
    graph = function.graph.as_graph_def()
    nodes: dict[str, dict[str, Any]] = {}
    scopes: set[tuple[str, str]] = set()
    data: set[str] = set()
    for fdef in graph.library.function:
        if "_traced_save" in fdef.signature.name or "_traced_restore" in fdef.signature.name:
            continue
        data |= _data_dependent(fdef)
        for node in fdef.node_def:
            node_attrs: dict[str, Any] = {"_op": node.op}
            for key in ("strides", "dilations"):
                if key in node.attr:
                    node_attrs[key] = list(node.attr[key].list.i)
            for key in ("padding", "data_format", "equation"):
                if key in node.attr:
                    node_attrs[key] = _text(node.attr[key].s)
            for key in ("transpose_a", "transpose_b", "adj_x", "adj_y"):
                if key in node.attr:
                    node_attrs[key] = bool(node.attr[key].b)
            nodes[node.name] = node_attrs
            scope = tf_ops.scope_of(node.name)
            if scope is not None:
                scopes.add(scope)
    return nodes, scopes, data


def _data_dependent(fdef: Any) -> set[str]:
    """Nodes of a FunctionDef reachable by data edges from its non-resource arguments."""
    resource = 20  # DT_RESOURCE
    reached = {a.name for a in fdef.signature.input_arg if a.type != resource}
    consumers: dict[str, list[str]] = {}
    for node in fdef.node_def:
        for inp in node.input:
            if not inp.startswith("^"):
                consumers.setdefault(inp.split(":", 1)[0], []).append(node.name)
    stack = list(reached)
    while stack:
        for nxt in consumers.get(stack.pop(), []):
            if nxt not in reached:
                reached.add(nxt)
                stack.append(nxt)
    return reached


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
