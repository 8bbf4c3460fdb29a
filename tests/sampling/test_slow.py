"""`--sample-slow`: the rolling quantile, the setting's parser, and the relay hook holding
bodies until the response's end. The hook runs with a real `Sampler` and real metrics; the
worker queue and store are `test_observer`'s in-memory `SampleHandler` (FAKE)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from sidecar.config_parsers import ConfigError, sample_slow
from sidecar.proxy.streams import RequestStart, StreamEnd
from sidecar.sampling.held import SLOW_HOLD
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import MAX_SAMPLED_BODY, SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings, SamplingSettingsError
from sidecar.sampling.slow import EDGES, RollingQuantile, SlowDetector, bucket_of
from tests.sampling.test_observer import (
    CONNECTION,
    INFER,
    InMemoryHandler,
    ManualClock,
    framed,
    wait_for,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [("off", "off"), ("P99", "p99"), ("250", 250.0), ("12.5ms", 12.5), (" 3 ms ", 3.0), (7, 7.0)],
)
def test_the_setting_reads_off_p99_or_milliseconds(text: object, value: object) -> None:
    assert sample_slow(text, "--sample-slow") == value


@pytest.mark.parametrize("text", ["0", "-5ms", "p95", "fast", "inf", "nan", "", "10s", True])
def test_a_bad_setting_says_what_is_expected(text: object) -> None:
    with pytest.raises(ConfigError, match=r"--sample-slow: expected off, p99 or a latency"):
        sample_slow(text, "--sample-slow")


def test_sampling_settings_refuse_a_threshold_the_parser_would_not_give() -> None:
    for bad in (0.0, -1.0, float("inf"), "p50", True):
        with pytest.raises(SamplingSettingsError, match="sample_slow"):
            SamplingSettings(slow=bad)  # type: ignore[arg-type]


def test_buckets_cover_each_duration_with_an_edge_at_most_9_percent_above() -> None:
    for seconds in (2e-5, 1e-4, 0.0031, 0.25, 1.0, 42.0, 599.0):
        edge = EDGES[bucket_of(seconds)]
        assert seconds <= edge < seconds * 2 ** (1 / 8) * 1.000001
    assert bucket_of(0.0) == 0 and bucket_of(1e9) == len(EDGES) - 1


def test_the_rolling_p99_waits_for_min_count_then_is_the_bucket_of_the_true_one() -> None:
    rng = random.Random(3)
    q = RollingQuantile(window=1000, min_count=100, refresh=50)
    durations = [rng.lognormvariate(-5, 0.5) for _ in range(2000)]
    for d in durations[:99]:
        q.observe(d)
    assert q.value is None
    q.observe(durations[99])
    assert q.value == EDGES[bucket_of(sorted(durations[:100])[98])]  # the 99th of 100
    for d in durations[100:]:
        q.observe(d)
    assert q.count == 1000  # the first window was forgotten at the 2000th
    assert q.value == EDGES[bucket_of(sorted(durations[1000:])[989])]  # the 990th of 1000


def test_the_rolling_p99_forgets_an_old_regime() -> None:
    q = RollingQuantile(window=200, min_count=100, refresh=10)
    for _ in range(400):
        q.observe(0.5)  # slow regime
    assert q.value == EDGES[bucket_of(0.5)]
    for _ in range(400):  # two windows of fast responses push the slow ones out
        q.observe(0.001)
    assert q.value == EDGES[bucket_of(0.001)]


def test_a_detector_judges_against_the_threshold_before_counting_the_response() -> None:
    fixed = SlowDetector(100.0)
    assert fixed.threshold_s("m") == 0.1
    assert fixed.observe("m", 0.1001) and not fixed.observe("m", 0.1)
    assert SlowDetector.of("off") is None
    rolling = SlowDetector("p99", min_count=100, refresh=10)
    assert not rolling.observe("m", 10.0)  # no estimate yet: nothing is slow
    for _ in range(99):
        assert not rolling.observe("m", 0.001)
    assert rolling.threshold_s("m") == EDGES[bucket_of(0.001)]  # the 99th of 100
    assert rolling.threshold_s("other") is None
    for _ in range(900):
        rolling.observe("m", 0.001)
    assert rolling.threshold_s("m") == EDGES[bucket_of(0.001)]
    assert rolling.observe("m", 0.05) and not rolling.observe("m", 0.001)


class SlowSetup:
    """The hook with `sample_slow` on and rate 0, over test_observer's in-memory handler."""

    def __init__(self, slow: float | str = 100.0, **settings: float) -> None:
        self.clock = ManualClock()
        options: dict[str, float] = {"rate": 0.0, "budget_per_minute": 1000.0, "duty_cycle": 1.0}
        options.update(settings)
        self.sampler = Sampler(SamplingSettings(slow=slow, **options), clock=self.clock)  # type: ignore[arg-type]
        self.registry = CollectorRegistry()
        self.handler = InMemoryHandler({"m"})
        self.hub = SamplingHub(self.sampler, SamplingMetrics(self.registry), self.handler)
        self.observer = self.hub.observer_factory(CONNECTION)
        self._sid = 1

    def call(
        self, seconds: float, model: str = "m", message: bytes = b"x", code: str = "OK"
    ) -> bool:
        """One whole call; True if the hook asked for its body."""
        sid, self._sid = self._sid, self._sid + 2
        start = RequestStart(1, sid, INFER, "ModelInfer", [(b":path", INFER.encode())])
        decision = self.observer.on_request_headers(start)
        if decision is not None:
            assert decision.capture_body and decision.capture_limit == MAX_SAMPLED_BODY
            assert not decision.extra_headers  # decided after the fact: no traceparent
            self.observer.on_request_body(sid, model, framed(message))
        self.observer.on_stream_end(
            StreamEnd(1, sid, INFER, "ModelInfer", model, code, "", 1_700_000_000_000_000_000,
                      seconds, 20, 30)
        )  # fmt: skip
        return decision is not None

    def dropped(self, reason: str, model: str = "m") -> float:
        labels = {"model": model, "reason": reason}
        return self.registry.get_sample_value("xsp_samples_dropped_total", labels) or 0.0

    def decision(self, value: str, model: str = "m") -> float:
        labels = {"model": model, "decision": value}
        return self.registry.get_sample_value("xsp_sampling_decisions_total", labels) or 0.0


