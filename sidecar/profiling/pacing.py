"""Slices of a profile: where a leveled run may pause, and which timed iterations it drops.

A profile taken beside live serving must not slow the requests it overlaps, and timings taken
while the profiler itself was kept off the CPU must not reach the trace. The experiment is
therefore cut into short slices, one timed (or warm-up) iteration each, plus a slice boundary
before each level's run: before every slice `timed_loop` asks the process's `Pacer` to `wait()`
(it may block until the serving path leaves room), and after every timed iteration it asks
whether that iteration was `interrupted` (e.g. the thread waited for a CPU while it ran). An
interrupted iteration is run again and its timing discarded, never averaged in, up to
`MAX_ATTEMPTS_PER_ITERATION` runs per wanted iteration; the loop's `LoopRecord` tells the
experiment which of the runner's iterations to drop (the runner still sees every run, so a
profiler's own per-run events stay aligned with the wall intervals).

The default pacer never waits and never interrupts: `xsp-sidecar profile` and the admin path
time exactly as before. The profiling worker installs its own (`sidecar.sampling.slices`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

MAX_ATTEMPTS_PER_ITERATION = 4  # runs per wanted timed iteration before interrupted ones stay


class Pacer(Protocol):
    """Decides when the next slice of a profile may run, and whether one was disturbed."""

    def wait(self) -> None:
        """Block until the next slice may run."""

    def begin(self) -> int:
        """A mark taken just before a timed iteration."""

    def interrupted(self, mark: int, wall_ns: int) -> bool:
        """True if the iteration since `mark` (which took `wall_ns`) was disturbed."""


class NoPacing:
    """Run every slice at once; no iteration is ever interrupted."""

    def wait(self) -> None:
        return None

    def begin(self) -> int:
        return 0

    def interrupted(self, mark: int, wall_ns: int) -> bool:
        return False


@dataclass
class LoopRecord:
    """What one `timed_loop` did: `runs` timed runs, the indices of those to discard."""

    runs: int
    discarded: list[int] = field(default_factory=list)
    kept_interrupted: int = 0  # interrupted runs kept because too few clean ones came


@dataclass
class _State:
    pacer: Pacer
    loops: collections.deque[LoopRecord] = field(
        default_factory=lambda: collections.deque(maxlen=16)  # bounded: runs outside experiments
    )


_state = _State(NoPacing())


def pacer() -> Pacer:
    return _state.pacer


@contextlib.contextmanager
def installed(new: Pacer) -> Iterator[Pacer]:
    """Use `new` for the profiles taken inside the block (one process, one thread)."""
    old = _state.pacer
    _state.pacer = new
    try:
        yield new
    finally:
        _state.pacer = old


def install(new: Pacer) -> None:
    """Use `new` from now on in this process (the profiling worker's, for its lifetime)."""
    _state.pacer = new


def record_loop(record: LoopRecord) -> None:
    _state.loops.append(record)


def take_loops() -> list[LoopRecord]:
    """The records of the loops since the last call (the experiment reads one per level)."""
    loops = list(_state.loops)
    _state.loops.clear()
    return loops
