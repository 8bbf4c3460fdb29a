"""Python-backend runner: a Triton Python model replayed by running its own `model.py`.

M is the time of `execute` on the sampled request (for a decoupled model, until its final
response). L adds the Python calls inside `execute` (`python_backend.calls`: the model's own
functions and the calls they make, by `sys.setprofile`; its overhead is L's overhead ratio)
and one span per BLS call (`python_backend.bls`: the called model replayed, ONNX in ONNX
Runtime, Python recursively). K adds the layers of the runtime below those calls: the nodes
ONNX Runtime ran for every session the model's code made (its own `InferenceSession`s and the
ONNX models it calls over BLS; `python_backend.runtime_sessions`), each a child of the call
that ran it. Each level is timed in its own run: M unprofiled, L with the call tracer, K with
the call tracer and ONNX Runtime's profiler. A model whose code runs no ONNX Runtime session
and, where the model's module imports torch, the outermost ATen ops of every execute
(`python_backend.torch_ops`). A model whose code runs neither has no K spans (`kernel_level`
says so).

A decoupled model's responses are all collected: each model span carries `responses`,
`time_to_first_response_ns` and `response_gaps_ns`, and the M run's trimmed means go to the
trace (`decoupled_*` attributes), for fidelity to compare with the live stream.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from sidecar.profiling.devices import cpu_name
from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.python_backend.bls import BlsRouter
from sidecar.profiling.python_backend.calls import CallTracer
from sidecar.profiling.python_backend.loader import Execution, PythonModel
from sidecar.profiling.python_backend.runtime_sessions import Profiles
from sidecar.profiling.python_backend.torch_ops import TorchOps, imports_torch
from sidecar.profiling.runners.timing import (
    check_iterations,
    epoch_offset_ns,
    paced_runs,
    warm_up,
)
from sidecar.profiling.stats import trimmed_mean
from sidecar.profiling.vocabulary import (
    Iteration,
    LevelNotSupportedError,
    LevelRun,
    ModelLookup,
    RawSpan,
    RuntimeInfo,
    keyed,
    model_span,
)
from sidecar.trace import schema
from sidecar.trace.spans import Level

NO_SESSION_NOTE = (
    "not captured: the model's code ran no ONNX Runtime session and imports no torch (K of a "
    "Python-backend model is the ONNX Runtime nodes and PyTorch ops below its calls)"
)
LAYER_METHOD = "sys.setprofile: the model's own functions and the calls they make"
KERNEL_METHOD = (
    "ONNX Runtime's profiler, in a twin of each session the model's code made, and "
    "torch.profiler where its module imports torch; each node or op a child of the Python "
    "call that ran it"
)


class PythonModelRunner:
    """Replay a Triton Python-backend model (`ModelLocation` of format `python`)."""

    name = "python_backend"

    def __init__(self, location: Any, find: ModelLookup) -> None:
        """`location`: the model's `ModelLocation`; `find`: its repository's lookup, for the
        models it calls over BLS."""
        self.location = location
        self.model = PythonModel(location)
        self.router = BlsRouter(location.path.parent.parent.parent, find)
        self.model.bls_router = self.router

    def describe(self) -> RuntimeInfo:
        version = "{}.{}.{}".format(*sys.version_info[:3])
        return RuntimeInfo(
            "python_backend",
            version,
            "model.py (triton_python_backend_utils stand-in)",
            cpu_name(),
        )

    def supported_levels(self) -> tuple[Level, ...]:
        return (Level.MODEL, Level.LAYER, Level.KERNEL)

    def close(self) -> None:
        """`finalize` the model and the Python models it called over BLS (the worker evicts
        the runner or stops), as Triton finalizes a model it unloads."""
        for model in [self.model, *self.router.python_models()]:
            model.finalize()

    def respond(self, inputs: Mapping[str, np.ndarray]) -> Execution:
        """One `execute` of the model on `inputs`, unprofiled: its responses (for tests)."""
        return self._execute(inputs)

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        check_iterations(iterations, warmup)
        if level not in (Level.MODEL, Level.LAYER, Level.KERNEL):
            raise LevelNotSupportedError(f"level {level.value!r} is not a replay level")
        layers = level is not Level.MODEL
        kernels = level is Level.KERNEL
        models = [self.model, *self.router.python_models()]
        torch_ops = TorchOps() if kernels and imports_torch(m.module for m in models) else None
        mark = torch_ops.mark if torch_ops is not None else contextlib.nullcontext
        with self._profiling(kernels) as profiles, self._torch(torch_ops):

            def execute() -> Execution:
                with mark():
                    return self._execute(inputs)

            warm_up(execute, warmup)
            offset = epoch_offset_ns()

            def once() -> tuple[Iteration, int]:
                return self._iteration(execute, offset, layers)

            its = paced_runs(once, iterations)
        attrs: dict[str, Any] = {schema.PYTHON_BACKEND: str(self.location.path.name)}
        if layers:
            attrs[schema.PYTHON_LAYER_METHOD] = LAYER_METHOD
        elif self.model.decoupled:
            attrs.update(_decoupled_summary(its))
        if kernels:
            attrs.update(self._add_nodes(its, profiles, torch_ops))
        return LevelRun(level, its, warmup, attrs)

    # -- internals ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _profiling(self, kernels: bool) -> Iterator[list[Profiles]]:
        """While open (K only), every ONNX Runtime session the model and its BLS Python
        callees made runs with the profiler on."""
        found: list[Profiles] = []
        with contextlib.ExitStack() as stack:
            if kernels:
                for model in [self.model, *self.router.python_models()]:
                    found.append(stack.enter_context(model.sessions.profiling()))
            yield found

    @staticmethod
    def _torch(torch_ops: TorchOps | None) -> contextlib.AbstractContextManager[Any]:
        return torch_ops.profiling() if torch_ops is not None else contextlib.nullcontext()

    def _add_nodes(
        self, its: list[Iteration], profiles: list[Profiles], torch_ops: TorchOps | None
    ) -> dict[str, Any]:
        """Each iteration's ONNX Runtime nodes and PyTorch ops as its kernel spans; the K
        run's attributes."""
        walls = [(it.spans[0].start_ns, it.spans[0].end_ns) for it in its]
        ops = torch_ops.spans(walls) if torch_ops is not None else [[] for _ in its]
        for it, found_ops in zip(its, ops, strict=True):
            head = it.spans[0]
            found = sorted(
                [*(n for p in profiles for n in p.within(head.start_ns, head.end_ns)), *found_ops],
                key=lambda n: n.start_ns,
            )
            for span, key in zip(found, keyed([n.name for n in found]), strict=True):
                span.key = key
            it.spans += found
        sessions = sum(p.sessions for p in profiles)
        failed = [why for p in profiles for why in p.failed]
        extra: dict[str, Any] = {schema.PYTHON_KERNEL_SESSIONS_FAILED: failed} if failed else {}
        if sessions == 0 and torch_ops is None:
            note = NO_SESSION_NOTE
            if failed:
                note = f"not captured: no profiling twin of its ONNX Runtime session: {failed[0]}"
            return {schema.KERNEL_LEVEL: note, **extra}
        return {
            **extra,
            schema.KERNEL_LEVEL: "captured",
            schema.PYTHON_KERNEL_METHOD: KERNEL_METHOD,
            schema.PYTHON_KERNEL_SESSIONS: sessions,
            schema.PYTHON_KERNEL_TORCH: torch_ops is not None,
        }

    def _execute(self, inputs: Mapping[str, np.ndarray]) -> Execution:
        previous = pb_utils.bls_handler()
        pb_utils.set_bls_handler(self.router)
        try:
            return self.model.execute(self.model.request(inputs))
        finally:
            pb_utils.set_bls_handler(previous)

    def _iteration(
        self, execute: Callable[[], Execution], offset: int, layers: bool
    ) -> tuple[Iteration, int]:
        self.router.calls.clear()
        tracer = None
        if layers:
            models = [self.model, *self.router.python_models()]
            tracer = CallTracer(
                [str(m.path) for m in models], [m.execute_code for m in models], offset
            )
            tracer.__enter__()
        try:
            execution = execute()
        finally:
            if tracer is not None:
                tracer.__exit__(None, None, None)
        wall = execution.done_ns
        start = execution.started_ns + offset
        attrs = _response_attributes(execution, self.model.decoupled)
        spans = [model_span(self.model.name, start, start + wall, **attrs)]
        if tracer is not None:
            spans += self._layer_spans(tracer, offset)
        return Iteration(wall, spans), wall

    def _layer_spans(self, tracer: CallTracer, offset: int) -> list[RawSpan]:
        layer = tracer.finished() + [call.span(offset) for call in self.router.calls]
        layer.sort(key=lambda s: (s.start_ns, -s.end_ns))
        for span, key in zip(layer, keyed([s.name for s in layer]), strict=True):
            span.key = key
        if tracer.dropped:
            for span in layer[:1]:
                span.attributes[schema.CALLS_NOT_RECORDED] = tracer.dropped
        return layer


