"""ONNX Runtime runner: M = wall time around `session.run`, L = ORT profiler node events.

The L run uses a second session with `enable_profiling`; its node events (`cat == "Node"`,
name `<node>_kernel_time`) become layer spans with op type, shapes, provider and the
activation / parameter / output sizes ORT reports. A node ORT fused from several graph nodes
is typed by what it fused (`Conv+Relu`), with ORT's own op in `runtime_op_type` and the
graph nodes in `original_nodes`. ORT's profiler clock is mapped onto ours
with one offset per run, matched on its `model_run` events. On CPU ORT exposes no sub-node
events, so K is not captured (the trace says why).

With the CUDA execution provider (`providers=[("CUDAExecutionProvider", {"device_id": N}),
"CPUExecutionProvider"]`, built by `select.runner_for(..., device="cuda:N")`) K comes from
`CuptiTracer`, which owns CUPTI in the process (`gpu.owner`); its records are clock-checked
against the host walls (`gpu.clock_check`), so a second CUPTI client in the process (e.g. an
onnxruntime build with its own CUDA profiling) fails the profile instead of storing wrong
numbers. `session.run` returns host outputs, so each wall ends after the GPU work it launched.
A node event's time on CUDA is the host interval in which ORT launched the node's kernels
(`layer_time_base: host`), not GPU time. Written for a GPU but never run on one: the machines
this was built on had no onnxruntime-gpu (tests cover the CPU path and the error paths).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from sidecar.profiling.devices import cpu_name
from sidecar.profiling.gpu.clock_check import require_clock
from sidecar.profiling.gpu.cupti_tracer import CuptiTracer, records_to_spans, split_spans
from sidecar.profiling.gpu.owner import ORT_CUDA_PROFILER, PROCESS_OWNER
from sidecar.profiling.runners import onnx_graph
from sidecar.profiling.runners.timing import align_offset, check_iterations, timed_loop, warm_up
from sidecar.profiling.server_config import OrtSettings
from sidecar.profiling.vocabulary import (
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

CPU_KERNEL_NOTE = (
    "not captured: ONNX Runtime on CPU exposes no events below the node level "
    "(and there is no GPU for CUPTI on this machine)"
)
GRAPH_LEVELS = {  # `server_config.OrtSettings.graph_level` -> ORT's level
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
EXECUTION_MODES = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}


class OnnxRuntimeRunner:
    """Profile an ONNX model with ONNX Runtime."""

    name = "onnxruntime"

    def __init__(
        self,
        model_path: str | Path,
        *,
        optimizations: bool = True,
        providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
        intra_op_threads: int = 0,
        settings: OrtSettings | None = None,
    ) -> None:
        """`settings`: what the model's `config.pbtxt` asks of the session; they win over
        `optimizations` and `intra_op_threads` (`server_config`)."""
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise ProfilingError(f"model file not found: {self.model_path}")
        self.settings = settings or OrtSettings()
        self.graph_level = GRAPH_LEVELS[
            self.settings.graph_level or ("all" if optimizations else "disable_all")
        ]
        self.optimizations = self.graph_level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.intra_op_threads = intra_op_threads
        if self.settings.intra_op_threads is not None:
            self.intra_op_threads = self.settings.intra_op_threads
        available = ort.get_available_providers()
        self.providers = list(providers or ["CPUExecutionProvider"])
        self.provider_names = [p if isinstance(p, str) else p[0] for p in self.providers]
        missing = [p for p in self.provider_names if p not in available]
        if missing:
            raise ProfilingError(
                f"execution provider(s) {missing} not available in this onnxruntime build "
                f"(available: {available}); install onnxruntime-gpu for CUDAExecutionProvider"
            )
        self.original = onnx_graph.load_graph(self.model_path)
        self._session: ort.InferenceSession | None = None

    # -- Runner interface ---------------------------------------------------------------
    def describe(self) -> RuntimeInfo:
        provider = self.session.get_providers()[0]
        notes: dict[str, str] = {}
        if not self._on_gpu:
            notes[Level.KERNEL.value] = CPU_KERNEL_NOTE
        device = cpu_name() if not self._on_gpu else f"CUDA GPU ({self.device})"
        return RuntimeInfo("onnxruntime", ort.__version__, provider, device, notes)

    def supported_levels(self) -> tuple[Level, ...]:
        if self._on_gpu:
            return (Level.MODEL, Level.LAYER, Level.KERNEL)
        return (Level.MODEL, Level.LAYER)

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        check_iterations(iterations, warmup)
        feed = dict(inputs)
        if level is Level.MODEL:
            walls, _ = timed_loop(lambda: self.session.run(None, feed), iterations, warmup)
            its = [Iteration(e - s, [model_span(self.model_path.stem, s, e)]) for s, e in walls]
            return LevelRun(level, its, warmup, self._trace_attributes())
        if level is Level.LAYER:
            return self._profiled_run(feed, iterations, warmup, kernels=False)
        if level is Level.KERNEL:
            if not self._on_gpu:
                raise LevelNotSupportedError(
                    f"kernel level on {self.provider_names[0]}: {CPU_KERNEL_NOTE}"
                )
            return self._profiled_run(feed, iterations, warmup, kernels=True)
        raise LevelNotSupportedError(f"level {level.value!r} is not a replay level")

    # -- internals ----------------------------------------------------------------------
    @property
    def _on_gpu(self) -> bool:
        return any(p in GPU_PROVIDERS for p in self.provider_names)

    @property
    def device(self) -> str:
        """`cpu`, or `cuda:N` for the CUDA execution provider on device N."""
        first = self.providers[0]
        if not self._on_gpu:
            return "cpu"
        options = first[1] if isinstance(first, tuple) else {}
        return f"cuda:{int(options.get('device_id', 0))}"

    @property
    def session(self) -> ort.InferenceSession:
        if self._session is None:
            self._session = self._make_session(self._options())
        return self._session

    def _options(self) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.graph_optimization_level = self.graph_level
        if self.intra_op_threads:
            so.intra_op_num_threads = self.intra_op_threads
        settings = self.settings
        if settings.inter_op_threads:
            so.inter_op_num_threads = settings.inter_op_threads
        if settings.execution_mode is not None:
            so.execution_mode = EXECUTION_MODES[settings.execution_mode]
        if settings.enable_mem_arena is not None:
            so.enable_cpu_mem_arena = settings.enable_mem_arena
        if settings.enable_mem_pattern is not None:
            so.enable_mem_pattern = settings.enable_mem_pattern
        so.log_severity_level = 3
        return so

    def _make_session(self, so: ort.SessionOptions) -> ort.InferenceSession:
        try:
            session = ort.InferenceSession(str(self.model_path), so, providers=self.providers)
        except Exception as exc:  # ORT raises its own exception types
            raise ProfilingError(f"ONNX Runtime cannot load {self.model_path}: {exc}") from None
        used = session.get_providers()
        if self._on_gpu and used[:1] != self.provider_names[:1]:
            # ORT lists the CUDA provider whenever onnxruntime-gpu is installed, and falls
            # back to the CPU with a log line when the CUDA/cuDNN libraries do not load.
            raise ProfilingError(
                f"ONNX Runtime did not put {self.model_path.name} on {self.provider_names[0]} "
                f"({self.device}): the session runs on {used}. The CUDA and cuDNN libraries "
                "onnxruntime-gpu needs did not load (or the device does not exist); nothing "
                "is reported as a GPU run."
            )
        return session

    def _trace_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            schema.GRAPH_OPTIMIZATIONS: "enabled" if self.optimizations else "disabled",
            schema.GRAPH_OPTIMIZATION_LEVEL: self.graph_level.name,
            # 0: ONNX Runtime's default (one thread per physical core)
            schema.INTRA_OP_THREADS: self.intra_op_threads,
        }
        if self._on_gpu:
            attrs.update({schema.DEVICE: self.device, schema.LAYER_TIME_BASE: "host"})
        return attrs

    def input_metadata(self) -> list[tuple[str, list[int | str | None], str]]:
        """(name, shape with symbolic dims, ORT type string) of each model input."""
        return [(i.name, list(i.shape), i.type) for i in self.session.get_inputs()]

    def _profiled_run(
        self, feed: dict[str, np.ndarray], iterations: int, warmup: int, kernels: bool
    ) -> LevelRun:
        with tempfile.TemporaryDirectory(prefix="xsp-ort-") as tmp:
            so = self._options()
            so.enable_profiling = True
            so.profile_file_prefix = os.path.join(tmp, "profile")
            opt_path = os.path.join(tmp, "optimized.onnx")
            if self.optimizations:
                so.optimized_model_filepath = opt_path
                so.add_session_config_entry(
                    "session.optimized_model_external_initializers_file_name", "weights.bin"
                )
                so.add_session_config_entry(
                    "session.optimized_model_external_initializers_min_size_in_bytes", "64"
                )
            session = self._make_session(so)
            # Warm up before CUPTI records: warm-up launches lie outside every timed wall and
            # would fail the clock check (cuDNN's algorithm search among them).
            warm_up(lambda: session.run(None, feed), warmup)
            tracer = None
            if kernels:
                tracer = CuptiTracer()
                tracer.start()
            try:
                walls, _ = timed_loop(lambda: session.run(None, feed), iterations, 0)
            finally:
                records = tracer.stop() if tracer is not None else []
            events = json.loads(Path(session.end_profiling()).read_text())
            if any(e.get("cat") == "Kernel" for e in events):
                # Only an ONNX Runtime built with CUDA profiling writes kernel events, and it
                # is a CUPTI client: say so before it meets CuptiTracer in this process.
                PROCESS_OWNER.claim(ORT_CUDA_PROFILER)
            mapping = None
            graph = self.original  # the graph ORT ran (names and initializers)
            if self.optimizations and os.path.exists(opt_path):
                graph = onnx_graph.load_graph(opt_path)
                mapping = onnx_graph.attribute(self.original, graph)
        iterations_out, attrs = self._parse(events, walls, mapping, graph)
        if tracer is not None:
            spans_all = records_to_spans(records, tracer.offset_ns)
            check = require_clock(spans_all, walls)  # raises ClockCheckError: nothing stored
            for it, spans in zip(iterations_out, split_spans(spans_all, walls), strict=True):
                it.spans.extend(spans)
            attrs.update(
                {
                    schema.KERNEL_LEVEL: "captured",
                    schema.CUPTI_API_RECORDS: tracer.api_filter,
                    schema.CUPTI_RECORDS: len(records),
                    schema.CLOCK_CHECK: f"ok ({check.gpu_records} GPU, "
                    f"{check.api_records} API records)",
                }
            )
        return LevelRun(Level.KERNEL if kernels else Level.LAYER, iterations_out, warmup, attrs)

    def _parse(
        self,
        events: list[dict[str, Any]],
        walls: list[tuple[int, int]],
        mapping: dict[str, list[str]] | None,
        graph: Any = None,
    ) -> tuple[list[Iteration], dict[str, Any]]:
        runs = sorted(
            (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
            key=lambda e: e["ts"],
        )[-len(walls) :]
        marks = [(int(e["ts"]) * 1000, (int(e["ts"]) + int(e["dur"])) * 1000) for e in runs]
        offset = align_offset(walls, marks)
        nodes = sorted(
            (e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
            key=lambda e: e["ts"],
        )
        originals = onnx_graph.original_nodes(self.original)
        renamed = 0
        iterations: list[Iteration] = []
        cursor = 0
        for (w0, w1), (m0, m1) in zip(walls, marks, strict=True):
            layer_events = []
            while cursor < len(nodes) and nodes[cursor]["ts"] * 1000 < m0:
                cursor += 1
            while cursor < len(nodes) and nodes[cursor]["ts"] * 1000 <= m1:
                layer_events.append(nodes[cursor])
                cursor += 1
            names = [e["name"][: -len("_kernel_time")] for e in layer_events]
            spans = [model_span(self.model_path.stem, w0, w1)]
            for event, name, key in zip(layer_events, names, keyed(names), strict=True):
                span = self._layer_span(event, name, key, offset, originals, mapping, graph)
                renamed += int(span.attributes[schema.ORIGINAL_NODES] != [name])
                spans.append(span)
            iterations.append(Iteration(w1 - w0, spans))
        attrs = self._trace_attributes()
        attrs[schema.LAYER_NAMES] = "original" if renamed == 0 else "optimized"
        if mapping is not None:
            covered = {n for names in mapping.values() for n in names}
            attrs[schema.ORIGINAL_NODES_ATTRIBUTED] = len(covered)
            attrs[schema.ORIGINAL_NODES_TOTAL] = len(originals)
        return iterations, attrs

    def _layer_span(
        self,
        event: dict[str, Any],
        name: str,
        key: str,
        offset: int,
        originals: dict[str, str],
        mapping: dict[str, list[str]] | None,
        graph: Any = None,
    ) -> RawSpan:
        args = event.get("args", {})
        op_type = str(args.get("op_name", "unknown"))
        in_shapes = [
            list(map(int, s)) for e in args.get("input_type_shape", []) for s in e.values()
        ]
        if graph is not None:  # weights ORT pre-packed are missing from its event
            in_shapes = onnx_graph.complete_input_shapes(graph, name, in_shapes)
        out_shapes = [
            list(map(int, s)) for e in args.get("output_type_shape", []) for s in e.values()
        ]
        dtypes = [d for e in args.get("output_type_shape", []) for d in e]
        orig = mapping.get(name, []) if mapping is not None else [name] if name in originals else []
        orig_types = [originals[n] for n in orig if n in originals]
        attrs: dict[str, Any] = {
            schema.OP_TYPE: fused_type(op_type, orig_types),
            schema.RUNTIME_OP_TYPE: op_type,
            schema.INPUT_SHAPES: in_shapes,
            schema.OUTPUT_SHAPES: out_shapes,
            schema.PROVIDER: args.get("provider", ""),
            schema.ACTIVATION_BYTES: int(args.get("activation_size", 0)),
            schema.PARAMETER_BYTES: int(args.get("parameter_size", 0)),
            schema.OUTPUT_BYTES: int(args.get("output_size", 0)),
            schema.ALLOCATED_BYTES: int(args.get("output_size", 0)),
            schema.ORIGINAL_NODES: orig,
            schema.ORIGINAL_OP_TYPES: orig_types,
        }
        if dtypes:
            attrs[schema.DTYPE] = dtypes[0]
        start = int(event["ts"]) * 1000 + offset
        end = (int(event["ts"]) + int(event["dur"])) * 1000 + offset
        return RawSpan(
            Level.LAYER, name, attrs[schema.OP_TYPE], start, end, key=key, attributes=attrs
        )


def fused_type(runtime_op: str, original_types: Sequence[str]) -> str:
    """A layer's type as it is: `Conv+Relu` for a node ORT fused from a Conv and a Relu (the
    original nodes' types in graph order), else the op ORT ran."""
    return "+".join(original_types) if len(original_types) > 1 else runtime_op
