"""The sampling pipeline on its own: a fresh registry, a real SQLite store in a temp folder,
no OTLP receiver, and no worker process (the worker is only started by `start()`).

Results, jobs and store failures are handed to the pipeline's callbacks directly, as the
worker and the trace writer would from their threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.backends.replayability import Replayability
from sidecar.replay.job_records import JobResult, Outcome, ProfileJob
from sidecar.replay.options import ReplayOptions
from sidecar.sampling.pipeline import SamplingConfig, SamplingPipeline
from sidecar.sampling.sampler import StoreBackoff
from sidecar.sampling.settings import SamplingSettings
from sidecar.trace.assembly import TRACING_OFF
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.spans import Level, Source, Span, Trace
from sidecar.trace.store import TraceStore

KNOWN = {"resnet", "bert"}  # the model label cap: anything else counts as _other


def model_label(model: str | None) -> str:
    return model if model in KNOWN else "_other"


def sampling_config(
    repository: Path, db_path: Path, otlp_port: int | None = None
) -> SamplingConfig:
    options = ReplayOptions(
        model_repository=repository,
        db_path=db_path,
        levels=(Level.MODEL, Level.LAYER),
        iterations=1,
        warmup=0,
        store_raw_inputs=False,
        device="auto",
    )
    return SamplingConfig(
        settings=SamplingSettings(),
        replay_options=options,
        otlp_host="127.0.0.1",
        otlp_port=otlp_port,
        queue_size=2,
        profile_timeout_s=10.0,
        retention=RetentionPolicy(),
    )


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    for model in ("resnet", "bert"):
        (repo / model / "1").mkdir(parents=True)
    return repo


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def pipeline(
    repository: Path, tmp_path: Path, registry: CollectorRegistry
) -> Iterator[SamplingPipeline]:
    sampling = SamplingPipeline(
        sampling_config(repository, tmp_path / "traces.db"), registry, model_label
    )
    yield sampling
    sampling.stop()


class FakeClock:
    """A clock the test moves by hand, for the store's back-off."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(pipeline: SamplingPipeline) -> FakeClock:
    """Put the store back-off of `pipeline` on a fake clock (first wait: 1 s)."""
    fake = FakeClock()
    pipeline.sampler.store = StoreBackoff(fake)
    return fake


