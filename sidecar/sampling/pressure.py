"""How busy the serving path is, shared with the profiling worker's process without locks.

Two 64-bit counters in shared memory: requests the relay started and requests it ended. The
relay's sampling hook bumps them on its one event-loop thread (one writer each, an aligned
8-byte store: no lock, about 0.1 us a request); the worker process reads both and derives the
requests in flight and whether any arrived since it last looked. Created by the supervisor,
handed to the worker process when it is spawned.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Protocol


class PressureSignal(Protocol):
    """Read side: (requests started, requests ended) so far."""

    def snapshot(self) -> tuple[int, int]: ...


class ServingPressure:
    """The relay's request counters in shared memory (see module docstring)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        # [started, ended]; the sampling hook bumps them in place (no method call per request)
        self.counts: Any = multiprocessing.get_context("spawn").RawArray("q", 2)

    def request_started(self) -> None:
        self.counts[0] += 1

    def request_ended(self) -> None:
        self.counts[1] += 1

    def snapshot(self) -> tuple[int, int]:
        counts = self.counts
        return counts[0], counts[1]

    def __getstate__(self) -> Any:  # pickled only while spawning the worker process
        return self.counts

    def __setstate__(self, state: Any) -> None:
        self.counts = state
