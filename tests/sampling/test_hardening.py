"""Sampling state an outsider must not be able to break: bounded memory, settings that cannot
switch sampling off for good, back-off while the store fails, a worker that comes back."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from sidecar.replay.job_records import ProfileJob
from sidecar.replay.replay_job import replay_job
from sidecar.sampling.ratelog import RateLimitedLog
from sidecar.sampling.sampler import Decision, Sampler
from sidecar.sampling.settings import SamplingSettings, SamplingSettingsError
from sidecar.sampling.worker import ProfilingWorker
from sidecar.trace.errors import StoreFullError
from sidecar.trace.store import TraceStore
from tests.harness.traces.synthetic import make_trace
from tests.harness.triton.model_repo import build_model_repository
from tests.replay.test_replay_job import context, infer_request, job
from tests.sampling.test_sampler import ManualClock, decide
from tests.sampling.worker_replays import worker_config

# --- settings and the duty-cycle gate -----------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"budget_per_minute": math.nan},
        {"budget_per_minute": math.inf},
        {"rate": math.nan},
        {"model_rates": {"m": math.nan}},
        {"model_rates": {"\0": 0.5}},
        {"model_rates": {f"m{n}": 0.5 for n in range(1001)}},
        {"duty_cycle": 5e-324},
        {"duty_cycle": math.nan},
        {"duty_cycle": 1.5},
        {"force_header": "x y"},
        {"force_header": "grpc-timeout"},
        {"force_header": ""},
    ],
)
def test_settings_that_would_stop_sampling_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(SamplingSettingsError):
        SamplingSettings(**bad)  # type: ignore[arg-type]


def test_new_settings_reopen_the_duty_cycle_gate() -> None:
    clock = ManualClock()
    sampler = Sampler(
        SamplingSettings(rate=1.0, budget_per_minute=1e6, duty_cycle=0.001), clock=clock
    )
    assert decide(sampler, "m") is Decision.SAMPLED
    sampler.duty.record_busy(1.0)  # closed for 999 s at a duty cycle of 0.001
    clock.now += 1.0
    assert decide(sampler, "m") is Decision.SKIPPED_DUTY_CYCLE
    sampler.update(sampler.settings.updated(duty_cycle=0.5))
    assert decide(sampler, "m") is Decision.SAMPLED


# --- back-off while the trace store fails -------------------------------------------------


def test_sampler_backs_off_while_store_writes_fail() -> None:
    clock = ManualClock()
    sampler = Sampler(SamplingSettings(rate=1.0, budget_per_minute=1e6, duty_cycle=1), clock=clock)
    sampler.store.failed()  # closed for 1 s
    assert decide(sampler, "m", forced=True) is Decision.SKIPPED_STORE_FAILING
    clock.now += 1.0
    assert decide(sampler, "m") is Decision.SAMPLED  # one more try after the wait
    sampler.store.failed()  # failed again: closed for 2 s
    sampler.store.failed()  # a sample taken before the wait failed too: no longer wait
    clock.now += 1.5
    assert decide(sampler, "m") is Decision.SKIPPED_STORE_FAILING
    clock.now += 0.5
    assert decide(sampler, "m") is Decision.SAMPLED
    sampler.store.failed()  # closed for 4 s
    clock.now += 3.9
    assert sampler.store.failing and sampler.store.closed()
    sampler.store.succeeded()  # a write worked: open at once
    assert decide(sampler, "m") is Decision.SAMPLED
    assert not sampler.store.failing


def test_rate_limited_log_counts_what_it_holds_back(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    limited = RateLimitedLog(logging.getLogger("xsp.test"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="xsp.test"):
        for _ in range(1000):
            limited.log("full", logging.WARNING, "store full: %s", "no space")
            clock.now += 0.0625  # 62.5 s in all, a line at 0, 10, ..., 60 s
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 7
    assert messages[0] == "store full: no space"
    assert messages[1] == (
        "store full: no space (159 more like this suppressed since the last report)"
    )


# --- the replay with a full store ---------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_repository(tmp_path_factory.mktemp("repo") / "models")


def full_store(path: Path) -> TraceStore:
    """A real SQLite store that is full: its page limit is its current size, and earlier
    traces filled its pages (SQLite itself answers SQLITE_FULL)."""
    store = TraceStore(path)
    pages = store.db.conn.execute("PRAGMA page_count").fetchone()[0]
    store.db.conn.execute(f"PRAGMA max_page_count = {pages + 4}")
    size = 64 * 1024
    while size >= 8:
        trace, spans, _ = make_trace(layers=1, kernels_per_layer=0)
        trace.attributes["filler"] = "x" * size
        try:
            store.write_trace(trace, spans[:1])
        except StoreFullError:
            size //= 2
    return store


def test_replay_into_a_full_store_is_an_outcome_not_an_exception(
    repo: Path, tmp_path: Path
) -> None:
    ctx = context(repo, tmp_path / "t.db", open_store=full_store)
    x = np.ones((1, 3, 32, 32), np.float32)
    result = replay_job(job("simple_cnn", infer_request("simple_cnn", x)), ctx)
    assert result.outcome == "store_error"
    assert "full" in result.error
    failed = replay_job(job("no_such_model", b""), ctx)  # the error trace cannot be stored
    assert failed.outcome in ("store_error", "error")


# --- the worker comes back by itself ------------------------------------------------------


def test_a_killed_idle_worker_is_restarted_without_waiting_for_a_job() -> None:
    restarts: list[str] = []
    worker = ProfilingWorker(
        worker_config("echo_pid", liveness_interval_s=0.1),
        on_result=lambda result: None,
        on_restart=restarts.append,
    )
    worker.start()
    try:
        first = wait_for_pid(worker, None)
        os.kill(first, signal.SIGKILL)
        second = wait_for_pid(worker, first)
        assert second != first
        assert restarts == ["exited while idle"]
        assert worker.submit(probe())  # and it works
    finally:
        worker.stop()


def test_a_worker_that_keeps_dying_is_restarted_after_a_growing_pause() -> None:
    restarts: list[str] = []
    worker = ProfilingWorker(
        worker_config("echo_pid", liveness_interval_s=0.05),
        on_result=lambda result: None,
        on_restart=restarts.append,
    )
    worker.start()
    try:
        pid = wait_for_pid(worker, None)
        for _ in range(3):
            os.kill(pid, signal.SIGKILL)
            pid = wait_for_pid(worker, pid)
        # each death within min_uptime_s doubled the pause: 1 s, 2 s, 4 s
        assert worker._backoff == 4.0
    finally:
        worker.stop()


def wait_for_pid(worker: ProfilingWorker, old: int | None, timeout: float = 60.0) -> int:
    """The pid of a live worker process other than `old` (polls; no job is submitted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process = worker._process
        if process is not None and process.pid != old and process.is_alive():
            assert process.pid is not None
            return int(process.pid)
        time.sleep(0.05)
    raise AssertionError(f"no new worker process within {timeout} s")


def probe() -> ProfileJob:
    return ProfileJob("0" * 32, "0" * 16, "m", "ModelInfer", b"", "forced", 0)