def test_only_the_slow_responses_become_jobs_from_their_own_bodies() -> None:
    s = SlowSetup(slow=100.0)
    for i, seconds in enumerate([0.01, 0.5, 0.02, 0.2, 0.1]):
        assert s.call(seconds, message=b"req%d" % i)
    assert [(j.request_message, j.reason) for j in s.handler.jobs] == [
        (b"req1", "slow"),
        (b"req3", "slow"),
    ]
    assert s.handler.picked == []  # nothing was marked at header time
    spans = {trace_id: span for trace_id, (span,) in s.handler.spans}
    assert set(spans) == {j.trace_id for j in s.handler.jobs}
    for job in s.handler.jobs:
        assert spans[job.trace_id].span_id == job.parent_span_id
        assert s.hub.is_sampled_trace(job.trace_id)
    assert (s.decision("sampled"), s.decision("skipped_rate")) == (2, 3)
    sampled = s.registry.get_sample_value("xsp_sampled_total", {"model": "m", "reason": "slow"})
    assert sampled is None  # counted by the pipeline's submit, not by the hook


def test_slow_samples_take_the_budget_and_skip_unknown_models_and_errors() -> None:
    s = SlowSetup(slow=100.0, budget_per_minute=1.0)
    s.call(0.5, model="elsewhere")  # not in the repository: no candidate, no token spent
    s.call(0.5, code="DEADLINE_EXCEEDED")  # not a response of the model
    s.call(0.5)
    s.call(0.5)  # the budget is spent
    assert [j.model for j in s.handler.jobs] == ["m"]
    assert s.decision("skipped_rate", "elsewhere") == 1
    assert (s.decision("sampled"), s.decision("skipped_budget"), s.decision("skipped_rate")) == (
        1, 1, 1,
    )  # fmt: skip


