"""The profiler's shared vocabulary: what a runner returns and the errors a profile raises.

A runner executes one model on one input with profilers enabled down to a level and returns
the model latency of every timed iteration plus the spans each iteration produced, already
on the Unix-epoch ns clock (one offset per run). The leveled experiment does the rest.

`runners/` (one runner per runtime) and `gpu/` (CUPTI, attribution, Nsight Compute, the
recording runner) both speak it; it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sidecar.trace import schema
from sidecar.trace.spans import Level

ENSEMBLE_STEP = schema.ENSEMBLE_STEP  # attribute of an ensemble step's model span: its step key
# `LevelRun` attribute: why the run covers only part of the model (an ensemble stopped at a
# failed step); the experiment then makes the trace `status = error` with it, spans kept
PARTIAL_REPLAY = schema.PARTIAL_REPLAY
# The name of a request's input sent without one (TF-Serving REST's plain `instances` or
# `inputs` value): a runner feeds it to a model of one input.
UNNAMED_INPUT = "_unnamed"


# A backend's model repository lookup, `find(repository, model, version) -> location` (a
# `backends.model_repository.ModelLocation`: `name`, `version`, `path`, `format`, `config`,
# `inputs`, ...), raising a `LookupError` for a model it cannot resolve. The replay (and the
# `profile` command) hand it to the runners that follow a model to its repository: a
# Python model's BLS callees, an ensemble's steps.
ModelLookup = Callable[[Path, str, "str | int | None"], Any]


class ProfilingError(Exception):
    """A profile could not be taken; the message says what to change."""


class LevelNotSupportedError(ProfilingError):
    """The runner cannot capture the requested level on this machine."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What ran the model: e.g. `onnxruntime`, `1.20.1`, `CPUExecutionProvider`, CPU name."""

    runtime: str
    version: str
    provider: str
    device: str
    notes: Mapping[str, str] = field(default_factory=dict)  # level name -> why not captured

    @property
    def label(self) -> str:
        return f"{self.runtime} {self.version} ({self.provider})"


@dataclass
class RawSpan:
    """A span as a runner measured it; `key` identifies it across iterations and runs."""

    level: Level
    name: str
    kind: str
    start_ns: int
    end_ns: int
    key: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.name

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class Iteration:
    """One timed model execution: its latency and the spans it produced (model span first)."""

    latency_ns: int
    spans: list[RawSpan] = field(default_factory=list)


@dataclass
class LevelRun:
    """All timed iterations of the run whose deepest enabled level is `level`."""

    level: Level
    iterations: list[Iteration]
    warmup: int
    attributes: dict[str, Any] = field(default_factory=dict)  # goes to the trace's attributes

    @property
    def latencies_ns(self) -> list[int]:
        return [it.latency_ns for it in self.iterations]


@runtime_checkable
class Runner(Protocol):
    """A runtime that can execute a model with profilers enabled down to a level."""

    name: str

    def describe(self) -> RuntimeInfo: ...

    def supported_levels(self) -> tuple[Level, ...]: ...

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun: ...


def model_span(name: str, start_ns: int, end_ns: int, **attributes: Any) -> RawSpan:
    return RawSpan(Level.MODEL, name, "model", start_ns, end_ns, key="model", attributes=attributes)


def keyed(names: Sequence[str]) -> list[str]:
    """Stable keys for spans in execution order: the name, plus `#n` for repeats."""
    seen: dict[str, int] = {}
    keys = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        keys.append(name if n == 0 else f"{name}#{n}")
    return keys
