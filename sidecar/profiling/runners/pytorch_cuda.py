"""The CUDA levels of the PyTorch runner (`PyTorchRunner(model, device="cuda[:N]")`).

- M: wall time of `forward` ended by `torch.cuda.synchronize()`; the GPU time between two
  CUDA events around the forward is stored beside it (`gpu_time_ns` on the model span).
- L: forward pre/post hooks on every module of the tree (not only the leaves), so layer
  spans nest; each hook records its host time and a CUDA event (no host synchronisation).
  A layer's time is its interval on the GPU timeline between its two events; the host
  interval (where its kernels are launched) is kept beside it. One span per call.
- K: the same hooks without events, and `CuptiTracer` recording kernels, memcpys, memsets
  and only the API calls that launch them. Each iteration's records are clock-checked
  against the host walls (`gpu.clock_check`); a violation fails the profile.
- Metrics: after K, one forward in a child process under Nsight Compute when `ncu` is on
  PATH (`gpu.metrics_level.live_metrics_level`), its metrics joined to K's kernels.
- torch.profiler is never used on CUDA, so CUPTI has one owner in the process (`gpu.owner`).

This module needs a CUDA GPU; nothing in it runs on a CPU-only machine except `ModuleHooks`
without events (which the tests use).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from sidecar.profiling.gpu.attribution import group_graph_replays
from sidecar.profiling.gpu.clock_check import require_clock
from sidecar.profiling.gpu.cupti_tracer import CuptiTracer, records_to_spans, split_spans
from sidecar.profiling.gpu.layers import ModuleCall, call_spans
from sidecar.profiling.runners.timing import epoch_offset_ns, paced_runs, warm_up
from sidecar.profiling.torch_modules import hookable_modules
from sidecar.profiling.vocabulary import Iteration, RawSpan, model_span
from sidecar.trace import schema


class ModuleHooks:
    """Forward pre/post hooks on every submodule of `model` that record one `ModuleCall`
    per call (host `perf_counter_ns`, and CUDA events when `events` is true)."""

    def __init__(
        self,
        model: Any,
        *,
        events: bool,
        attrs: Callable[[Any, Any, Any], dict[str, Any]] | None = None,
    ) -> None:
        self.model = model
        self.events = events
        self.attrs_of = attrs
        self.calls: list[ModuleCall] = []
        self.marks: list[tuple[Any, Any]] = []  # (pre, post) CUDA events per call
        self.capture_attrs = True
        self._attrs: dict[str, dict[str, Any]] = {}
        self._stack: list[int] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ModuleHooks:
        import torch

        clock = time.perf_counter_ns

        def pre(name: str, type_: str) -> Any:
            def hook(module: Any, inputs: Any) -> None:
                ev = None
                if self.events:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                parent = self._stack[-1] if self._stack else None
                if parent is not None:  # a call is a leaf until a module call opens inside it
                    self.calls[parent].leaf = False
                depth = name.count(".") + 1
                call = ModuleCall(name, type_, clock(), 0, depth, parent)
                self._stack.append(len(self.calls))
                self.calls.append(call)
                self.marks.append((ev, None))

            return hook

        def post(name: str) -> Any:
            def hook(module: Any, inputs: Any, output: Any) -> None:
                t1 = clock()
                i = self._stack.pop()
                self.calls[i].end_ns = t1
                if self.events:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    self.marks[i] = (self.marks[i][0], ev)
                if self.attrs_of is not None:
                    if self.capture_attrs and name not in self._attrs:
                        self._attrs[name] = self.attrs_of(module, inputs, output)
                    self.calls[i].attributes = dict(self._attrs.get(name, {}))

            return hook

        try:
            for name, module in hookable_modules(self.model):
                if not name:  # the root is the model span
                    continue
                type_ = type(module).__name__
                self._handles.append(module.register_forward_pre_hook(pre(name, type_)))
                self._handles.append(module.register_forward_hook(post(name)))
        except BaseException:
            self.__exit__()  # never leave hooks behind on a model the worker keeps
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.calls = []
        self.marks = []
        self._stack.clear()

    def resolve_events(self, origin: Any) -> None:
        """After the forward was synchronised: GPU times of every call, relative to the
        event `origin` recorded before the forward."""
        for call, (ev0, ev1) in zip(self.calls, self.marks, strict=True):
            if ev0 is not None and ev1 is not None:
                call.gpu_start_ms = float(origin.elapsed_time(ev0))
                call.gpu_ms = float(ev0.elapsed_time(ev1))


class CudaLevels:
    """M, L and K of one model on one CUDA device (see the module docstring)."""

    def __init__(
        self,
        torch: Any,
        model: Any,
        device: Any,
        model_name: str,
        attrs: Callable[[Any, Any, Any], dict[str, Any]],
        hookable: bool,
    ) -> None:
        self.torch = torch
        self.model = model
        self.device = device
        self.model_name = model_name
        self.attrs = attrs
        self.hookable = hookable

    def _sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        with self.torch.cuda.device(self.device):
            yield

    def model_run(self, args: list[Any], iterations: int, warmup: int) -> list[Iteration]:
        torch = self.torch
        with self._on_device():
            warm_up(lambda: self.model(*args), warmup)
            self._sync()
            offset = epoch_offset_ns()

            def once() -> tuple[Iteration, int]:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter_ns()
                e0.record()
                self.model(*args)
                e1.record()
                self._sync()
                t1 = time.perf_counter_ns()
                gpu_ns = round(e0.elapsed_time(e1) * 1e6)
                span = model_span(self.model_name, t0 + offset, t1 + offset, gpu_time_ns=gpu_ns)
                return Iteration(t1 - t0, [span]), t1 - t0

            return paced_runs(once, iterations)

    def layer_run(self, args: list[Any], iterations: int, warmup: int) -> list[Iteration]:
        torch = self.torch
        with self._on_device(), ModuleHooks(self.model, events=True, attrs=self.attrs) as hooks:

            def forward() -> None:
                hooks.reset()
                self.model(*args)

            warm_up(forward, max(warmup, 1))
            self._sync()
            hooks.capture_attrs = False
            offset = epoch_offset_ns()

            def once() -> tuple[Iteration, int]:
                hooks.reset()
                origin = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter_ns()
                origin.record()
                self.model(*args)
                self._sync()
                t1 = time.perf_counter_ns()
                hooks.resolve_events(origin)
                spans = [model_span(self.model_name, t0 + offset, t1 + offset)]
                spans.extend(call_spans(hooks.calls, offset, gpu_origin_ns=t0 + offset))
                return Iteration(t1 - t0, spans), t1 - t0

            return paced_runs(once, iterations)

    def kernel_run(
        self, args: list[Any], iterations: int, warmup: int
    ) -> tuple[list[Iteration], dict[str, Any]]:
        hooks_cm: Any = (
            ModuleHooks(self.model, events=False, attrs=self.attrs)
            if self.hookable
            else contextlib.nullcontext()
        )
        tracer = CuptiTracer()
        with self._on_device(), hooks_cm as hooks:

            def forward() -> None:
                if hooks is not None:
                    hooks.reset()
                self.model(*args)

            warm_up(forward, max(warmup, 1))
            self._sync()
            if hooks is not None:
                hooks.capture_attrs = False
            offset = epoch_offset_ns()

            def once() -> tuple[tuple[tuple[int, int], list[ModuleCall]], int]:
                if hooks is not None:
                    hooks.reset()
                t0 = time.perf_counter_ns()
                self.model(*args)
                self._sync()
                t1 = time.perf_counter_ns()
                calls = list(hooks.calls) if hooks is not None else []
                return ((t0 + offset, t1 + offset), calls), t1 - t0

            tracer.start()  # after the warm-up: its launches lie outside every timed wall
            try:
                runs = paced_runs(once, iterations)
            finally:
                records = tracer.stop()
        walls = [wall for wall, _ in runs]
        calls = [its_calls for _, its_calls in runs]
        spans_all = records_to_spans(records, tracer.offset_ns)
        check = require_clock(spans_all, walls)
        out: list[Iteration] = []
        for (w0, w1), kernels, its_calls in zip(
            walls, split_spans(spans_all, walls), calls, strict=True
        ):
            spans: list[RawSpan] = [model_span(self.model_name, w0, w1)]
            for layer in call_spans(its_calls, offset):
                layer.attributes[schema.TIME_BASE] = "host"
                spans.append(layer)
            spans.extend(group_graph_replays(kernels))
            spans.extend(kernels)
            out.append(Iteration(w1 - w0, spans))
        attrs = {
            schema.CUPTI_API_RECORDS: tracer.api_filter,
            schema.CUPTI_RECORDS: len(records),
            schema.CLOCK_CHECK: f"ok ({check.gpu_records} GPU, {check.api_records} API records)",
        }
        return out, attrs