def test_slow_ones_met_while_the_worker_is_busy_are_held_and_run_the_slowest_first() -> None:
    """Below a full duty cycle one profile runs at a time: the slow responses that come
    meanwhile keep their bodies in the hold (the slowest `SLOW_HOLD`; the faster ones pushed
    out are counted), then each runs when the gate opens, the slowest first."""
    s = SlowSetup(slow=100.0, duty_cycle=0.5)
    assert s.call(0.5, message=b"first")
    for seconds in (0.2, 0.9, 0.3, 0.6, 0.15, 0.4):
        assert s.call(seconds, message=b"%.2f" % seconds)  # each body is copied
    assert [j.request_message for j in s.handler.jobs] == [b"first"]
    assert len(s.hub.held) == SLOW_HOLD == 4
    assert s.dropped("hold_full") == 2  # 0.20 and 0.15, pushed out by slower ones
    assert s.decision("sampled") == 7
    for n, expected in enumerate((b"0.90", b"0.60", b"0.40", b"0.30"), start=2):
        s.sampler.duty.record_busy(1.0)  # the running profile ends: the gate opens 1 s later
        time.sleep(0.1)
        assert len(s.handler.jobs) == n - 1  # not before the gate opens
        s.clock.now += 1.0
        assert wait_for(lambda n=n: len(s.handler.jobs) == n), n  # type: ignore[misc]
        assert s.handler.jobs[-1].request_message == expected
        assert s.handler.jobs[-1].reason == "slow"
    # each queued one's request span went to the store, under its trace
    spans = {trace_id: span for trace_id, (span,) in s.handler.spans}
    assert {j.trace_id for j in s.handler.jobs} == set(spans)
    assert len(s.hub.held) == 0 and s.sampler.duty.waiting == 0


def test_no_body_is_held_while_sampling_is_off() -> None:
    s = SlowSetup(slow=100.0, duty_cycle=0.5)
    s.sampler.update(s.sampler.settings.updated(enabled=False))
    assert not s.call(0.5)
    assert s.handler.jobs == [] and len(s.hub.held) == 0


def test_with_p99_the_slowest_of_a_model_become_jobs_after_min_count() -> None:
    s = SlowSetup(slow="p99")
    for _ in range(100):
        s.call(0.01)
    assert s.handler.jobs == []
    s.call(EDGES[bucket_of(0.01)])  # at the p99 bucket's edge: not slower
    s.call(0.3, message=b"slow one")
    assert [j.request_message for j in s.handler.jobs] == [b"slow one"]


def test_the_rate_still_samples_with_reason_rate_beside_slow() -> None:
    s = SlowSetup(slow=100.0, rate=1.0)
    assert s.observer.on_request_headers(
        RequestStart(1, 1, INFER, "ModelInfer", [(b":path", INFER.encode())])
    ).extra_headers  # type: ignore[union-attr]
    s.observer.on_request_body(1, "m", framed(b"r"))
    s.observer.on_stream_end(StreamEnd(1, 1, INFER, "ModelInfer", "m", "OK", "", 1, 0.5, 20, 30))
    assert [(j.request_message, j.reason) for j in s.handler.jobs] == [(b"r", "rate")]


def test_a_stream_is_never_held_nor_counted_in_the_p99() -> None:
    """A stream's duration is its whole life: ModelStreamInfer is not judged by sample_slow."""
    s = SlowSetup(slow=100.0)
    start = RequestStart(1, 1, INFER, "ModelStreamInfer", [(b":path", INFER.encode())])
    decision = s.observer.on_request_headers(start)
    # its messages are decided on one by one (test_stream_sampling.py); the stream is not
    assert decision is not None and decision.messages is not None
    assert not decision.capture_body and not decision.extra_headers
    s.observer.on_stream_end(
        StreamEnd(1, 1, INFER, "ModelStreamInfer", "m", "OK", "", 1, 5.0, 20, 30)
    )
    assert s.handler.jobs == [] and s.decision("skipped_rate") == 0
    rolling = SlowSetup(slow="p99")
    for i in range(200):
        rolling.observer.on_stream_end(
            StreamEnd(1, 2 * i + 1, INFER, "ModelStreamInfer", "m", "OK", "", 1, 5.0, 20, 30)
        )
    assert rolling.hub.slow is not None and rolling.hub.slow.threshold_s("m") is None


def test_serve_refuses_sample_slow_without_a_model_repository() -> None:
    """The real `xsp-sidecar serve`: without a repository nothing could be replayed (exit 2)."""
    run = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--backend", "127.0.0.1:1", "--listen",
         "127.0.0.1:0", "--metrics-port", "0", "--grpc-port", "0", "--sample-slow", "p99"],
        capture_output=True, text=True, timeout=60, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("XSP_")},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "--sample-slow needs --model-repository" in run.stderr
