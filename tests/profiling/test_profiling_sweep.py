"""The re-measuring loop of a batch sweep (`profiling.sweep.settle`), with an in-memory fake
runner whose latencies are scripted: noisy at first for some batch sizes, tight afterwards."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from sidecar.profiling.experiment import LeveledProfile, run_experiment
from sidecar.profiling.summary import render_sweep
from sidecar.profiling.sweep import Round, settle, sweep_decision
from sidecar.profiling.vocabulary import Iteration, LevelRun, RawSpan, RuntimeInfo
from sidecar.trace.spans import Level

# true latencies (ms): 1->2 pays (+67% throughput), 2->4 and 4->8 stop (-8%, 0%): optimum 2
LATENCY_MS = {1: 1.0, 2: 1.2, 4: 2.6, 8: 5.2}
# relative spreads of the 10 timed iterations: about 14% standard error, then 0.1%
NOISY = [0.5, 1.5, 0.6, 1.4, 0.7, 1.3, 0.8, 1.2, 0.9, 1.1]
TIGHT = [1.0, 1.001, 0.999, 1.0, 1.001, 0.999, 1.0, 1.001, 0.999, 1.0]
ITERATIONS = 10


class FakeRunner:
    """In-memory stand-in for a runtime runner: M level only, scripted latencies.

    The first `noisy_calls` runs of each batch size in `noisy` spread by NOISY, every other run
    by TIGHT; `calls` records the batch size of every run in order."""

    name = "fake"

    def __init__(self, noisy: set[int], noisy_calls: int) -> None:
        self.noisy = noisy
        self.noisy_calls = noisy_calls
        self.calls: list[int] = []

    def describe(self) -> RuntimeInfo:
        return RuntimeInfo("fake", "0", "none", "cpu")

    def supported_levels(self) -> tuple[Level, ...]:
        return (Level.MODEL,)

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        assert level is Level.MODEL  # the repeats measure the model level only
        batch = int(inputs["x"].shape[0])
        noisy = batch in self.noisy and self.calls.count(batch) < self.noisy_calls
        self.calls.append(batch)
        spread = NOISY if noisy else TIGHT
        t, its = 0, []
        for i in range(iterations):
            lat = round(LATENCY_MS[batch] * 1e6 * spread[i % len(spread)])
            its.append(Iteration(lat, [RawSpan(Level.MODEL, "fake", "model", t, t + lat)]))
            t += lat
        return LevelRun(level, its, warmup)


def _inputs(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.zeros((batch, 4), np.float32)}


def _sweep(runner: FakeRunner, batches: tuple[int, ...] = (1, 2, 4, 8)) -> list[LeveledProfile]:
    return [
        run_experiment(
            runner,
            _inputs(b),
            model="fake",
            levels=(Level.MODEL,),
            iterations=ITERATIONS,
            warmup=0,
            batch_size=b,
        )
        for b in batches
    ]


def test_repeats_exactly_the_named_batch_sizes_and_stops_once_decided() -> None:
    runner = FakeRunner(noisy={2, 4}, noisy_calls=1)
    results = _sweep(runner)
    first = sweep_decision(results)
    assert first is not None and (first.status, first.measure_next) == ("uncertain", (2, 4))
    seen: list[Round] = []
    settled = settle(results, runner, _inputs, iterations=ITERATIONS, warmup=0,
                     max_rounds=5, on_round=seen.append)  # fmt: skip
    assert settled is not None
    assert runner.calls == [1, 2, 4, 8, 2, 4]  # one round, of batch 2 and 4 only
    assert (settled.decision.status, settled.decision.optimal) == ("decided", 2)
    assert [r.batches for r in settled.rounds] == [(2, 4)] and seen == list(settled.rounds)
    line = seen[0].describe(5)
    assert line.startswith("re-measuring batch 2 and 4 (round 1 of 5): 95% interval of 2->4 was")
    assert settled.summary() == "decided after 1 extra round (re-measured batch 2 and 4)"
    by_batch = {r.trace.batch_size: r for r in results}
    for b, runs in ((1, 1), (2, 2), (4, 2), (8, 1)):
        stats = by_batch[b].stats(Level.MODEL)
        assert len(stats.samples_ns) == ITERATIONS * runs  # pooled with the sweep's iterations
        assert by_batch[b].trace.attributes.get("model_runs", 1) == runs
        (span,) = by_batch[b].spans_at(Level.MODEL)
        assert span.duration_ns == stats.trimmed_mean_ns  # the timeline follows the pool
    assert sweep_decision(results) == settled.decision  # what a reader of the traces decides


@pytest.mark.parametrize("max_rounds", [0, 1, 2])
def test_max_rounds_bounds_the_repeats_of_a_decision_that_stays_noisy(max_rounds: int) -> None:
    runner = FakeRunner(noisy={2, 4}, noisy_calls=99)  # never quiets down
    results = _sweep(runner)
    settled = settle(results, runner, _inputs, iterations=ITERATIONS, warmup=0,
                     max_rounds=max_rounds)  # fmt: skip
    assert settled is not None
    assert runner.calls == [1, 2, 4, 8] + [2, 4] * max_rounds
    assert len(settled.rounds) == max_rounds and settled.decision.status == "uncertain"
    assert settled.summary().startswith("still uncertain")
    assert ("--max-rounds 0" in settled.summary()) == (max_rounds == 0)
    # the console never prints the uncertain decision as a bare number: the interval goes along
    text = render_sweep([(1, 1.0)], settled.decision, [settled.summary()])
    assert "optimal batch size: uncertain: doubling 2->4" in text and "95% interval" in text


def test_a_missing_batch_size_is_named_never_measured() -> None:
    runner = FakeRunner(noisy=set(), noisy_calls=0)
    results = _sweep(runner, (1, 2))  # 1->2 pays: batch 4 would decide, but was not asked for
    settled = settle(results, runner, _inputs, iterations=ITERATIONS, warmup=0, max_rounds=2)
    assert settled is not None and runner.calls == [1, 2]
    assert (settled.decision.status, settled.decision.measure_next) == ("not_yet_known", (4,))
    assert settled.rounds == () and settled.summary().startswith("the sweep lacks")


def test_one_batch_size_is_no_sweep() -> None:
    runner = FakeRunner(noisy={1}, noisy_calls=1)
    results = _sweep(runner, (1,))
    assert settle(results, runner, _inputs, iterations=3, warmup=0, max_rounds=2) is None
    assert runner.calls == [1]
    with pytest.raises(ValueError, match="max_rounds"):
        settle(results, runner, _inputs, iterations=3, warmup=0, max_rounds=-1)
