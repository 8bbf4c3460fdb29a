"""SamplingMetrics on a fresh registry, read back with `registry.get_sample_value`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from sidecar.replay.job_records import JobResult, Outcome
from sidecar.sampling.metrics import DISABLED_REASONS, PHASE_BUCKETS, SamplingMetrics
from sidecar.sampling.sampler import Decision


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> SamplingMetrics:
    return SamplingMetrics(registry)


def test_decisions_count_per_model_and_decision(
    registry: CollectorRegistry, metrics: SamplingMetrics
) -> None:
    for decision in [Decision.SAMPLED, Decision.SKIPPED_RATE, Decision.SKIPPED_RATE]:
        metrics.record_decision("a", decision)
    metrics.record_decision("b", Decision.SKIPPED_BUDGET)

    def value(model: str, decision: str) -> float | None:
        return registry.get_sample_value(
            "xsp_sampling_decisions_total", {"model": model, "decision": decision}
        )

    assert (value("a", "sampled"), value("a", "skipped_rate")) == (1, 2)
    assert value("b", "skipped_budget") == 1
    assert value("b", "sampled") is None  # no series for what never happened


def test_unpicked_requests_counted_apart_are_one_skipped_rate_series(
    registry: CollectorRegistry, metrics: SamplingMetrics
) -> None:
    """The hook's fast count (`count_skipped`) and `record_decision(SKIPPED_RATE)` (a stream's
    messages, `sample_slow`) add up in one series, exposed as a counter family."""
    metrics.count_skipped("a")
    metrics.count_skipped("a")
    metrics.record_decision("a", Decision.SKIPPED_RATE)
    metrics.record_decision("a", Decision.SKIPPED_DUTY_CYCLE)
    labels = {"model": "a", "decision": "skipped_rate"}
    assert registry.get_sample_value("xsp_sampling_decisions_total", labels) == 3
    family = next(m for m in registry.collect() if m.name == "xsp_sampling_decisions")
    assert family.type == "counter"
    assert sorted((s.labels["decision"], s.value) for s in family.samples) == [
        ("skipped_duty_cycle", 1),
        ("skipped_rate", 3),
    ]


def test_a_result_counts_a_profile_and_sets_the_latest_numbers(
    registry: CollectorRegistry, metrics: SamplingMetrics
) -> None:
    result = JobResult(
        trace_id="t",
        model="resnet-long-name",
        outcome=Outcome.OK,
        busy_s=1.0,
        level_latency_s={"model": 0.010, "layer": 0.012},
        overhead_ratio={"layer": 1.2},
        layer_type_share={"Conv": 0.75, "Relu": 0.25},
    )
    metrics.record_result(result, "resnet")  # the bounded label, not result.model
    labels = {"model": "resnet"}
    assert registry.get_sample_value("xsp_profiles_total", {**labels, "outcome": "ok"}) == 1
    assert registry.get_sample_value(
        "xsp_profiled_latency_seconds", {**labels, "level": "layer"}
    ) == pytest.approx(0.012)
    assert registry.get_sample_value(
        "xsp_profiling_overhead_ratio", {**labels, "level": "layer"}
    ) == pytest.approx(1.2)
    assert registry.get_sample_value(
        "xsp_layer_type_time_share", {**labels, "layer_type": "Conv"}
    ) == pytest.approx(0.75)
    unbounded = {"model": "resnet-long-name", "outcome": "ok"}
    assert registry.get_sample_value("xsp_profiles_total", unbounded) is None


def test_layer_types_absent_from_the_latest_profile_drop_to_zero(
    registry: CollectorRegistry, metrics: SamplingMetrics
) -> None:
    def share(layer_type: str) -> float | None:
        return registry.get_sample_value(
            "xsp_layer_type_time_share", {"model": "m", "layer_type": layer_type}
        )

    first = JobResult("t1", "m", Outcome.OK, 1.0, layer_type_share={"Conv": 0.6, "Gemm": 0.4})
    metrics.record_result(first, "m")
    second = JobResult("t2", "m", Outcome.OK, 1.0, layer_type_share={"Conv": 0.9, "Relu": 0.1})
    metrics.record_result(second, "m")
    assert (share("Conv"), share("Gemm"), share("Relu")) == (0.9, 0.0, 0.1)
    failed = JobResult("t3", "m", Outcome.TIMEOUT, 1.0, error="took too long")
    metrics.record_result(failed, "m")  # no numbers: the latest shares stay
    assert share("Conv") == 0.9
    assert registry.get_sample_value("xsp_profiles_total", {"model": "m", "outcome": "timeout"})


def test_backend_phases_are_observed_in_the_histogram(
    registry: CollectorRegistry, metrics: SamplingMetrics
) -> None:
    metrics.record_phases("m", {"queue": 0.0002, "compute_infer": 0.003})
    metrics.record_phases("m", {"queue": 0.0004})
    queue = {"model": "m", "phase": "queue"}
    assert registry.get_sample_value("xsp_backend_phase_duration_seconds_count", queue) == 2
    assert registry.get_sample_value(
        "xsp_backend_phase_duration_seconds_sum", queue
    ) == pytest.approx(0.0006)
    bucket = {**queue, "le": "0.00025"}
    assert registry.get_sample_value("xsp_backend_phase_duration_seconds_bucket", bucket) == 1
    assert 0.00025 in PHASE_BUCKETS


@dataclass
class FakePipelineState:
    """What the pipeline's bound callables report: queue depth, why sampling is off, bytes."""

    depth: int = 3
    reason: str | None = None
    kept_bytes: int = 100


