"""The trace assembler: one sampled trace, from its first part to its last.

A sampled request's trace arrives in three parts, in any order: the relay's request span, the
backend's own spans (OTLP, or a profiler capture) and the replay (stored by the profiling
worker's process, or the live-only row of a sample no replay can run). The assembler is told,
when the sample is taken, which parts to expect (`expect`: from whether the call is a live
inference, where the backend's spans come from, and whether a replay was asked) and is handed
each part as it comes (`add_spans`, `add_trace`, `replay_done`, `refused`). Every part and
every change of state goes through the trace writer, so the state (`parts`, table
`trace_parts`) is committed in the same transaction as the part: a restart loses nothing, and
a new assembler on the same store finishes what the last one left (`start` expires the
overdue traces; the rest keep their deadlines).

A trace is final when every expected part is there (`whole`) or one never will be
(`incomplete`: the backend's tracing is off, the replay was refused, or the deadline passed);
then its `fidelity` is computed, once, and its outcome is the trace attribute `assembly`.

With an OTLP export, every part the writer commits is offered to it; the replay part, which
the worker's process stores itself, is read back from the store when its result arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from sidecar.trace.otlp_export import OtlpTraceExport
from sidecar.trace.parts import Event, Expected, Part
from sidecar.trace.spans import LevelStats, Source, Span, Trace
from sidecar.trace.store import PendingWrite
from sidecar.trace.writer import TraceWriter

__all__ = ["Part", "TraceAssembler", "parts_expected"]

log = logging.getLogger(__name__)

PART_OF_SOURCE = {Source.PROXY: Part.REQUEST, Source.BACKEND: Part.BACKEND}
REPLAY_STORED = ("ok", "error")  # replay outcomes whose trace row the worker stored
TRACING_OFF = "the backend's tracing is off"  # no receiver of its spans, no capture


def parts_expected(
    *, live: bool, no_backend: str | None = None, no_replay: str | None = None
) -> tuple[frozenset[Part], dict[Part, str]]:
    """The parts a sampled trace will get, and the absent ones with why.

    `live`: the trace is of a live call the relay saw (not the admin API's replay of a
    remembered request); `no_backend`: None when the backend's spans of it come (an OTLP
    receiver, a capture on the call's path), else why not (e.g. `TRACING_OFF`); `no_replay`:
    None when a replay was asked, else why there is none (e.g. `not_replayable: ...`).
    """
    expected = {Part.REPLAY}
    absent: dict[Part, str] = {}
    if live:
        expected |= {Part.REQUEST, Part.BACKEND}
        if no_backend is not None:
            absent[Part.BACKEND] = no_backend
    if no_replay is not None:
        absent[Part.REPLAY] = no_replay
    return frozenset(expected), absent


class TraceAssembler:
    """Hands each part of a sampled trace to `writer` with what it means for the trace.

    `timeout_s`: how long after `expect` a trace waits for its parts; `sweep_interval_s`: how
    often overdue traces are made final (the sweeper of `start`). Every call returns whether
    the writer took it (False: its queue was full or closed, counted there); none raises.
    """

    def __init__(
        self,
        writer: TraceWriter,
        *,
        timeout_s: float,
        export: OtlpTraceExport | None = None,
        sweep_interval_s: float = 2.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if not timeout_s > 0 or not sweep_interval_s > 0:
            raise ValueError("the assembly's timeout and sweep interval must be positive")
        self.writer = writer
        self.timeout_s = timeout_s
        self.sweep_interval_s = sweep_interval_s
        self.export = export
        self._clock = clock
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if export is not None:
            writer.on_stored = self._stored

    # -- what a sampled trace will get ----------------------------------------------------
    def expect(
        self, trace_id: str, parts: frozenset[Part], absent: Mapping[Part, str] | None = None
    ) -> bool:
        """A trace was sampled: wait for `parts` until the deadline; `absent` never come."""
        deadline = self._clock() + int(self.timeout_s * 1e9)
        expected = Expected(trace_id, parts, deadline, dict(absent or {}))
        return self._event(trace_id, Event(expected=expected))

    # -- the parts ----------------------------------------------------------------------------
    def add_spans(self, trace_id: str, spans: Sequence[Span]) -> bool:
        """Live spans of a trace: the relay's (request part), the backend's (backend part)."""
        received = frozenset(PART_OF_SOURCE[s.source] for s in spans if s.source in PART_OF_SOURCE)
        item = PendingWrite(trace_id, None, tuple(spans), assembly=Event(received=received))
        return self.writer.submit_write(item)

    def add_trace(
        self, trace: Trace, spans: Sequence[Span] = (), level_stats: Sequence[LevelStats] = ()
    ) -> bool:
        """A trace row written here (a live-only sample's); it is no part by itself."""
        return self.writer.submit(trace, spans, level_stats)

    def replay_done(self, trace_id: str, outcome: str, error: str = "") -> bool:
        """The worker's result for a trace: its replay part is in the store (`ok`, `error`:
        the worker's process stored it), or it never will be (`timeout`, `crash`,
        `store_error`)."""
        if outcome not in REPLAY_STORED:
            why = f"{outcome}: {error}" if error else outcome
            return self.refused(trace_id, Part.REPLAY, why)
        taken = self._event(trace_id, Event(received=frozenset({Part.REPLAY})))
        if self.export is not None and not self.writer.submit_stored_elsewhere(trace_id):
            self.export.dropped += 1  # counted as one span: the trace's replay part is lost
        return taken

    def refused(self, trace_id: str, part: Part, why: str) -> bool:
        """`part` of a trace will never come (e.g. its queued job was dropped)."""
        return self._event(trace_id, Event(absent={part: why}))

    # -- the deadline -----------------------------------------------------------------------
    def expire(self) -> bool:
        """Make every trace whose deadline has passed final, with what it has."""
        return self._event("", Event(expire_at_ns=self._clock()))

    def start(self) -> TraceAssembler:
        """Expire what a previous run left overdue, then sweep every `sweep_interval_s`."""
        self.expire()
        if self._sweeper is None:
            self._stop.clear()
            self._sweeper = threading.Thread(
                target=self._sweep, name="xsp-trace-assembly", daemon=True
            )
            self._sweeper.start()
        return self

    def close(self) -> None:
        """Stop the sweeper (pending traces stay pending in the store) and close the writer."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5.0)
            self._sweeper = None
        self.writer.close()

    # -- internals ----------------------------------------------------------------------------
    def _event(self, trace_id: str, event: Event) -> bool:
        return self.writer.submit_write(PendingWrite(trace_id, assembly=event))

    def _sweep(self) -> None:
        while not self._stop.wait(self.sweep_interval_s):
            self.expire()

    def _stored(self, item: PendingWrite) -> None:
        """The writer committed `item`: its records go to the OTLP export too."""
        if self.export is not None and (item.spans or item.trace is not None):
            self.export.offer(item.spans, item.trace, item.level_stats)
