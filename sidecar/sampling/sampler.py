"""Sampling decisions on the hot path: a coin flip, a token bucket and a duty-cycle gate.

A decision is made in two steps because the relay sees a request's headers before its body:

1. `at_headers(forced)` runs when the request's HEADERS arrive (before they are forwarded, so a
   `traceparent` can still be added for the backend). It flips the coin with the highest
   configured rate, or accepts a forced request, and checks the worker's duty-cycle gate.
2. `at_body(model, tentative)` runs once the model name is known. It thins the coin flip down
   to the model's own rate, then takes a token from the model's budget and checks the worker's
   duty cycle. Only then is the request a sample.

While trace-store writes fail, `store` (a back-off gate) refuses new samples: there is no point
profiling what cannot be stored.

A sample that was asked for (`FORCED`) or judged slow (`SLOW`) is not turned away by the duty
cycle: `admit` takes its budget's token and says to hold it (`sampling.held.HeldSamples`)
until the gate lets it run (`start_held`). While one is held, fresh samples find the gate
closed, so held ones run first.

Each call costs a few microseconds; nothing here blocks or allocates much.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from sidecar.sampling.settings import SamplingSettings


class Decision(StrEnum):
    """Outcome of a sampling decision; the value is the `decision` metric label."""

    SAMPLED = "sampled"
    SKIPPED_RATE = "skipped_rate"
    SKIPPED_BUDGET = "skipped_budget"
    SKIPPED_DUTY_CYCLE = "skipped_duty_cycle"
    SKIPPED_STORE_FAILING = "skipped_store_failing"


class Tentative(StrEnum):
    """Result of the header-time step."""

    NO = "no"
    RATE = "rate"  # picked by the coin flip
    FORCED = "forced"
    SLOW = "slow"  # not picked at header time; its response came slower than `sample_slow`
    GATED = "gated"  # picked, but the worker's duty-cycle gate is closed: nothing to capture
    STORE_FAILING = "store_failing"  # picked, but the trace store is failing: nothing to capture


@dataclass
class TokenBucket:
    """`rate_per_s` tokens per second, holding at most `capacity`."""

    capacity: float
    rate_per_s: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class DutyCycleGate:
    """Keeps the profiling worker busy at most `duty_cycle` of wall time.

    After a profile that kept the worker busy for B seconds, the next one may start only
    B * (1 / duty_cycle - 1) seconds later, so busy time over any long stretch stays under the
    cap. The worker reports B through `record_busy`.
    """

    def __init__(self, duty_cycle: float, clock: Callable[[], float]) -> None:
        self.duty_cycle = duty_cycle
        self._clock = clock
        self._open_at = 0.0
        self._in_flight = 0
        self.waiting = 0  # held samples (`HeldSamples`): they go before fresh ones

    def allows(self, now: float) -> bool:
        """Whether a fresh sample may start now."""
        # Below a full duty cycle one profile runs at a time; at 1.0 the gate never closes.
        if self.duty_cycle >= 1.0:
            return True
        return self.waiting == 0 and self._in_flight == 0 and now >= self._open_at

    def allows_held(self, now: float) -> bool:
        """Whether a held sample may start now."""
        return self.duty_cycle >= 1.0 or (self._in_flight == 0 and now >= self._open_at)

    def wait_s(self) -> float:
        """Seconds until the gate opens at the earliest (0 when it is open or a profile runs:
        then it opens when that one's busy time is known)."""
        return max(0.0, self._open_at - self._clock())

    def started(self) -> None:
        self._in_flight += 1

    def record_busy(self, busy_s: float) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        self._open_at = self._clock() + busy_s * (1.0 / self.duty_cycle - 1.0)

    def cancel(self) -> None:
        """A started profile never ran (dropped from a full queue)."""
        self._in_flight = max(0, self._in_flight - 1)

    def reopen(self) -> None:
        """Forget the wait computed under the old duty cycle (settings changed)."""
        self._open_at = 0.0


class StoreBackoff:
    """Closed for a while after a trace-store write failed, longer after each failure.

    The first failure closes it for `initial_s`; a failure after the wait is over (a sample
    taken since failed too) doubles it, up to `max_s`. Failures while it is closed come from
    samples taken before and change nothing. Any successful write opens it.
    """

    def __init__(
        self, clock: Callable[[], float], initial_s: float = 1.0, max_s: float = 60.0
    ) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._delay = 0.0
        self._open_at = 0.0

    def failed(self) -> None:
        with self._lock:
            now = self._clock()
            if now < self._open_at:
                return
            self._delay = self.initial_s if self._delay == 0 else min(self.max_s, 2 * self._delay)
            self._open_at = now + self._delay

    def succeeded(self) -> None:
        if self._delay:
            with self._lock:
                self._delay = self._open_at = 0.0

    def allows(self, now: float) -> bool:
        return now >= self._open_at

    @property
    def failing(self) -> bool:
        """True from a failure until the next successful write."""
        return self._delay > 0

    def closed(self) -> bool:
        """True while samples are refused."""
        return not self.allows(self._clock())


class Admission(NamedTuple):
    """The body-time answer for a sample that may wait (`Sampler.admit`): its decision, and
    whether a `SAMPLED` one must be held until the duty cycle lets it run."""

    decision: Decision
    held: bool = False


class HotSettings(NamedTuple):
    """What every request's header-time step reads of the settings, worked out once."""

    settings: SamplingSettings
    max_rate: float
    force_header: bytes | None  # the header's name as the relay reads it (None: no forcing)
    pick_rate: float  # the coin flip's rate: `max_rate`, 0 while sampling is switched off


def _hot(settings: SamplingSettings) -> HotSettings:
    header = settings.force_header
    return HotSettings(
        settings,
        settings.max_rate,
        None if header is None else header.encode("latin-1"),
        settings.max_rate if settings.enabled else 0.0,
    )


_MAY_WAIT = (Tentative.FORCED, Tentative.SLOW)
_SAMPLED = Admission(Decision.SAMPLED)
_HELD = Admission(Decision.SAMPLED, held=True)
_SKIPPED_RATE = Admission(Decision.SKIPPED_RATE)
_SKIPPED_BUDGET = Admission(Decision.SKIPPED_BUDGET)
_SKIPPED_DUTY_CYCLE = Admission(Decision.SKIPPED_DUTY_CYCLE)
_SKIPPED_STORE_FAILING = Admission(Decision.SKIPPED_STORE_FAILING)


class Sampler:
    """Decides which live requests become profiles; safe to call from several threads."""

    def __init__(
        self,
        settings: SamplingSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._clock = clock
        self.rand = rand  # the coin (`at_headers`; the C walk reads it: proxy/native.py)
        self._lock = threading.Lock()
        self._buckets: dict[str, TokenBucket] = {}
        self.hot = _hot(settings)  # read by the hook on every request; replaced, never changed
        self.duty = DutyCycleGate(settings.duty_cycle, clock)
        self.store = StoreBackoff(clock)

    @property
    def settings(self) -> SamplingSettings:
        return self.hot.settings

    @settings.setter
    def settings(self, settings: SamplingSettings) -> None:
        self.hot = _hot(settings)  # one assignment: a reader sees old or new, not a mix

    def update(self, settings: SamplingSettings) -> None:
        """Apply new settings at run time; budgets restart full, the duty-cycle wait ends."""
        with self._lock:
            self.settings = settings
            self.duty.duty_cycle = settings.duty_cycle
            self.duty.reopen()
            self._buckets.clear()

    def is_forced(self, metadata_value: str | None) -> bool:
        return (
            self.settings.enabled
            and self.settings.force_header is not None
            and metadata_value is not None
            and metadata_value.strip() in ("1", "true", "yes")
        )

    def at_headers(self, forced: bool) -> Tentative:
        """Header-time step: forced, or a coin flip at the highest configured rate. This is
        the coin flip's one Python form (the relay's hook calls it); the C frame walk
        (`_framewalk.c`, `quick_answer`) makes the same flip with the same `rand` and
        `hot.pick_rate` where it answers a request itself, and tests/sampling compares the
        two on the same draws."""
        if not forced and self.rand() >= self.hot.pick_rate:
            return Tentative.NO
        return self.after_coin(forced)

    def after_coin(self, forced: bool) -> Tentative:
        """The header-time step of a request the coin flip picked, or a forced one."""
        if not self.hot.settings.enabled:
            return Tentative.NO
        # Checked here too so that, while the gate is closed, picked requests cost nothing
        # more than unpicked ones (no traceparent, no body copy).
        now = self._clock()
        if not self.store.allows(now):
            return Tentative.STORE_FAILING
        if forced:  # asked for: held until the duty cycle allows it (`admit`)
            return Tentative.FORCED
        if not self.duty.allows(now):
            return Tentative.GATED
        return Tentative.RATE

    def may_hold_for_slow(self) -> bool:
        """Header-time step of a request the rate did not pick, with `sample_slow` on: worth
        a body copy held to its end (sampling is on and the store allows one; a slow one found
        while the worker is busy waits for it, `admit`)."""
        return self.settings.enabled and self.store.allows(self._clock())

    def at_body(self, model: str, tentative: Tentative) -> Decision:
        """Body-time step, once the model is known (for `SLOW`, at the stream's end). Call it
        for every request: skipped requests are counted too. `FORCED` and `SLOW` skip the rate,
        not the budget or the duty cycle. A `SAMPLED` decision must be followed by
        `duty.record_busy` (profile done) or `duty.cancel` (never ran)."""
        return self.admit(model, tentative, may_wait=False).decision

    def admit(self, model: str, tentative: Tentative, *, may_wait: bool = True) -> Admission:
        """`at_body`, except that a `FORCED` or `SLOW` sample (with `may_wait`) the duty cycle
        alone refuses is `SAMPLED` and held: its token is spent, the gate is not started, and
        it counts in `duty.waiting` until `start_held` (it runs) or `drop_held` (it never
        will)."""
        hot = self.hot
        if tentative is Tentative.NO:
            return _SKIPPED_RATE
        if tentative is Tentative.GATED:
            return _SKIPPED_DUTY_CYCLE
        if tentative is Tentative.STORE_FAILING:
            return _SKIPPED_STORE_FAILING
        if tentative is Tentative.RATE:
            max_rate = hot.max_rate
            model_rate = hot.settings.rate_for(model)
            if model_rate < max_rate and self.rand() * max_rate >= model_rate:
                return _SKIPPED_RATE
        now = self._clock()
        if not self.store.allows(now):
            return _SKIPPED_STORE_FAILING
        with self._lock:
            if not self._bucket(model, now).take(now):
                return _SKIPPED_BUDGET
            if not self.duty.allows(now):
                if may_wait and tentative in _MAY_WAIT:
                    self.duty.waiting += 1
                    return _HELD
                self._bucket(model, now).tokens += 1.0  # the token was not used
                return _SKIPPED_DUTY_CYCLE
            self.duty.started()
        return _SAMPLED

    def start_held(self) -> bool:
        """A held sample may run now (the store and the duty cycle allow it): the gate is
        started for it, as for a fresh `SAMPLED` one. False: keep holding it."""
        now = self._clock()
        with self._lock:
            if not (self.store.allows(now) and self.duty.allows_held(now)):
                return False
            self.duty.waiting = max(0, self.duty.waiting - 1)
            self.duty.started()
        return True

    def drop_held(self) -> None:
        """A held sample will never run (dropped from a full hold, or at shutdown)."""
        with self._lock:
            self.duty.waiting = max(0, self.duty.waiting - 1)

    def _bucket(self, model: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(model)
        if bucket is None:
            budget = self.settings.budget_per_minute
            bucket = TokenBucket(
                capacity=max(budget, 0.0), rate_per_s=budget / 60.0, tokens=budget, updated=now
            )
            self._buckets[model] = bucket
        return bucket
