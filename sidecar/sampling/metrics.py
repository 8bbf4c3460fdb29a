"""Prometheus aggregates of sampling and profiling (names fixed in docs/contracts.md).

`xsp_sampling_decisions_total`, counted for every replayable request, is a plain dictionary of
integers turned into its family at scrape time (`DecisionCounts`), as the proxy's per-call
counters are: no lock and no prometheus child on the relay's path.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.replay.job_records import JobResult
from sidecar.sampling.sampler import Decision

# Why sampling is off (`xsp_sampling_disabled{reason}`).
DISABLED_REASONS = ("store_unavailable", "store_failing", "settings")

PHASE_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


class DecisionCounts(Collector):
    """`xsp_sampling_decisions_total{model, decision}` from plain counts, kept by the relay's
    thread and read at scrape time. Unpicked requests, nearly all of them, are counted by
    model label alone (`skipped`), the rest by (label, decision value)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.skipped: dict[str, int] = {}  # model label -> `skipped_rate` decisions
        self.other: dict[tuple[str, str], int] = {}  # (label, decision value) -> decisions
        registry.register(self)

    def collect(self) -> list[Metric]:
        counts = dict(self.other)
        for label, n in list(self.skipped.items()):
            key = (label, Decision.SKIPPED_RATE.value)
            counts[key] = counts.get(key, 0) + n
        family = CounterMetricFamily(
            "xsp_sampling_decisions",
            "Sampling decisions on live requests.",
            labels=["model", "decision"],
        )
        for labels, n in counts.items():
            family.add_metric(labels, n)
        return [family]


class SamplingMetrics:
    """Counters and gauges for decisions, drops, the worker and profile results.

    Model labels must arrive already bounded by the proxy's cap (`_other` past it; callers
    pass names through `model_label`); layer types are bounded by the op vocabulary of the
    runtimes.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = DecisionCounts(registry)
        self.dropped = Counter(
            "xsp_samples_dropped",
            "Sampled requests dropped before profiling.",
            ["model", "reason"],
            registry=registry,
        )
        self.sampled = Counter(
            "xsp_sampled",
            "Requests queued for profiling, by why they were sampled (the trace's "
            "sample_reason): rate, forced, slow or admin.",
            ["model", "reason"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "xsp_profile_queue_depth",
            "Sampled requests waiting for the profiling worker.",
            registry=registry,
        )
        self.profiles = Counter(
            "xsp_profiles", "Profiles by outcome.", ["model", "outcome"], registry=registry
        )
        self.worker_restarts = Counter(
            "xsp_profiler_worker_restarts",
            "Restarts of the profiling worker process.",
            registry=registry,
        )
        self.profiled_latency = Gauge(
            "xsp_profiled_latency_seconds",
            "Model latency of the latest profile, from the run whose deepest level is `level`.",
            ["model", "level"],
            registry=registry,
        )
        self.overhead_ratio = Gauge(
            "xsp_profiling_overhead_ratio",
            "Model latency with profilers down to `level`, divided by the unprofiled latency.",
            ["model", "level"],
            registry=registry,
        )
        self.layer_type_share = Gauge(
            "xsp_layer_type_time_share",
            "Share of layer time spent in each layer type, latest profile.",
            ["model", "layer_type"],
            registry=registry,
        )
        self.backend_phase = Histogram(
            "xsp_backend_phase_duration_seconds",
            "Backend phases of sampled requests, from the server's own spans.",
            ["model", "phase"],
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.store_write_failures = Counter(
            "xsp_trace_store_write_failures",
            "Traces or spans that could not be stored.",
            registry=registry,
        )
        self.enabled = Gauge(
            "xsp_sampling_enabled",
            "1 while live requests can become profiles, 0 while sampling is off "
            "(xsp_sampling_disabled says why).",
            registry=registry,
        )
        self.disabled = Gauge(
            "xsp_sampling_disabled",
            "1 for the reason sampling is off now: store_unavailable (the trace store could "
            "not be opened at start-up), store_failing (writes fail; sampling backs off), "
            "settings (switched off through the admin API).",
            ["reason"],
            registry=registry,
        )
        self.last_request_bytes = Gauge(
            "xsp_last_request_bytes",
            "Bytes of the last sampled requests kept for admin-triggered profiles.",
            registry=registry,
        )
        self._layer_types: dict[str, set[str]] = {}

    def bind_queue_depth(self, depth: Callable[[], int]) -> None:
        self.queue_depth.set_function(lambda: float(depth()))

    def bind_state(
        self, disabled_reason: Callable[[], str | None], last_request_bytes: Callable[[], int]
    ) -> None:
        """Gauges read at scrape time: why sampling is off (None: it is on), bytes kept."""
        self.enabled.set_function(lambda: 0.0 if disabled_reason() else 1.0)
        for reason in DISABLED_REASONS:
            self.disabled.labels(reason).set_function(_is_reason(disabled_reason, reason))
        self.last_request_bytes.set_function(lambda: float(last_request_bytes()))

    def record_decision(self, model: str, decision: Decision) -> None:
        if decision is Decision.SKIPPED_RATE:
            self.count_skipped(model)
            return
        other = self.decisions.other
        key = (model, decision.value)
        other[key] = other.get(key, 0) + 1

    def count_skipped(self, model: str) -> None:
        """One `skipped_rate` decision for model label `model` (every unpicked request)."""
        skipped = self.decisions.skipped
        skipped[model] = skipped.get(model, 0) + 1

    def record_result(self, result: JobResult, model: str) -> None:
        """Count a profile under `model`, the bounded label of `result.model`."""
        self.profiles.labels(model, result.outcome).inc()
        for level, seconds in result.level_latency_s.items():
            self.profiled_latency.labels(model, level).set(seconds)
        for level, ratio in result.overhead_ratio.items():
            self.overhead_ratio.labels(model, level).set(ratio)
        if result.layer_type_share:
            # Types absent from this profile drop to zero instead of keeping a stale share.
            for layer_type in self._layer_types.get(model, set()) - result.layer_type_share.keys():
                self.layer_type_share.labels(model, layer_type).set(0.0)
            for layer_type, share in result.layer_type_share.items():
                self.layer_type_share.labels(model, layer_type).set(share)
            self._layer_types[model] = set(result.layer_type_share) | self._layer_types.get(
                model, set()
            )

    def record_phases(self, model: str, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.backend_phase.labels(model, phase).observe(seconds)


def _is_reason(current: Callable[[], str | None], reason: str) -> Callable[[], float]:
    return lambda: 1.0 if current() == reason else 0.0