def _response_attributes(execution: Execution, decoupled: bool) -> dict[str, Any]:
    data = execution.with_data()
    attrs: dict[str, Any] = {schema.RESPONSES: len(data)}
    errors = [r.error for r in data if r.error is not None]
    if errors:
        attrs[schema.RESPONSE_ERROR] = errors[0]
    if decoupled:
        times = [r.at_ns for r in data]
        attrs[schema.TIME_TO_FIRST_RESPONSE_NS] = times[0] if times else None
        attrs[schema.RESPONSE_GAPS_NS] = [b - a for a, b in itertools.pairwise(times)]
        attrs[schema.EXECUTE_RETURNED_NS] = execution.returned_ns
    return attrs


def _decoupled_summary(iterations: list[Iteration]) -> dict[str, Any]:
    """Trimmed means over the M run of a decoupled model's stream."""
    firsts, gaps, counts = [], [], []
    for it in iterations:
        attrs = it.spans[0].attributes
        if attrs.get(schema.TIME_TO_FIRST_RESPONSE_NS) is not None:
            firsts.append(attrs[schema.TIME_TO_FIRST_RESPONSE_NS])
        gaps += attrs.get(schema.RESPONSE_GAPS_NS, [])
        counts.append(attrs.get(schema.RESPONSES, 0))
    return {
        schema.DECOUPLED: True,
        schema.DECOUPLED_RESPONSES: max(counts, default=0),
        schema.DECOUPLED_TIME_TO_FIRST_RESPONSE_NS: (
            round(trimmed_mean(firsts)) if firsts else None
        ),
        schema.DECOUPLED_RESPONSE_GAP_NS: round(trimmed_mean(gaps)) if gaps else None,
    }