def job(model: str, reason: str = "rate") -> ProfileJob:
    return ProfileJob(
        trace_id="ab" * 16,
        parent_span_id="cd" * 8,
        model=model,
        method="ModelInfer",
        request_message=b"",
        reason=reason,
        received_ns=time.time_ns(),
    )


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_a_store_that_cannot_be_opened_turns_sampling_off(
    repository: Path, tmp_path: Path, registry: CollectorRegistry
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    config = sampling_config(repository, tmp_path / "a-file" / "traces.db", otlp_port=0)
    sampling = SamplingPipeline(config, registry, model_label)
    try:
        assert sampling.disabled_reason is not None
        assert "trace store cannot be used" in sampling.disabled_reason
        assert "a-file" in sampling.disabled_reason
        assert not sampling.enabled and not sampling.serving()
        assert sampling.state() == "store_unavailable"
        assert sampling.receiver is None  # no OTLP receiver for traces that cannot be stored
        sampling.start()
        assert sampling.worker.pid is None  # nor a worker for profiles that cannot be stored
        assert value(registry, "xsp_sampling_enabled") == 0
        assert value(registry, "xsp_sampling_disabled", reason="store_unavailable") == 1
        assert value(registry, "xsp_sampling_disabled", reason="store_failing") == 0
        assert not sampling.store_spans("ab" * 16, [])
        assert value(registry, "xsp_trace_store_write_failures_total") == 1
    finally:
        sampling.stop()


def test_a_working_pipeline_reports_sampling_on(
    pipeline: SamplingPipeline, registry: CollectorRegistry
) -> None:
    assert pipeline.enabled and pipeline.serving()
    assert pipeline.state() is None
    assert pipeline.config.db_path == pipeline.config.replay_options.db_path
    assert value(registry, "xsp_sampling_enabled") == 1
    assert value(registry, "xsp_sampling_disabled", reason="store_unavailable") == 0
    assert value(registry, "xsp_profile_queue_depth") == 0
    pipeline.sampler.update(replace(pipeline.sampler.settings, enabled=False))
    assert pipeline.state() == "settings"
    assert value(registry, "xsp_sampling_disabled", reason="settings") == 1


def test_an_ok_result_sets_the_aggregates_under_the_bounded_model_label(
    pipeline: SamplingPipeline, registry: CollectorRegistry
) -> None:
    result = JobResult(
        "ab" * 16,
        "resnet",
        Outcome.OK,
        0.25,
        level_latency_s={"model": 0.01, "layer": 0.012},
        overhead_ratio={"model": 1.0, "layer": 1.2},
        layer_type_share={"Conv": 0.75, "Relu": 0.25},
    )
    pipeline._on_result(result)
    pipeline._on_result(replace(result, model="made-up-model"))
    assert value(registry, "xsp_profiles_total", model="resnet", outcome="ok") == 1
    assert value(registry, "xsp_profiles_total", model="_other", outcome="ok") == 1
    assert value(registry, "xsp_profiles_total", model="made-up-model", outcome="ok") is None
    assert value(registry, "xsp_profiled_latency_seconds", model="resnet", level="layer") == 0.012
    assert value(registry, "xsp_profiling_overhead_ratio", model="resnet", level="layer") == 1.2
    assert value(registry, "xsp_layer_type_time_share", model="resnet", layer_type="Conv") == 0.75


def test_an_error_is_counted_and_logged_without_touching_the_store_state(
    pipeline: SamplingPipeline, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.sampling.pipeline"):
        pipeline._on_result(JobResult("ab" * 16, "bert", Outcome.ERROR, 0.1, "ValueError: bad"))
    assert value(registry, "xsp_profiles_total", model="bert", outcome="error") == 1
    assert "profile of 'bert': error (ValueError: bad)" in caplog.text
    assert not pipeline.sampler.store.failing
    assert value(registry, "xsp_trace_store_write_failures_total") == 0


def test_a_store_error_backs_sampling_off_until_a_profile_is_stored(
    pipeline: SamplingPipeline, registry: CollectorRegistry, clock: FakeClock
) -> None:
    pipeline._on_result(JobResult("ab" * 16, "resnet", Outcome.STORE_ERROR, 0.1, "disk full"))
    assert value(registry, "xsp_profiles_total", model="resnet", outcome="store_error") == 1
    assert value(registry, "xsp_trace_store_write_failures_total") == 1
    assert pipeline.state() == "store_failing" and not pipeline.serving()
    assert value(registry, "xsp_sampling_enabled") == 0
    assert value(registry, "xsp_sampling_disabled", reason="store_failing") == 1
    clock.now += 1.5  # the back-off is over; the store still counts as failing
    assert pipeline.state() is None and not pipeline.serving()
    pipeline._on_result(JobResult("cd" * 16, "resnet", Outcome.OK, 0.1))
    assert pipeline.serving() and not pipeline.sampler.store.failing
    assert value(registry, "xsp_sampling_disabled", reason="store_failing") == 0


def test_queued_live_samples_are_skipped_while_the_store_fails(
    pipeline: SamplingPipeline, registry: CollectorRegistry, clock: FakeClock
) -> None:
    assert not pipeline._skip_job(job("resnet"))
    pipeline._store_failed(OSError("read-only file system"))
    assert pipeline._skip_job(job("resnet"))
    assert pipeline._skip_job(job("made-up-model", reason="forced"))
    assert not pipeline._skip_job(job("resnet", reason="admin"))  # an operator asked for it
    assert value(registry, "xsp_samples_dropped_total", model="resnet", reason="store_failing") == 1
    assert value(registry, "xsp_samples_dropped_total", model="_other", reason="store_failing") == 1
    clock.now += 1.5
    assert not pipeline._skip_job(job("resnet"))  # the back-off is over: try again


def test_known_models_are_the_folders_of_the_model_repository(
    pipeline: SamplingPipeline,
) -> None:
    assert pipeline.known_model("resnet") and pipeline.known_model("bert")
    for model in ("gpt", "", ".", "..", "../models", "resnet/1"):
        assert not pipeline.known_model(model), model
    assert pipeline.last_requests.remember("resnet", "ModelInfer", b"x")
    assert not pipeline.last_requests.remember("gpt", "ModelInfer", b"x")


def test_queued_jobs_are_counted_by_reason_under_the_bounded_label(
    pipeline: SamplingPipeline, registry: CollectorRegistry
) -> None:
    """Every reason a job is queued for (the hub's and the admin API's) is on /metrics; a job
    the full queue refuses (queue size 2) is not counted."""
    for model, reason in [("resnet", "slow"), ("elsewhere", "admin"), ("resnet", "rate")]:
        pipeline.submit(job(model, reason))

    def sampled(model: str, reason: str) -> float | None:
        return registry.get_sample_value("xsp_sampled_total", {"model": model, "reason": reason})

    assert (sampled("resnet", "slow"), sampled("_other", "admin")) == (1.0, 1.0)
    assert sampled("resnet", "rate") is None


def _request_span(trace_id: str) -> Span:
    now = time.time_ns()
    return Span(trace_id, "cd" * 8, None, Level.REQUEST, "/x/ModelInfer", "ModelInfer", now,
                now + 1_000_000, Source.PROXY, attributes={"model": "resnet"})  # fmt: skip


def _assembly(pipeline: SamplingPipeline, trace_id: str) -> dict[str, object] | None:
    assert pipeline.writer is not None and pipeline.writer.flush(10)
    with TraceStore(pipeline.config.db_path) as store:
        trace = store.get_trace(trace_id)
    assert trace is not None
    found = trace.attributes.get("assembly")
    return found if isinstance(found, dict) else None


def test_a_queued_job_is_assembled_from_its_parts_and_its_result(
    pipeline: SamplingPipeline,
) -> None:
    """No OTLP receiver: the backend's spans are not waited for."""
    queued = job("resnet")
    assert pipeline.submit(queued)
    assert pipeline.store_spans(queued.trace_id, [_request_span(queued.trace_id)])
    with TraceStore(pipeline.config.db_path) as worker_store:  # as the worker's process does
        worker_store.write_trace(Trace(queued.trace_id, "resnet", time.time_ns()), [])
    assert _assembly(pipeline, queued.trace_id) is None  # its result has not come yet
    pipeline._on_result(JobResult(queued.trace_id, "resnet", "ok", 0.1))
    assert _assembly(pipeline, queued.trace_id) == {
        "state": "incomplete",
        "missing": ["backend"],
        "why": f"backend: {TRACING_OFF}",
    }


def test_a_live_only_sample_is_final_once_its_request_span_is_stored(
    pipeline: SamplingPipeline,
) -> None:
    sampled = job("resnet")
    why = Replayability(False, "served by 'ensemble'")
    assert pipeline.keep_live(sampled, why)
    assert _assembly(pipeline, sampled.trace_id) is None
    assert pipeline.store_spans(sampled.trace_id, [_request_span(sampled.trace_id)])
    assert _assembly(pipeline, sampled.trace_id) == {
        "state": "incomplete",
        "missing": ["backend", "replay"],
        "why": f"backend: {TRACING_OFF}; replay: {why.attribute}",
    }
