"""The small interface every runtime runner implements, and the records it returns.

A runner executes one model on one input with profilers enabled down to a level and returns
the model latency of every timed iteration plus the spans each iteration produced, already
on the Unix-epoch ns clock (one offset per run). The leveled experiment does the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from sidecar.profiling import pacing
from sidecar.trace.spans import Level

T = TypeVar("T")


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


def epoch_offset_ns() -> int:
    """Offset that turns `time.perf_counter_ns()` into Unix-epoch ns (sample once per run)."""
    best: tuple[int, int] | None = None
    for _ in range(5):  # keep the sample with the tightest bracket
        p0 = time.perf_counter_ns()
        wall = time.time_ns()
        p1 = time.perf_counter_ns()
        if best is None or p1 - p0 < best[0]:
            best = (p1 - p0, wall - (p0 + p1) // 2)
    assert best is not None
    return best[1]


def align_offset(walls: Sequence[tuple[int, int]], marks: Sequence[tuple[int, int]]) -> int:
    """One offset that maps a profiler's clock onto ours for a whole run.

    `walls` are our model intervals (epoch ns) and `marks` the profiler's own per-iteration
    model events (its clock), pairwise. Centres are matched and the median taken, so the
    profiler's events land inside the wall interval that encloses them.
    """
    if not walls or len(walls) != len(marks):
        raise ProfilingError(
            f"cannot align profiler clock: {len(walls)} timed runs vs {len(marks)} profiler runs"
        )
    diffs = [
        (w0 + w1) // 2 - (m0 + m1) // 2 for (w0, w1), (m0, m1) in zip(walls, marks, strict=True)
    ]
    return int(statistics.median(diffs))


def warm_up(fn: Callable[[], Any], warmup: int) -> pacing.Pacer:
    """Run `fn` `warmup` times, each as a slice the process's pacer may hold back; return
    the pacer."""
    gate = pacing.pacer()
    for _ in range(warmup):
        gate.wait()
        fn()
    return gate


def timed_loop(
    fn: Callable[[], Any], iterations: int, warmup: int
) -> tuple[list[tuple[int, int]], int]:
    """Run `fn` warmup + iterations times; return the timed (start, end) epoch-ns intervals
    and the epoch offset used. The timed runs are `paced_runs`: every run's interval is
    returned (a profiler saw them all); the loop's `LoopRecord` names the runs the
    experiment discards."""
    warm_up(fn, warmup)
    offset = epoch_offset_ns()
    clock = time.perf_counter_ns

    def once() -> tuple[tuple[int, int], int]:
        t0 = clock()
        fn()
        t1 = clock()
        return (t0 + offset, t1 + offset), t1 - t0

    return paced_runs(once, iterations), offset


def paced_runs(run_once: Callable[[], tuple[T, int]], iterations: int) -> list[T]:
    """Results of `run_once` (which returns its result and its wall ns) until `iterations`
    runs were not interrupted.

    Each run is one slice of the profile (`sidecar.profiling.pacing`): the process's pacer
    may hold it back, and a run it reports interrupted is run again, up to
    `MAX_ATTEMPTS_PER_ITERATION` runs per wanted one. Every run's result is returned; the
    `LoopRecord` left for the experiment names the interrupted ones."""
    gate = pacing.pacer()
    results: list[T] = []
    interrupted: list[int] = []
    attempts = iterations * pacing.MAX_ATTEMPTS_PER_ITERATION
    while len(results) - len(interrupted) < iterations and len(results) < attempts:
        gate.wait()
        mark = gate.begin()
        result, wall_ns = run_once()
        if gate.interrupted(mark, wall_ns):
            interrupted.append(len(results))
        results.append(result)
    record = pacing.LoopRecord(len(results), interrupted)
    if len(results) == len(interrupted):  # never a clean run: keep them, and say so
        record = pacing.LoopRecord(len(results), [], kept_interrupted=len(results))
    pacing.record_loop(record)
    return results


def model_span(name: str, start_ns: int, end_ns: int, **attributes: Any) -> RawSpan:
    return RawSpan(Level.MODEL, name, "model", start_ns, end_ns, key="model", attributes=attributes)


def check_iterations(iterations: int, warmup: int) -> None:
    if iterations < 1:
        raise ProfilingError(f"--iterations must be at least 1, got {iterations}")
    if warmup < 0:
        raise ProfilingError(f"--warmup must be 0 or more, got {warmup}")


def keyed(names: Sequence[str]) -> list[str]:
    """Stable keys for spans in execution order: the name, plus `#n` for repeats."""
    seen: dict[str, int] = {}
    keys = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        keys.append(name if n == 0 else f"{name}#{n}")
    return keys


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (or the platform's machine string)."""
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} (CPU)"
    except OSError:
        pass
    return f"{platform.machine()} (CPU)"
