"""The timed loops and clock offsets every runner uses.

Each timed run is one slice of the profile (`sidecar.profiling.pacing`); intervals come back
on the Unix-epoch ns clock (`epoch_offset_ns`), and a profiler's own clock is mapped onto it
with one offset per run (`align_offset`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sidecar.profiling import pacing
from sidecar.profiling.vocabulary import ProfilingError

T = TypeVar("T")


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


def check_iterations(iterations: int, warmup: int) -> None:
    if iterations < 1:
        raise ProfilingError(f"--iterations must be at least 1, got {iterations}")
    if warmup < 0:
        raise ProfilingError(f"--warmup must be 0 or more, got {warmup}")
