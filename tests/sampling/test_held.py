"""Asked-for samples that meet a closed duty cycle wait in the hold (`held.HeldSamples`), and
samples of models no replay can run are kept live-only (`take`): the relay's hook with a real
`Sampler` on a manual clock, real metrics on a fresh registry and the hold's real thread; the
worker queue and the store are test_observer's in-memory `SampleHandler`."""

from __future__ import annotations

import time

from sidecar.backends.replayability import NOT_REPLAYABLE
from sidecar.sampling.held import FORCED_HOLD
from sidecar.sampling.sampler import Decision, Sampler, Tentative
from sidecar.sampling.settings import SamplingSettings
from tests.sampling.test_observer import TRACEPARENT, ManualClock, Setup, wait_for

FORCE = ((b"x-xsp-profile", b"1"),)


def trace_of(traceparent: str | None) -> str:
    match = TRACEPARENT.fullmatch(traceparent or "")
    assert match is not None, traceparent
    return match.group(1)


def finish_profile(s: Setup, busy_s: float = 1.0) -> None:
    """The running profile ends after `busy_s`; the gate opens once its rest is over."""
    s.sampler.duty.record_busy(busy_s)
    s.clock.now += busy_s * (1 / s.sampler.duty.duty_cycle - 1) + 0.001


def test_the_sampler_holds_a_forced_sample_the_duty_cycle_refuses() -> None:
    clock = ManualClock()
    sampler = Sampler(SamplingSettings(rate=1.0, budget_per_minute=2, duty_cycle=0.5), clock=clock)
    assert sampler.admit("m", Tentative.RATE) == (Decision.SAMPLED, False)
    assert sampler.admit("m", Tentative.RATE) == (Decision.SKIPPED_DUTY_CYCLE, False)
    assert sampler.admit("m", Tentative.FORCED) == (Decision.SAMPLED, True)  # the last token
    assert sampler.admit("m", Tentative.FORCED) == (Decision.SKIPPED_BUDGET, False)
    assert sampler.at_body("m", Tentative.FORCED) is Decision.SKIPPED_BUDGET
    assert not sampler.start_held()  # a profile runs
    sampler.duty.record_busy(1.0)
    clock.now += 0.9
    assert not sampler.start_held() and sampler.duty.wait_s() > 0
    clock.now += 0.2
    assert not sampler.duty.allows(clock.now)  # a fresh sample waits behind the held one
    assert sampler.start_held()
    assert sampler.duty.waiting == 0 and not sampler.duty.allows(clock.now)  # it runs


def test_forced_requests_sent_while_a_profile_runs_are_each_profiled_in_order() -> None:
    s = Setup(rate=0.0, duty_cycle=0.5)
    first = trace_of(s.request(headers=FORCE))
    waiting = [trace_of(s.request(headers=FORCE)) for _ in range(3)]
    assert [j.trace_id for j in s.handler.jobs] == [first]
    assert len(s.hub.held) == 3 and all(s.hub.is_sampled_trace(t) for t in waiting)
    assert s.decisions() == {"sampled": 4}
    # their request spans are stored once their jobs are queued, not before
    assert [t for t, _ in s.handler.spans] == [first]
    for n in range(2, 5):
        finish_profile(s)
        assert wait_for(lambda n=n: len(s.handler.jobs) == n), n  # type: ignore[misc]
        time.sleep(0.05)
        assert len(s.handler.jobs) == n  # one at a time: the next waits for this one
    assert [j.trace_id for j in s.handler.jobs] == [first, *waiting]
    assert [j.reason for j in s.handler.jobs] == ["forced"] * 4
    assert wait_for(lambda: len(s.handler.spans) == 4)
    assert {t for t, _ in s.handler.spans} == {first, *waiting}
    assert s.dropped("hold_full") == 0 and s.sampler.duty.waiting == 0


def test_only_a_full_hold_drops_a_forced_request_and_counts_it() -> None:
    s = Setup(rate=0.0, duty_cycle=0.5)
    s.request(headers=FORCE)  # runs
    for _ in range(FORCED_HOLD + 2):
        s.request(headers=FORCE)
    assert len(s.hub.held) == FORCED_HOLD
    assert s.dropped("hold_full") == 2
    assert s.decisions() == {"sampled": FORCED_HOLD + 3}  # a dropped sample counts as sampled
    assert s.sampler.duty.waiting == FORCED_HOLD


def test_held_forced_requests_go_before_fresh_rate_samples() -> None:
    s = Setup(rate=1.0, duty_cycle=0.5)
    s.request()  # a rate sample runs
    held = trace_of(s.request(headers=FORCE))
    finish_profile(s)
    assert s.request() is None  # the gate is the held one's: a fresh pick is gated
    assert wait_for(lambda: len(s.handler.jobs) == 2)
    assert s.handler.jobs[1].trace_id == held
    assert s.decisions()["skipped_duty_cycle"] >= 1


def test_a_model_no_replay_can_run_is_kept_live_only_without_a_job() -> None:
    s = Setup(rate=1.0, duty_cycle=0.5)
    s.handler.not_replayable["add_sub"] = "a python backend model.py"
    traceparents = [s.request("add_sub") for _ in range(3)]
    assert s.handler.jobs == []  # no worker time: the gate stays open for the next
    assert [trace_of(t) for t in traceparents] == [job.trace_id for job, _ in s.handler.live]
    for (job, replay), _ in zip(s.handler.live, traceparents, strict=True):
        assert replay == f"{NOT_REPLAYABLE}: a python backend model.py"
        assert (job.model, job.reason, job.request_message) == ("add_sub", "rate", b"")
        assert s.hub.is_sampled_trace(job.trace_id)  # the backend's spans join it
    stored = {trace_id: span for trace_id, (span,) in s.handler.spans}
    assert set(stored) == {job.trace_id for job, _ in s.handler.live}
    for job, _ in s.handler.live:
        assert stored[job.trace_id].span_id == job.parent_span_id
    assert s.decisions(model="add_sub") == {"sampled": 3}
    s.request("m")  # a replayable model's sample still runs at once
    assert [j.model for j in s.handler.jobs] == ["m"]


def test_a_forced_request_of_a_model_no_replay_can_run_is_not_held() -> None:
    s = Setup(rate=0.0, duty_cycle=0.5)
    s.handler.not_replayable["ens"] = "ensembles"
    s.request(headers=FORCE)  # a profile runs: the gate is closed
    s.request("ens", headers=FORCE)
    assert len(s.hub.held) == 0 and s.sampler.duty.waiting == 0
    assert [job.reason for job, _ in s.handler.live] == ["forced"]


def test_a_live_only_row_the_writer_refuses_is_dropped_as_store_failing() -> None:
    s = Setup(rate=1.0)
    s.handler.not_replayable["ens"] = "ensembles"
    s.handler.store_broken = True
    s.request("ens")
    assert s.handler.live == [] and s.dropped("store_failing", "ens") == 1
    assert s.sampler.duty.allows(s.clock.now)  # its share of the duty cycle given back
