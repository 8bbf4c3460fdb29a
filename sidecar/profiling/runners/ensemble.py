"""Ensemble runner: a Triton ensemble replayed as its graph, each step by its own runner.

The steps (`ensemble.graph`) run in dependency order, their tensors mapped through
`input_map`/`output_map`: one unprofiled pass through the graph gives each step its inputs
(ONNX steps in ONNX Runtime, Python steps by their `model.py`, as a BLS call runs them). Then,
for the level asked, every step's runner runs its own timed loop on its inputs at that level
(or at its deepest level above it, as its notes say): each level is still timed in its own
run. Iteration i of the ensemble is iteration i of every step, laid end to end on the clock:
a model span for the ensemble (key `model`, its latency the sum of the steps') holding one
model span per step, named after the step's model and keyed `<ensemble>/<step model>`
(attribute `ensemble_step`), holding that step's layers and kernels. The replay has no
ensemble scheduler, so no time passes between steps.

A step that cannot be replayed (its model is not found, no runner loads it, or it answers with
an error) stops the replay at that step, as Triton stops the ensemble's request. When it is the
first step there is nothing to profile: `StepNotReplayableError` names it and says why. A later
one gives a partial profile: the steps before it are profiled as above, and the runs carry
`partial_replay` (the failed step and why: the experiment makes the trace `status = error`
with that reason, spans kept) and `ensemble_failed_step` (`step`, `index`, `model`, `reason`).
ONNX and Python steps run in the data flow as a BLS call runs them, TorchScript and SavedModel
steps by their own runner (`ensemble.step_outputs`). A decoupled step is supported as the last
step (no step reads its outputs: its runner collects all its responses); one whose outputs
another step reads is not: Triton sends each of its responses on to the next steps as a request
of its own, so the ensemble answers with a stream, while this replay runs each step once. An
ensemble replays on the CPU (`replay.device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sidecar.profiling.ensemble.graph import EnsembleStep, in_order, steps_of
from sidecar.profiling.ensemble.step_outputs import RUNNER_FORMATS, ordered_feed, step_outputs
from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.python_backend.bls import BlsRouter
from sidecar.profiling.vocabulary import (
    ENSEMBLE_STEP,
    PARTIAL_REPLAY,
    Iteration,
    LevelRun,
    ModelLookup,
    ProfilingError,
    RawSpan,
    Runner,
    RuntimeInfo,
)
from sidecar.trace import schema
from sidecar.trace.spans import REPLAY_LEVELS, Level

STEP_ATTRIBUTE = ENSEMBLE_STEP  # on a step's model span: its `<ensemble>/<step>` key
METHOD = (
    "each step in its own timed loop at the level, iterations laid end to end "
    "(no ensemble scheduler: no time between steps)"
)


class StepNotReplayableError(ProfilingError):
    """A step of the ensemble cannot be replayed: the replay stops at it."""


@dataclasses.dataclass(frozen=True)
class StepFailure:
    """The step the replay stopped at (`index` from 0) and why."""

    index: int
    model: str
    key: str
    message: str  # the whole sentence: ensemble, step, why

    def record(self) -> dict[str, Any]:
        return {"step": self.key, "index": self.index, "model": self.model, "reason": self.message}


@dataclasses.dataclass
class _Step:
    step: EnsembleStep
    index: int
    key: str
    runner: Runner
    location: Any  # the step model's `ModelLocation`
    last: bool = False  # no later step reads its outputs


class EnsembleRunner:
    """Replay an ensemble (`ModelLocation` of format `ensemble`) step by step.

    `step_runner(location)` loads a step's runner (`select.runner_for`); `find(repository,
    model, version)` resolves a step's model (the repository's lookup)."""

    name = "ensemble"

    def __init__(
        self,
        location: Any,
        step_runner: Callable[[Any], Runner],
        find: ModelLookup,
    ) -> None:
        self.location = location
        self.ensemble: str = location.name
        repository = location.path.parent.parent
        self.find = find
        inputs = [t.name for t in location.inputs]
        self.steps: list[_Step] = []
        self.unloadable: StepFailure | None = None  # a step no runner loads: the steps end there
        ordered = in_order(steps_of(location.config), inputs)
        for index, step in enumerate(ordered):
            key = step.key(self.ensemble)
            try:
                found = self.find(repository, step.model, _version(step))
                _check_decoupled(found, step, ordered[index + 1 :])
                runner = step_runner(found)
            except Exception as exc:
                message = (
                    f"ensemble {self.ensemble!r} step {index + 1} ({step.model!r}) cannot be "
                    f"replayed, so the replay stopped at that step: {type(exc).__name__}: {exc}"
                )
                if index == 0:
                    raise StepNotReplayableError(message) from None
                self.unloadable = StepFailure(index, step.model, key, message)
                break
            self.steps.append(_Step(step, index, key, runner, found))
        self.failure = self.unloadable  # where the last `flow` stopped, if it did
        self.router = BlsRouter(repository, find=self.find)

    def describe(self) -> RuntimeInfo:
        infos = [(s, s.runner.describe()) for s in self.steps]
        provider = "; ".join(f"{s.step.model}: {i.label}" for s, i in infos)
        notes: dict[str, str] = {}
        for level in REPLAY_LEVELS:
            said = [
                f"step {s.step.model}: {i.notes[level.value]}"
                for s, i in infos
                if level.value in i.notes
            ]
            if said:
                notes[level.value] = "; ".join(said)
        return RuntimeInfo("ensemble", "graph", provider, infos[0][1].device, notes)

    def supported_levels(self) -> tuple[Level, ...]:
        found = {lv for s in self.steps for lv in s.runner.supported_levels()}
        return tuple(lv for lv in REPLAY_LEVELS if lv in found)

    def close(self) -> None:
        """Close each step's runner and the Python models the data flow loaded (their
        `finalize`)."""
        for s in self.steps:
            close = getattr(s.runner, "close", None)
            if callable(close):
                close()
        for model in self.router.python_models():
            model.finalize()

    def flow(self, inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """One unprofiled pass through the graph: each step's inputs, in order (the last
        step's outputs included in the ensemble's tensors)."""
        self.router.calls.clear()  # the router records each call: none are kept here
        self.failure = self.unloadable
        tensors = dict(inputs)
        fed: list[dict[str, np.ndarray]] = []
        for s in self.steps:
            feed = ordered_feed(s.location, s.step.feed(tensors))
            try:
                outputs = self._outputs(s, feed)
                if outputs is not None:
                    s.step.publish(outputs, tensors)
            except StepNotReplayableError as exc:
                if s.index == 0:
                    raise
                self.failure = StepFailure(s.index, s.step.model, s.key, str(exc))
                break
            fed.append(feed)
        return fed

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        fed = self.flow(inputs)
        runs: list[tuple[_Step, LevelRun]] = []
        for s, feed in zip(self.steps, fed, strict=False):  # up to a step that failed
            runs.append((s, s.runner.run(feed, _level_for(s.runner, level), iterations, warmup)))
        count = min(len(r.iterations) for _, r in runs)
        its = [self._iteration([(s, r.iterations[i]) for s, r in runs]) for i in range(count)]
        attrs: dict[str, Any] = {
            schema.ENSEMBLE_REPLAY: METHOD,
            f"ensemble_steps_{level.value}": {
                s.key: {"level": r.level.value, **_json_safe(r.attributes)} for s, r in runs
            },
        }
        if self.failure is not None:
            attrs[PARTIAL_REPLAY] = self.failure.message
            attrs[schema.ENSEMBLE_FAILED_STEP] = self.failure.record()
        return LevelRun(level, its, warmup, attrs)

    # -- internals ----------------------------------------------------------------------
    def _outputs(self, s: _Step, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The step's outputs (None for a decoupled last step: nothing reads them)."""
        if _decoupled(s.location):  # `_check_decoupled`: the last step
            return None
        if s.location.format in RUNNER_FORMATS:
            try:
                return step_outputs(s.location, s.runner, feed)
            except Exception as exc:
                raise StepNotReplayableError(
                    self._stopped(s, f"{type(exc).__name__}: {exc}")
                ) from None
        request = pb_utils.InferenceRequest(
            model_name=s.step.model,
            inputs=[pb_utils.Tensor(n, np.asarray(a)) for n, a in feed.items()],
            requested_output_names=[inner for inner, _ in s.step.output_map],
            model_version=s.step.version,
        )
        try:
            response = self.router(request)
        except Exception as exc:  # the router answers errors; this is a fault in it
            raise StepNotReplayableError(self._stopped(s, f"{type(exc).__name__}: {exc}")) from None
        if not isinstance(response, pb_utils.InferenceResponse):
            raise StepNotReplayableError(
                self._stopped(s, "a decoupled step (several responses) is not supported")
            )
        if response.has_error():
            error = response.error()
            raise StepNotReplayableError(self._stopped(s, error.message() if error else "error"))
        return {t.name(): t.as_numpy() for t in response.output_tensors()}

    def _stopped(self, s: _Step, why: str) -> str:
        return (
            f"ensemble {self.ensemble!r} step {s.index + 1} ({s.step.model!r}) failed, so the "
            f"replay stopped at that step: {why}"
        )

    def _iteration(self, parts: list[tuple[_Step, Iteration]]) -> Iteration:
        spans: list[RawSpan] = []
        cursor: int | None = None
        first = 0
        total = 0
        for s, it in parts:
            head = it.spans[0]
            shift = 0 if cursor is None else cursor - head.start_ns
            if cursor is None:
                first = head.start_ns
            for raw in it.spans:
                spans.append(self._placed(s, raw, shift, raw is head))
            cursor = head.end_ns + shift
            total += it.latency_ns
        end = cursor if cursor is not None else first
        ensemble = RawSpan(
            Level.MODEL,
            self.ensemble,
            "ensemble",
            first,
            max(end, first + total),
            key="model",
            attributes={schema.ENSEMBLE_STEPS: [s.key for s, _ in parts]},
        )
        return Iteration(total, [ensemble, *spans])

    def _placed(self, s: _Step, raw: RawSpan, shift: int, head: bool) -> RawSpan:
        attrs = dict(raw.attributes)
        if head:
            attrs.update(
                {STEP_ATTRIBUTE: s.key, schema.STEP_INDEX: s.index, schema.ENSEMBLE: self.ensemble}
            )
            return RawSpan(
                raw.level,
                s.step.model,
                raw.kind,
                raw.start_ns + shift,
                raw.end_ns + shift,
                key=s.key,
                attributes=attrs,
            )
        return RawSpan(
            raw.level,
            raw.name,
            raw.kind,
            raw.start_ns + shift,
            raw.end_ns + shift,
            key=f"{s.key}:{raw.key}",
            attributes=attrs,
        )


def _decoupled(location: Any) -> bool:
    config = getattr(location, "config", None)
    return bool(config is not None and config.model_transaction_policy.decoupled)


def _check_decoupled(location: Any, step: EnsembleStep, later: list[EnsembleStep]) -> None:
    """A decoupled step whose outputs a later step reads is not supported (module doc)."""
    if not _decoupled(location):
        return
    written = {outer for _, outer in step.output_map}
    readers = [s.model for s in later if written & {outer for _, outer in s.input_map}]
    if readers:
        raise NotImplementedError(
            f"{step.model!r} is a decoupled model and step(s) {', '.join(map(repr, readers))} "
            "read its outputs: Triton sends each of its responses on to them as a request of "
            "its own (the ensemble answers with a stream), and this replay runs each step once "
            "(a decoupled step is supported as the last step)"
        )


def _version(step: EnsembleStep) -> int | None:
    return None if step.version < 0 else step.version


def _level_for(runner: Runner, level: Level) -> Level:
    """`level`, or the step runner's deepest supported level above it."""
    supported = runner.supported_levels()
    usable = [lv for lv in supported if lv.depth <= level.depth]
    return max(usable, key=lambda lv: lv.depth) if usable else Level.MODEL


def _json_safe(attrs: Mapping[str, Any]) -> dict[str, Any]:
    import json

    return {k: v for k, v in attrs.items() if _dumps_ok(json, v)}


def _dumps_ok(json: Any, value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
