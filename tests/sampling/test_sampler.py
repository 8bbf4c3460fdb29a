"""Sampling decisions: rates, budgets, forcing and the duty-cycle cap, on a controlled clock."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from sidecar.sampling.sampler import Decision, Sampler, Tentative
from sidecar.sampling.settings import SamplingSettings, SamplingSettingsError


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def decide(sampler: Sampler, model: str, forced: bool = False) -> Decision:
    return sampler.at_body(model, sampler.at_headers(forced))


def test_budget_caps_samples_and_every_request_is_counted_once() -> None:
    clock = ManualClock()
    sampler = Sampler(SamplingSettings(rate=1.0, budget_per_minute=5, duty_cycle=1.0), clock=clock)
    counts = Counter(decide(sampler, "m") for _ in range(500))
    assert counts == {Decision.SAMPLED: 5, Decision.SKIPPED_BUDGET: 495}


def test_budget_refills_at_its_rate_per_model() -> None:
    clock = ManualClock()
    sampler = Sampler(SamplingSettings(rate=1.0, budget_per_minute=6, duty_cycle=1.0), clock=clock)
    assert [decide(sampler, "a") for _ in range(7)].count(Decision.SAMPLED) == 6
    assert decide(sampler, "b") is Decision.SAMPLED  # another model has its own bucket
    clock.now += 10.0  # 6 per minute = one token per 10 s
    assert decide(sampler, "a") is Decision.SAMPLED
    assert decide(sampler, "a") is Decision.SKIPPED_BUDGET


def test_rate_is_honoured_statistically_and_per_model() -> None:
    rng = random.Random(7)
    settings = SamplingSettings(
        rate=0.1, model_rates={"hot": 0.5}, budget_per_minute=1e9, duty_cycle=1.0
    )
    sampler = Sampler(settings, rand=rng.random)
    n = 20_000
    cold = sum(decide(sampler, "cold") is Decision.SAMPLED for _ in range(n)) / n
    hot = sum(decide(sampler, "hot") is Decision.SAMPLED for _ in range(n)) / n
    assert abs(cold - 0.1) < 0.01
    assert abs(hot - 0.5) < 0.02


def test_forced_skips_the_rate_but_not_the_budget() -> None:
    sampler = Sampler(SamplingSettings(rate=0.0, budget_per_minute=1, duty_cycle=1.0))
    assert sampler.is_forced("1")
    assert not sampler.is_forced(None)
    assert decide(sampler, "m") is Decision.SKIPPED_RATE
    assert decide(sampler, "m", forced=True) is Decision.SAMPLED
    assert decide(sampler, "m", forced=True) is Decision.SKIPPED_BUDGET


def test_force_header_can_be_disabled() -> None:
    sampler = Sampler(SamplingSettings(force_header=None))
    assert not sampler.is_forced("1")


def test_duty_cycle_gate_spaces_profiles_by_their_busy_time() -> None:
    clock = ManualClock()
    sampler = Sampler(
        SamplingSettings(rate=1.0, budget_per_minute=1e6, duty_cycle=0.05), clock=clock
    )
    assert decide(sampler, "m") is Decision.SAMPLED
    assert decide(sampler, "m") is Decision.SKIPPED_DUTY_CYCLE  # one profile at a time
    # while the gate is closed a picked request is told so at header time (nothing captured);
    # a forced one is not: it waits for the gate (`admit`, test_held.py)
    assert sampler.at_headers(forced=False) is Tentative.GATED
    assert sampler.at_headers(forced=True) is Tentative.FORCED
    sampler.duty.record_busy(2.0)  # busy 2 s -> closed for 2 * (1/0.05 - 1) = 38 s
    clock.now += 37.9
    assert decide(sampler, "m") is Decision.SKIPPED_DUTY_CYCLE
    clock.now += 0.2
    assert decide(sampler, "m") is Decision.SAMPLED


def test_duty_cycle_skip_gives_the_budget_token_back() -> None:
    clock = ManualClock()
    sampler = Sampler(SamplingSettings(rate=1.0, budget_per_minute=1, duty_cycle=0.5), clock=clock)
    assert decide(sampler, "m") is Decision.SAMPLED
    sampler.duty.record_busy(100.0)
    clock.now += 60.0  # bucket refilled, gate still closed
    assert decide(sampler, "m") is Decision.SKIPPED_DUTY_CYCLE
    clock.now += 40.1
    assert decide(sampler, "m") is Decision.SAMPLED


def test_disabled_sampling_samples_nothing() -> None:
    sampler = Sampler(SamplingSettings(rate=1.0, enabled=False))
    assert sampler.at_headers(forced=True) is Tentative.NO


@pytest.mark.parametrize(
    ("settings", "picked_below"),
    [
        (SamplingSettings(rate=0.25, model_rates={"m": 0.5}), 0.5),  # the highest rate
        (SamplingSettings(rate=0.0), 0.0),  # a draw of 0.0 is not picked either
        (SamplingSettings(rate=1.0, enabled=False), None),  # nothing, forced or not
    ],
)
def test_header_time_coin_picks_below_the_highest_rate_while_enabled(
    settings: SamplingSettings, picked_below: float | None
) -> None:
    """`at_headers` (the coin the hook and the C walk flip), and `after_coin`."""
    for draw in (0.0, 0.2, 0.25, 0.49, 0.5, 0.99):
        sampler = Sampler(settings, rand=itertools.repeat(draw).__next__)
        expected = Tentative.RATE if picked_below and draw < picked_below else Tentative.NO
        assert sampler.at_headers(False) is expected, draw
        forced = Tentative.NO if picked_below is None else Tentative.FORCED
        assert sampler.at_headers(True) is forced and sampler.after_coin(True) is forced


@pytest.mark.parametrize(
    "bad",
    [
        {"rate": 1.5},
        {"model_rates": {"m": -0.1}},
        {"budget_per_minute": -1},
        {"duty_cycle": 0.0},
        {"force_header": "X-Upper"},
    ],
)
def test_bad_settings_are_rejected_with_a_clear_error(bad: dict[str, object]) -> None:
    with pytest.raises(SamplingSettingsError):
        SamplingSettings(**bad)  # type: ignore[arg-type]
