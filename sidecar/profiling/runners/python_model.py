"""Python-backend runner: a Triton Python model replayed by running its own `model.py`.

M is the time of `execute` on the sampled request (for a decoupled model, until its final
response). L adds the Python calls inside `execute` (`python_backend.calls`: the model's own
functions and the calls they make, by `sys.setprofile`; its overhead is L's overhead ratio)
and one span per BLS call (`python_backend.bls`: the called model replayed, ONNX in ONNX
Runtime, Python recursively). K is not captured: a Python model's kernels would be those of
the runtime it calls, which this runner does not profile below the call.

A decoupled model's responses are all collected: each model span carries `responses`,
`time_to_first_response_ns` and `response_gaps_ns`, and the M run's trimmed means go to the
trace (`decoupled_*` attributes), for fidelity to compare with the live stream.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from sidecar.profiling.devices import cpu_name
from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.python_backend.bls import BlsRouter
from sidecar.profiling.python_backend.calls import CallTracer
from sidecar.profiling.python_backend.loader import Execution, PythonModel
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
    RawSpan,
    RuntimeInfo,
    keyed,
    model_span,
)
from sidecar.trace import schema
from sidecar.trace.spans import Level

KERNEL_NOTE = (
    "not captured: a Python-backend model's replay times its Python calls (L); the runtimes "
    "it calls are not profiled below the call"
)
LAYER_METHOD = "sys.setprofile: the model's own functions and the calls they make"


class PythonModelRunner:
    """Replay a Triton Python-backend model (`ModelLocation` of format `python`)."""

    name = "python_backend"

    def __init__(self, location: Any) -> None:
        self.location = location
        self.model = PythonModel(location)
        self.router = BlsRouter(location.path.parent.parent.parent)
        self.model.bls_router = self.router

    def describe(self) -> RuntimeInfo:
        version = "{}.{}.{}".format(*sys.version_info[:3])
        return RuntimeInfo(
            "python_backend",
            version,
            "model.py (triton_python_backend_utils stand-in)",
            cpu_name(),
            {Level.KERNEL.value: KERNEL_NOTE},
        )

    def supported_levels(self) -> tuple[Level, ...]:
        return (Level.MODEL, Level.LAYER)

    def respond(self, inputs: Mapping[str, np.ndarray]) -> Execution:
        """One `execute` of the model on `inputs`, unprofiled: its responses (for tests)."""
        return self._execute(inputs)

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        check_iterations(iterations, warmup)
        if level not in (Level.MODEL, Level.LAYER):
            raise LevelNotSupportedError(f"level {level.value}: {KERNEL_NOTE}")
        warm_up(lambda: self._execute(inputs), warmup)
        offset = epoch_offset_ns()
        layers = level is Level.LAYER

        def once() -> tuple[Iteration, int]:
            return self._iteration(inputs, offset, layers)

        its = paced_runs(once, iterations)
        attrs: dict[str, Any] = {schema.PYTHON_BACKEND: str(self.location.path.name)}
        if layers:
            attrs[schema.PYTHON_LAYER_METHOD] = LAYER_METHOD
        elif self.model.decoupled:
            attrs.update(_decoupled_summary(its))
        return LevelRun(level, its, warmup, attrs)

    # -- internals ----------------------------------------------------------------------
    def _execute(self, inputs: Mapping[str, np.ndarray]) -> Execution:
        previous = pb_utils.bls_handler()
        pb_utils.set_bls_handler(self.router)
        try:
            return self.model.execute(self.model.request(inputs))
        finally:
            pb_utils.set_bls_handler(previous)

    def _iteration(
        self, inputs: Mapping[str, np.ndarray], offset: int, layers: bool
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
            execution = self._execute(inputs)
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
