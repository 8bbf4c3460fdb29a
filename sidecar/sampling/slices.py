"""The profiling worker's slice gate: profile in the serving path's quiet moments, and only
a small share of the CPU while it is busy.

Why: the worker runs at SCHED_IDLE, yet a request that overlaps a profile on the other vCPU is
still slowed (shared caches and memory bandwidth, the host's SMT and turbo, the worker's own
wake-ups). With the duty cycle alone (5 % of wall time) about 5 % of requests overlap a
profile under continuous load, and the p99 is taken from exactly those. A tail percentile is
safe as long as far fewer requests than its tail (1 % for p99) overlap profiling work, so:

- the experiment is cut into slices (one iteration, or one level's set-up; see
  `sidecar.profiling.pacing`), and before each slice the worker asks this gate;
- the serving path is **quiet** when no request is in flight and none started for `quiet_s`
  (the relay's counters, `sidecar.sampling.pressure`): then a slice runs at once, and only
  the supervisor's duty cycle limits the worker;
- while it is **busy**, the worker may use at most `busy_share` of wall time in CPU: a token
  bucket filled at `busy_share` seconds per second (holding at most `burst_s`), drained by the
  CPU the worker process used since the previous slice boundary (so work between slices that
  cannot be cut, such as decoding the request or writing the trace, is paid for too). The
  gate sleeps until the bucket holds `resume_s` again (fewer, longer sleeps) or the serving
  path turns quiet. Debt is capped at `max_debt_s`, so a one-off cost such as loading a model
  does not stall profiling for minutes, and a job is held back for at most `hold_share` of the
  worker's job timeout: after that its slices run unpaced, so a large model's profile still
  finishes instead of timing out.

At the default 0.5 % about 0.5 % of a busy serving path's time overlaps profiling work, well
inside the 1 % that p99 leaves; under continuous load a profile then takes seconds of wall
time instead of milliseconds, and fewer profiles complete per minute (the trade
`bench/sampling_impact.py` reports). CPU affinity is not used: on the two-vCPU machine this
was built on the serving path (client, relay, Triton) runs on both, so a pinned worker would
still share a core with it (not measured).

A timed iteration is **interrupted** when the worker's thread waited for a CPU while it ran
(its run delay in /proc/thread-self/schedstat grew by more than `preempt_tolerance_s`, or
`preempt_share` of the iteration): its wall time includes somebody else's work, so the
experiment discards it and runs another (`iterations_discarded` in the trace).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.sampling.pressure import PressureSignal


@dataclass(frozen=True)
class SliceSettings:
    busy_share: float = 0.005  # worker CPU / wall time while the serving path is busy
    quiet_s: float = 0.002  # no request in flight and none started this long: quiet
    burst_s: float = 0.002  # CPU seconds the bucket holds at most
    resume_s: float = 0.001  # a wait ends once the bucket holds this much again
    hold_share: float = 0.5  # of the job timeout: how long a job's slices may be held back
    max_debt_s: float = 0.05  # at most this much CPU is paid back (a model's first load)
    min_sleep_s: float = 0.002
    max_sleep_s: float = 0.05  # how late a wait notices that the serving path turned quiet
    preempt_tolerance_s: float = 10e-6  # run delay an iteration may have and still count
    preempt_share: float = 0.02  # ... or this share of its wall time, whichever is more


def thread_run_delay_ns() -> Callable[[], int]:
    """A reader of this thread's run delay (ns it waited for a CPU so far); 0 where the
    kernel does not report it. Keeps the file open: one pread, about 1.5 us, per reading."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: 0

    def read() -> int:
        try:
            return int(os.pread(fd, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    return read


class SliceGate:
    """A `sidecar.profiling.pacing.Pacer` driven by the serving path's pressure."""

    def __init__(
        self,
        signal: PressureSignal,
        settings: SliceSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        run_delay_ns: Callable[[], int] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settings = settings or SliceSettings()
        self._signal = signal
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._run_delay_ns = run_delay_ns or thread_run_delay_ns()
        self._sleep = sleep
        now = clock()
        self.tokens = self.settings.burst_s
        self._filled_at = now
        self._cpu_mark = cpu_clock()
        self._started_seen = signal.snapshot()[0]
        self._last_activity = float("-inf")
        self._was_busy = False
        self._hold_until = float("inf")
        # counters for the worker's result and the tests
        self.waited_s = 0.0
        self.waits = 0
        self.interruptions = 0

    def busy(self) -> bool:
        """True while a request is in flight or one started within `quiet_s`."""
        now = self._clock()
        started, ended = self._signal.snapshot()
        if started != self._started_seen:
            self._started_seen = started
            self._last_activity = now
        return started > ended or now - self._last_activity < self.settings.quiet_s

    def _account(self) -> bool:
        """Fill the bucket for the time passed, charge the CPU used since the last boundary
        if it overlapped a busy serving path; True if serving is busy now."""
        settings = self.settings
        now = self._clock()
        self.tokens = min(
            settings.burst_s, self.tokens + (now - self._filled_at) * settings.busy_share
        )
        self._filled_at = now
        cpu = self._cpu_clock()
        busy = self.busy()
        if busy or self._was_busy:  # the work since the last boundary overlapped serving
            self.tokens = max(-settings.max_debt_s, self.tokens - (cpu - self._cpu_mark))
        self._cpu_mark = cpu
        self._was_busy = busy
        return busy

    def settle(self) -> None:
        """Charge the work done since the last boundary (a job's tail: storing its trace)."""
        self._account()

    def start_job(self, hold_until: float) -> None:
        """A new job: the gate holds its slices back only until `hold_until` (clock time)."""
        self._hold_until = hold_until
        self.reset_counters()

    def wait(self) -> None:
        settings = self.settings
        began: float | None = None
        resume = 0.0  # in debt: run again once the bucket holds `resume_s` (fewer wake-ups)
        while self._account() and self.tokens < resume and self._clock() < self._hold_until:
            if began is None:
                began = self._clock()
                self.waits += 1
                resume = settings.resume_s
            debt_s = (resume - self.tokens) / settings.busy_share
            self._sleep(min(settings.max_sleep_s, max(settings.min_sleep_s, debt_s)))
        if began is not None:
            self.waited_s += self._clock() - began

    def begin(self) -> int:
        return self._run_delay_ns()

    def interrupted(self, mark: int, wall_ns: int) -> bool:
        waited_ns = self._run_delay_ns() - mark
        tolerance_ns = max(
            self.settings.preempt_tolerance_s * 1e9, self.settings.preempt_share * wall_ns
        )
        if waited_ns > tolerance_ns:
            self.interruptions += 1
            return True
        return False

    def reset_counters(self) -> tuple[float, int]:
        """(seconds waited, iterations interrupted) since the last call."""
        waited, interrupted = self.waited_s, self.interruptions
        self.waited_s, self.interruptions = 0.0, 0
        return waited, interrupted
