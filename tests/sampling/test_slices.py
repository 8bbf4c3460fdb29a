"""The worker's slice gate on fakes: a fake pressure signal, a fake clock that `sleep`
advances, a fake CPU clock and a fake run-delay counter (no real time is measured)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sidecar.sampling.slices import SliceGate, SliceSettings


@dataclass
class FakePressure:
    """Stands in for the relay's shared request counters."""

    started: int = 0
    ended: int = 0

    def snapshot(self) -> tuple[int, int]:
        return self.started, self.ended

    def busy(self) -> None:
        self.started += 1

    def quiet(self) -> None:
        self.ended = self.started


@dataclass
class FakeTime:
    """A wall clock that only `sleep` moves, a CPU clock the test moves, a run delay."""

    now: float = 100.0
    cpu: float = 5.0
    run_delay_ns: int = 0
    sleeps: list[float] = field(default_factory=list)
    on_sleep: list[object] = field(default_factory=list)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for hook in self.on_sleep:
            hook()  # type: ignore[operator]


SETTINGS = SliceSettings(busy_share=0.01, quiet_s=0.002, burst_s=0.002, resume_s=0.001)


def gate(pressure: FakePressure, t: FakeTime, settings: SliceSettings = SETTINGS) -> SliceGate:
    return SliceGate(
        pressure,
        settings,
        clock=lambda: t.now,
        cpu_clock=lambda: t.cpu,
        run_delay_ns=lambda: t.run_delay_ns,
        sleep=t.sleep,
    )


def test_a_quiet_serving_path_lets_every_slice_run_at_once() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t)
    for _ in range(5):
        t.cpu += 0.010  # 10 ms of profiling per slice, far more than the busy budget
        g.wait()
    assert t.sleeps == [] and g.waits == 0 and g.waited_s == 0.0


def test_a_busy_serving_path_makes_the_worker_wait_until_its_share_is_earned() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t)
    pressure.busy()  # one request in flight, for the whole test
    g.wait()  # the bucket starts full: the first slice runs
    assert t.sleeps == []
    t.cpu += 0.004  # a 4 ms slice while serving was busy: 2 ms over the 2 ms held
    g.wait()
    assert g.waits == 1 and t.sleeps
    # at 1 % of wall time, paying back 2 ms and refilling to 1 ms takes 300 ms of waiting
    # (give or take one shortest sleep: the bucket refills in floating point)
    assert sum(t.sleeps) == pytest.approx(0.3, abs=SETTINGS.min_sleep_s)
    assert g.waited_s == pytest.approx(sum(t.sleeps))
    assert g.tokens >= SETTINGS.resume_s


def test_the_wait_ends_as_soon_as_the_serving_path_turns_quiet() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t)
    pressure.busy()
    t.cpu += 0.050
    t.on_sleep.append(pressure.quiet)  # the request ends during the first sleep
    g.wait()
    assert len(t.sleeps) == 1  # a request that ended less than quiet_s ago still counts...
    # ...so with min_sleep_s >= quiet_s one sleep is enough to see it quiet
    assert SETTINGS.min_sleep_s >= SETTINGS.quiet_s


def test_a_request_that_started_recently_is_busy_even_when_none_is_in_flight() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t)
    pressure.busy()
    pressure.quiet()
    assert g.busy()  # started and ended between two looks: it was just here
    t.now += 2 * SETTINGS.quiet_s
    assert not g.busy()


def test_work_done_while_serving_was_quiet_is_not_charged() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t)
    t.cpu += 0.050
    g.wait()  # quiet before and now: free
    pressure.busy()
    g.wait()  # busy now: the bucket is still full
    assert t.sleeps == [] and g.tokens == pytest.approx(SETTINGS.burst_s)


def test_debt_is_capped_so_a_model_load_does_not_stall_profiling_for_minutes() -> None:
    pressure, t = FakePressure(), FakeTime()
    settings = SliceSettings(busy_share=0.01, max_debt_s=0.05)
    g = gate(pressure, t, settings)
    pressure.busy()
    t.cpu += 2.0  # two CPU seconds: loading a large model
    g.settle()
    assert g.tokens == pytest.approx(-0.05)
    g.wait()
    expected = (0.05 + settings.resume_s) / 0.01
    assert sum(t.sleeps) == pytest.approx(expected, abs=settings.min_sleep_s)


def test_an_iteration_that_waited_for_a_cpu_is_interrupted_and_counted() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t, SliceSettings(preempt_tolerance_s=10e-6, preempt_share=0.02))
    mark = g.begin()
    t.run_delay_ns += 5_000  # 5 us on a run queue: within the tolerance
    assert not g.interrupted(mark, wall_ns=100_000)
    mark = g.begin()
    t.run_delay_ns += 50_000  # preempted for 50 us of a 100 us iteration
    assert g.interrupted(mark, wall_ns=100_000)
    mark = g.begin()
    t.run_delay_ns += 50_000  # 50 us of a 10 ms iteration: under 2 %
    assert not g.interrupted(mark, wall_ns=10_000_000)
    assert g.reset_counters() == (0.0, 1)
    assert g.reset_counters() == (0.0, 0)


def test_a_job_is_held_back_only_until_its_hold_time_then_runs_unpaced() -> None:
    pressure, t = FakePressure(), FakeTime()
    g = gate(pressure, t)
    pressure.busy()
    g.start_job(hold_until=t.now + 0.1)
    t.cpu += 0.010  # 10 ms over budget: 1.1 s of waiting at 1 %, but only 0.1 s is allowed
    g.wait()
    assert sum(t.sleeps) == pytest.approx(0.1, abs=SETTINGS.max_sleep_s)
    t.sleeps.clear()
    t.cpu += 0.010
    g.wait()  # past the hold time: no more waiting for this job
    assert t.sleeps == []
    g.start_job(hold_until=t.now + 10.0)  # the next job is paced again
    t.cpu += 0.010
    g.wait()
    assert t.sleeps
