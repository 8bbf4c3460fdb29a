"""PyTorch runner: `nn.Module` objects and TorchScript `.pt` files (as Triton loads them).

- M: wall time around `forward`, no profiler.
- L, nn.Module: forward pre/post hooks on the leaf modules time each module with
  `perf_counter_ns` (same clock as M, no profiler running).
- L, TorchScript: hooks are not allowed on ScriptModules, so the L run uses `torch.profiler`
  (CPU activity only) and takes the submodule `forward` events; they are named from the
  `prim::CallMethod` order of the top-level graph. Module boundaries are only visible with
  TorchScript's optimized execution off, so every level of a TorchScript profile runs with
  it off (the trace says so: `torchscript_optimized_execution`).
- K (CPU): `torch.profiler` with shapes and memory; the kernel spans are the outermost
  operators each module calls (`aten::conv2d`, `aten::linear`, ...; they do not overlap, so
  their times add up), each with `dominant_op`, the innermost op doing most of its work
  (`aten::mkldnn_convolution`, `aten::addmm`). They are placed under layers by containment;
  each layer's `allocated_bytes` sums its ops' allocations (profiler memory events).
- CUDA (`device="cuda"` or `"cuda:N"`): see `pytorch_cuda` (CUDA events in hooks on every
  module, CUPTI for kernels, never torch.profiler). On a CPU, torch.profiler is CUPTI's one
  client in the process when the torch build has CUDA (`gpu.owner`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.devices import cpu_name
from sidecar.profiling.gpu.metrics_level import (
    ModelSource,
    live_metrics_level,
    not_requested_status,
)
from sidecar.profiling.gpu.owner import PROCESS_OWNER, TORCH_PROFILER
from sidecar.profiling.runners.pytorch_cuda import CudaLevels
from sidecar.profiling.runners.timing import (
    align_offset,
    check_iterations,
    epoch_offset_ns,
    timed_loop,
)
from sidecar.profiling.server_config import TorchSettings
from sidecar.profiling.stats import trimmed_mean
from sidecar.profiling.torch_modules import (
    hookable_modules,
    is_op,
    outermost_ops,
    transformer_fastpath_off,
)
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

MODEL_MARK = "xsp::model"
LAYER_MARK = "xsp::layer::"


class PyTorchRunner:
    """Profile a `torch.nn.Module` or a TorchScript file with PyTorch on CPU."""

    name = "pytorch"

    def __init__(
        self,
        model: Any,
        *,
        device: str = "cpu",
        name: str | None = None,
        ncu_metrics: bool = False,
        settings: TorchSettings | None = None,
    ) -> None:
        """`ncu_metrics`: on CUDA, run Nsight Compute's metrics level after K (a child process
        under `ncu`; minutes for a large model), else the trace says it was not requested.
        `settings`: the PyTorch backend's parameters from `config.pbtxt` (`server_config`)."""
        import torch

        self.torch = torch
        self.settings = settings or TorchSettings()
        self.device = parse_device(torch, device)
        self.cuda = self.device.type == "cuda"
        self.ncu_metrics = ncu_metrics
        map_location = str(self.device)
        if isinstance(model, str | Path):
            path = Path(model)
            if not path.is_file():
                raise ProfilingError(f"model file not found: {path}")
            try:
                with warnings.catch_warnings():  # torch.jit is deprecated, but Triton loads it
                    warnings.simplefilter("ignore", DeprecationWarning)
                    model = torch.jit.load(str(path), map_location=map_location)
            except Exception as exc:
                raise ProfilingError(f"cannot load TorchScript file {path}: {exc}") from None
            self.model_name = name or path.stem
            self.source_path: Path | None = path
        else:
            self.model_name = name or type(model).__name__
            self.source_path = None
        self.model = model.eval()
        self.scripted = isinstance(model, torch.jit.ScriptModule)
        self.leaves = self._leaf_modules()
        if self.cuda:
            self.model = self.model.to(self.device)

    # -- Runner interface ---------------------------------------------------------------
    def describe(self) -> RuntimeInfo:
        kind = "TorchScript" if self.scripted else "eager"
        if self.cuda:
            torch = self.torch
            props = torch.cuda.get_device_properties(self.device)
            notes = {}
            if self.scripted:
                notes[Level.LAYER.value] = (
                    "not captured: TorchScript modules cannot be hooked, and on CUDA the "
                    "profiler-based layer level would make torch.profiler and CUPTI meet"
                )
            return RuntimeInfo(
                "pytorch",
                torch.__version__,
                f"{self.device}, {kind}",
                f"{props.name} ({self.device}, CUDA {torch.version.cuda})",
                notes,
            )
        return RuntimeInfo("pytorch", self.torch.__version__, f"cpu, {kind}", cpu_name())

    def supported_levels(self) -> tuple[Level, ...]:
        if self.cuda and self.scripted:
            return (Level.MODEL, Level.KERNEL)
        return (Level.MODEL, Level.LAYER, Level.KERNEL)

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        check_iterations(iterations, warmup)
        args = [self.torch.from_numpy(np.ascontiguousarray(a)) for a in inputs.values()]
        if self.cuda:
            return self._cuda_run(inputs, args, level, iterations, warmup)
        with self._context():
            if level is Level.MODEL:
                walls, _ = timed_loop(lambda: self.model(*args), iterations, warmup)
                its = [Iteration(e - s, [model_span(self.model_name, s, e)]) for s, e in walls]
            elif level is Level.LAYER and not self.scripted:
                its = self._hooked_run(args, iterations, warmup)
            elif level in (Level.LAYER, Level.KERNEL):
                its = self._profiled_run(args, iterations, warmup, kernels=level is Level.KERNEL)
            else:
                raise LevelNotSupportedError(f"level {level.value!r} is not a replay level")
        attrs: dict[str, Any] = {schema.LAYER_NAMES: "original", schema.TRANSFORMER_FASTPATH: False}
        if self.scripted:
            attrs[schema.TORCHSCRIPT_OPTIMIZED_EXECUTION] = False
        return LevelRun(level, its, warmup, attrs)

    def outputs(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One unprofiled forward on `inputs` (positional, in their order): its outputs."""
        args = [self.torch.from_numpy(np.ascontiguousarray(a)) for a in inputs.values()]
        with self.torch.inference_mode():
            out = self.model(*[a.to(self.device) for a in args])
        values = out if isinstance(out, tuple | list) else [out]
        return [v.detach().cpu().numpy() for v in values]

    # -- internals ----------------------------------------------------------------------
    def _cuda_run(
        self,
        inputs: Mapping[str, np.ndarray],
        args: list[Any],
        level: Level,
        iterations: int,
        warmup: int,
    ) -> LevelRun:
        def attrs(module: Any, inputs: Any, output: Any) -> dict[str, Any]:
            out = self._module_attrs(module, inputs, output)
            out["provider"] = str(self.device)
            return out

        args = [a.to(self.device) for a in args]
        levels = CudaLevels(
            self.torch, self.model, self.device, self.model_name, attrs, not self.scripted
        )
        extra: dict[str, Any] = {
            schema.LAYER_NAMES: "original",
            schema.DEVICE: str(self.device),
            schema.TRANSFORMER_FASTPATH: False,
        }
        if self.scripted:
            extra[schema.TORCHSCRIPT_OPTIMIZED_EXECUTION] = False
        with self._context():
            if level is Level.MODEL:
                its = levels.model_run(args, iterations, warmup)
                gpu = [int(it.spans[0].attributes[schema.GPU_TIME_NS]) for it in its]
                extra[schema.MODEL_GPU_TIME_NS] = round(trimmed_mean(gpu))  # CUDA events around M
            elif level is Level.LAYER and not self.scripted:
                its = levels.layer_run(args, iterations, warmup)
                extra[schema.LAYER_TIME_BASE] = "gpu_events"
            elif level is Level.KERNEL:
                its, k_attrs = levels.kernel_run(args, iterations, warmup)
                extra.update(k_attrs)
            else:
                raise LevelNotSupportedError(
                    f"level {level.value!r} is not available for this model on {self.device}"
                )
        if level is Level.KERNEL and not self.ncu_metrics:
            extra.update(not_requested_status())
        elif level is Level.KERNEL:  # the metrics level: its own run, in a child process
            source = (
                ModelSource(self.source_path, "torchscript")
                if self.source_path is not None
                else ModelSource(model=self.model)
            )
            extra.update(live_metrics_level(source, inputs, str(self.device), its, warmup=warmup))
        return LevelRun(level, its, warmup, extra)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            settings = self.settings
            if settings.inference_mode is False:  # as Triton's INFERENCE_MODE=false runs
                stack.enter_context(self.torch.no_grad())
            else:
                stack.enter_context(self.torch.inference_mode())
            for hook, value in (
                ("_jit_set_profiling_executor", settings.jit_executor),
                ("_jit_set_profiling_mode", settings.jit_profiling),
            ):
                if value is not None:
                    stack.enter_context(_jit_flag(self.torch, hook, value))
            stack.enter_context(transformer_fastpath_off(self.torch))
            if self.scripted:
                stack.enter_context(self.torch.jit.optimized_execution(False))
            yield

    def _leaf_modules(self) -> list[tuple[str, Any]]:
        if self.scripted:
            names = []
            for node in self.model.graph.nodes():
                if node.kind() == "prim::CallMethod" and node.s("name") == "forward":
                    owner = node.inputsAt(0).node()
                    if owner.kind() == "prim::GetAttr":
                        names.append(owner.s("name"))
            children = dict(self.model.named_children())
            return [(n, children.get(n)) for n in names]
        leaves = [(n, m) for n, m in hookable_modules(self.model) if not list(m.children())]
        return [(n or self.model_name, m) for n, m in leaves]

    def _module_attrs(self, module: Any, inputs: Any, output: Any) -> dict[str, Any]:
        torch = self.torch

        def shapes(obj: Any) -> list[list[int]]:
            if isinstance(obj, torch.Tensor):
                return [list(obj.shape)]
            if isinstance(obj, list | tuple):
                return [s for o in obj for s in shapes(o)]
            return []

        params = list(module.parameters(recurse=False)) if module is not None else []
        in_shapes = shapes(inputs) + [list(p.shape) for p in params]
        out_shapes = shapes(output)
        elem = 4
        if isinstance(output, torch.Tensor):
            elem = output.element_size()
        return {
            schema.OP_TYPE: module.original_name if self.scripted else type(module).__name__,
            schema.INPUT_SHAPES: in_shapes,
            schema.OUTPUT_SHAPES: out_shapes,
            schema.PROVIDER: "cpu",
            schema.PARAMETER_BYTES: sum(p.numel() * p.element_size() for p in params),
            schema.ACTIVATION_BYTES: sum(int(np.prod(s)) for s in shapes(inputs)) * elem,
            schema.OUTPUT_BYTES: sum(int(np.prod(s)) for s in out_shapes) * elem,
        }

    def _hooked_run(self, args: list[Any], iterations: int, warmup: int) -> list[Iteration]:
        clock = time.perf_counter_ns
        stack: list[int] = []
        records: list[tuple[str, int, int]] = []
        attrs = _CallAttributes()
        capture = [True]

        def pre(name: str) -> Any:
            def hook(module: Any, inputs: Any) -> None:
                stack.append(clock())

            return hook

        def post(name: str) -> Any:
            def hook(module: Any, inputs: Any, output: Any) -> None:
                t1 = clock()
                records.append((name, stack.pop(), t1))
                if capture[0]:
                    attrs.record(name, lambda: self._module_attrs(module, inputs, output))

            return hook

        handles = []
        for name, module in self.leaves:
            handles.append(module.register_forward_pre_hook(pre(name)))
            handles.append(module.register_forward_hook(post(name)))
        try:
            for _ in range(max(warmup, 1)):
                attrs.new_forward()
                self.model(*args)
            capture[0] = False
            offset = epoch_offset_ns()
            out: list[Iteration] = []
            for _ in range(iterations):
                records.clear()
                t0 = clock()
                self.model(*args)
                t1 = clock()
                spans = [model_span(self.model_name, t0 + offset, t1 + offset)]
                keys = keyed([r[0] for r in records])
                for (name, s, e), key in zip(records, keys, strict=True):
                    a = attrs.of(key, name)
                    spans.append(
                        RawSpan(
                            Level.LAYER,
                            name,
                            a.get(schema.OP_TYPE, "module"),
                            s + offset,
                            e + offset,
                            key=key,
                            attributes=a,
                        )
                    )
                out.append(Iteration(t1 - t0, spans))
            return out
        finally:
            for h in handles:
                h.remove()

    def _profiled_run(
        self, args: list[Any], iterations: int, warmup: int, kernels: bool
    ) -> list[Iteration]:
        from torch.autograd.profiler import record_function
        from torch.profiler import ProfilerActivity, profile

        if self.torch.cuda.is_available():  # Kineto is a CUPTI client on a CUDA build
            PROCESS_OWNER.claim(TORCH_PROFILER)
        attrs = _CallAttributes()
        handles = []
        if not self.scripted:
            marks: list[Any] = []

            def pre(name: str) -> Any:
                def hook(module: Any, inputs: Any) -> None:
                    rf = record_function(LAYER_MARK + name)
                    rf.__enter__()
                    marks.append(rf)

                return hook

            def post(name: str) -> Any:
                def hook(module: Any, inputs: Any, output: Any) -> None:
                    marks.pop().__exit__(None, None, None)
                    attrs.record(name, lambda: self._module_attrs(module, inputs, output))

                return hook

            for name, module in self.leaves:
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post(name)))

        def step() -> None:
            attrs.new_forward()
            with record_function(MODEL_MARK):
                self.model(*args)

        try:  # warm up inside the profiler too: its first iterations pay for its start-up
            with profile(
                activities=[ProfilerActivity.CPU], record_shapes=kernels, profile_memory=kernels
            ) as prof:
                walls, _ = timed_loop(step, iterations, max(warmup, 1))
            events = list(prof.events())
        finally:
            for h in handles:
                h.remove()
        return self._parse(events, walls, attrs, kernels)

    def _parse(
        self,
        events: list[Any],
        walls: list[tuple[int, int]],
        attrs: _CallAttributes,
        kernels: bool,
    ) -> list[Iteration]:
        def ns(t: float) -> int:
            return round(t * 1000)

        models = sorted(
            (e for e in events if e.name == MODEL_MARK), key=lambda e: e.time_range.start
        )[-len(walls) :]
        marks = [(ns(e.time_range.start), ns(e.time_range.end)) for e in models]
        offset = align_offset(walls, marks)
        out: list[Iteration] = []
        for (w0, w1), model in zip(walls, models, strict=True):
            layers = self._layer_events(model)
            names = [n for n, _ in layers]
            spans = [model_span(self.model_name, w0, w1)]
            layer_spans: list[RawSpan] = []
            for (name, ev), key in zip(layers, keyed(names), strict=True):
                a = attrs.of(key, name)
                if self.scripted:
                    module = dict(self.leaves).get(name)
                    a.setdefault(schema.OP_TYPE, getattr(module, "original_name", "module"))
                    a["provider"] = "cpu"
                layer_spans.append(
                    RawSpan(
                        Level.LAYER,
                        name,
                        a.get(schema.OP_TYPE, "module"),
                        ns(ev.time_range.start) + offset,
                        ns(ev.time_range.end) + offset,
                        key=key,
                        attributes=a,
                    )
                )
            spans.extend(layer_spans)
            if kernels:
                ops = outermost_ops(model)
                for ev, key in zip(ops, keyed([e.name for e in ops]), strict=True):
                    mem = max(int(getattr(ev, "cpu_memory_usage", 0) or 0), 0)
                    k = RawSpan(
                        Level.KERNEL,
                        ev.name,
                        "cpu_op",
                        ns(ev.time_range.start) + offset,
                        ns(ev.time_range.end) + offset,
                        key=key,
                        attributes={
                            schema.INPUT_SHAPES: [list(s) for s in (ev.input_shapes or [])],
                            schema.ALLOCATED_BYTES: mem,
                            schema.DEVICE: "cpu",
                            schema.DOMINANT_OP: _dominant(ev),
                        },
                    )
                    spans.append(k)
                    for layer in layer_spans:
                        if layer.start_ns <= k.start_ns and k.end_ns <= layer.end_ns:
                            layer.attributes[schema.ALLOCATED_BYTES] = (
                                layer.attributes.get(schema.ALLOCATED_BYTES, 0) + mem
                            )
                            break
            out.append(Iteration(w1 - w0, spans))
        return out

    def _layer_events(self, model_event: Any) -> list[tuple[str, Any]]:
        if not self.scripted:
            return [
                (e.name[len(LAYER_MARK) :], e)
                for e in _descendants(model_event)
                if e.name.startswith(LAYER_MARK)
            ]
        top = [e for e in model_event.cpu_children if e.name == "forward"]
        calls = [e for t in top for e in t.cpu_children if e.name == "forward"]
        calls.sort(key=lambda e: e.time_range.start)
        names = [n for n, _ in self.leaves]
        if len(calls) != len(names):  # control flow: calls do not match the graph's order
            names = [f"forward[{i}]" for i in range(len(calls))]
        return list(zip(names, calls, strict=True))


@contextlib.contextmanager
def _jit_flag(torch: Any, hook: str, value: bool) -> Iterator[None]:
    """Set a process-wide TorchScript flag (`torch._C._jit_set_*`, which returns the old
    value) for the run, as Triton's PyTorch backend sets it per execution, then restore it."""
    setter = getattr(torch._C, hook)
    old = setter(value)
    try:
        yield
    finally:
        setter(old)


class _CallAttributes:
    """Hooked modules' attributes (shapes, bytes) per call of a forward, under the keys
    `vocabulary.keyed` gives the calls (`relu`, `relu#1`, ...): a module called on
    different shapes records each call's own. The first forward that reaches a call wins."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[str, Any]] = {}
        self._calls: dict[str, int] = {}

    def new_forward(self) -> None:
        self._calls.clear()

    def record(self, name: str, attributes: Callable[[], dict[str, Any]]) -> None:
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        key = name if n == 0 else f"{name}#{n}"
        if key not in self.by_key:
            self.by_key[key] = attributes()

    def of(self, key: str, name: str) -> dict[str, Any]:
        """A copy of the call's attributes (the module's first call's where this one
        was not seen, e.g. a call only some forwards make)."""
        return dict(self.by_key.get(key, self.by_key.get(name, {})))


def parse_device(torch: Any, device: str) -> Any:
    """`cpu`, `cuda` or `cuda:N` as a `torch.device`; CUDA must be usable here."""
    text = str(device).strip().lower()
    if text != "cpu" and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise ProfilingError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LevelNotSupportedError(
            f"PyTorch on {text} needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
        )
    dev = torch.device(text if ":" in text else "cuda:0")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ProfilingError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _dominant(event: Any) -> str:
    """The innermost op that does most of an op's work (e.g. aten::conv2d ->
    aten::mkldnn_convolution): follow the longest child while it takes at least half."""
    while True:
        children = [c for c in event.cpu_children if is_op(c)]
        if not children:
            return str(event.name)
        top = max(children, key=lambda c: c.time_range.elapsed_us())
        if top.time_range.elapsed_us() < 0.5 * event.time_range.elapsed_us():
            return str(event.name)
        event = top


def _descendants(event: Any) -> list[Any]:
    out: list[Any] = []
    stack = list(reversed(event.cpu_children))
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(reversed(e.cpu_children))
    out.sort(key=lambda e: e.time_range.start)
    return out
