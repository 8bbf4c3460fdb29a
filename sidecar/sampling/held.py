"""Samples waiting for the duty cycle: asked-for ones and slow candidates.

Below a full duty cycle the worker runs one profile at a time and then rests (`DutyCycleGate`).
A forced request (the force header) or a slow one (`--sample-slow`) that comes while the gate
is closed is not turned away: `Sampler.admit` spends its budget's token and it is held here,
its request message and trace ids kept, until the gate opens. One thread then starts the held
samples one at a time (`Sampler.start_held`): forced ones first, in arrival order, then slow
ones, slowest first. While any is held, fresh samples find the gate closed.

The hold is small and bounded: at most `forced` forced samples (one more is dropped) and the
`slow` slowest slow ones (a slower one pushes the fastest held one out). Each drop is counted
in `xsp_samples_dropped_total{reason="hold_full"}`; a held sample was counted as `sampled` when
it was held. A held sample's request span (the relay's, at its stream's end) is stored once its
job is queued, as for any sample: whichever of the two comes second stores it.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.sampling import sampled_request
from sidecar.sampling.sampled_request import RelayedRequest, Sample, hand_over, store_request_span
from sidecar.sampling.sampler import Sampler

log = logging.getLogger(__name__)

FORCED_HOLD = 8  # forced samples held at most
SLOW_HOLD = 4  # slow candidates held at most (the slowest)
HOLD_FULL = "hold_full"  # the drop reason
_POLL_S = 0.05  # how often a held sample asks the gate while a profile runs


class Hub(sampled_request.Hub, Protocol):
    """What the hold uses of the relay's `observer.SamplingHub`."""

    sampler: Sampler

    def drop_held(self, label: str, reason: str) -> None: ...


@dataclass(eq=False, slots=True)
class Held:
    """One held sample; `slowness_s` orders slow ones (its response's duration)."""

    label: str
    sample: Sample
    message: bytes
    reason: str  # the job's reason: `forced` or `slow`
    slowness_s: float = 0.0
    request: RelayedRequest | None = None  # the relay's view, once its stream ended
    state: str = "held"  # held -> starting -> queued | dropped
    _order: float = field(default=0.0, repr=False)


class HeldSamples:
    """The hold (module docstring); its thread starts with the first sample held."""

    def __init__(self, hub: Hub, *, forced: int = FORCED_HOLD, slow: int = SLOW_HOLD) -> None:
        self._hub = hub
        self.forced_max = forced
        self.slow_max = slow
        self._forced: collections.deque[Held] = collections.deque()
        self._slow: list[Held] = []  # ascending by slowness: the slowest last
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def __len__(self) -> int:
        return len(self._forced) + len(self._slow)

    def hold(self, held: Held) -> bool:
        """Hold a sample `Sampler.admit` said to hold; False (dropped and counted) when the hold
        is full. A slow one may push out a faster one held before (dropped and counted)."""
        pushed_out: Held | None = None
        with self._cond:
            if self._stopping:
                accepted = False
            elif held.reason == "slow":
                held._order = held.slowness_s
                bisect.insort(self._slow, held, key=lambda h: h._order)
                if len(self._slow) > self.slow_max:
                    pushed_out = self._slow.pop(0)
                    pushed_out.state = "dropped"
                accepted = pushed_out is not held
            else:
                accepted = len(self._forced) < self.forced_max
                if accepted:
                    self._forced.append(held)
            if accepted:
                self._hub.mark_sampled(held.sample.trace_id)  # its backend spans are kept
                self._start()
                self._cond.notify()
        if not accepted:
            self._hub.drop_held(held.label, HOLD_FULL)
        elif pushed_out is not None:
            self._hub.drop_held(pushed_out.label, HOLD_FULL)
        return accepted

    def ended(self, held: Held, request: RelayedRequest) -> None:
        """The held sample's stream ended: its request span, stored once its job is queued."""
        with self._cond:
            held.request = request
            store = held.state == "queued"
        if store:
            self._store(held, request)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop starting held samples; those still held are given up (not counted)."""
        with self._cond:
            self._stopping = True
            left = [*self._forced, *self._slow]
            self._forced.clear()
            self._slow.clear()
            self._cond.notify_all()
        for held in left:
            held.state = "dropped"
            self._hub.sampler.drop_held()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- its thread ------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="xsp-held", daemon=True)
            self._thread.start()

    def _next(self) -> Held | None:
        """The next held sample once the gate lets it start (None when stopping)."""
        sampler = self._hub.sampler
        with self._cond:
            while True:
                if self._stopping:
                    return None
                if self._forced or self._slow:
                    if sampler.start_held():
                        held = self._forced.popleft() if self._forced else self._slow.pop()
                        held.state = "starting"
                        return held
                    wait = sampler.duty.wait_s()
                    self._cond.wait(min(_POLL_S, wait) if wait > 0 else _POLL_S)
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while (held := self._next()) is not None:
            try:
                queued = hand_over(self._hub, held.label, held.sample, held.message, held.reason)
            except Exception:  # never let the thread die
                log.exception("could not queue a held sample")
                queued = False
            with self._cond:
                held.state = "queued" if queued else "dropped"
                request = held.request if queued else None
            if request is not None:
                self._store(held, request)

    def _store(self, held: Held, request: RelayedRequest) -> None:
        try:
            store_request_span(self._hub, held.sample.trace_id, held.sample.span_id, request)
        except Exception:
            log.exception("could not hand the request span to the trace writer")