def test_gauges_bound_to_callables_are_read_at_scrape_time(
    registry: CollectorRegistry, metrics: SamplingMetrics
) -> None:
    state = FakePipelineState()
    metrics.bind_queue_depth(lambda: state.depth)
    metrics.bind_state(lambda: state.reason, lambda: state.kept_bytes)
    assert registry.get_sample_value("xsp_profile_queue_depth") == 3
    assert registry.get_sample_value("xsp_sampling_enabled") == 1
    assert registry.get_sample_value("xsp_last_request_bytes") == 100
    for reason in DISABLED_REASONS:
        assert registry.get_sample_value("xsp_sampling_disabled", {"reason": reason}) == 0
    state.depth, state.reason, state.kept_bytes = 0, "store_failing", 0
    assert registry.get_sample_value("xsp_profile_queue_depth") == 0
    assert registry.get_sample_value("xsp_sampling_enabled") == 0
    assert registry.get_sample_value("xsp_last_request_bytes") == 0
    assert {
        reason: registry.get_sample_value("xsp_sampling_disabled", {"reason": reason})
        for reason in DISABLED_REASONS
    } == {"store_unavailable": 0, "store_failing": 1, "settings": 0}


def test_plain_counters(registry: CollectorRegistry, metrics: SamplingMetrics) -> None:
    metrics.dropped.labels("m", "queue_full").inc()
    metrics.worker_restarts.inc()
    metrics.store_write_failures.inc(2)
    assert (
        registry.get_sample_value(
            "xsp_samples_dropped_total", {"model": "m", "reason": "queue_full"}
        )
        == 1
    )
    assert registry.get_sample_value("xsp_profiler_worker_restarts_total") == 1
    assert registry.get_sample_value("xsp_trace_store_write_failures_total") == 2


def test_two_registries_do_not_share_values() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    SamplingMetrics(first).record_decision("m", Decision.SAMPLED)
    SamplingMetrics(second)
    labels = {"model": "m", "decision": "sampled"}
    assert first.get_sample_value("xsp_sampling_decisions_total", labels) == 1
    assert second.get_sample_value("xsp_sampling_decisions_total", labels) is None
