"""The trace writer's counters on /metrics: each failure provoked for real, then scraped over
HTTP from a real prometheus_client exposition."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from sidecar.trace.metrics import WRITE_OUTCOMES, TraceWriterCollector
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.store import TraceStore
from sidecar.trace.writer import TraceWriter
from tests.harness.metrics_text import SampleKey, sample_map, scrape_registry
from tests.harness.traces.synthetic import make_trace

Samples = dict[SampleKey, float]


def scrape(registry: CollectorRegistry, *, over_http: bool = False) -> Samples:
    """The exposition of `registry` (served over real HTTP when asked), parsed."""
    text = scrape_registry(registry) if over_http else generate_latest(registry).decode()
    return sample_map(text)


def items(samples: Samples) -> dict[str, float]:
    return {
        outcome: samples[("xsp_trace_writer_items_total", (("outcome", outcome),))]
        for outcome in WRITE_OUTCOMES
    }


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_written_failed_dropped_and_callback_errors(tmp_path: Path) -> None:
    def on_error(exc: Exception) -> None:
        raise RuntimeError("the callback itself fails")

    registry = CollectorRegistry()
    writer = TraceWriter(tmp_path / "t.db", on_error=on_error)
    TraceWriterCollector(writer, registry)
    before = scrape(registry)
    assert items(before) == {"written": 0, "failed": 0, "dropped": 0}  # fixed label set
    unjsonable = make_trace(layers=1)
    unjsonable[1][0].attributes["oops"] = object()  # the store cannot encode it
    assert writer.submit(*make_trace(layers=1)) and writer.submit(*unjsonable)
    assert writer.flush(timeout=10)
    writer.close()
    assert not writer.submit(*make_trace(layers=1))  # closed: refused
    samples = scrape(registry, over_http=True)
    assert items(samples) == {"written": 1, "failed": 1, "dropped": 1}
    assert samples[("xsp_trace_writer_callback_errors_total", ())] == 1
    assert samples[("xsp_trace_retention_errors_total", ())] == 0


def test_retention_deletions_and_failures(tmp_path: Path) -> None:
    policy = RetentionPolicy(max_traces=1)
    registry = CollectorRegistry()
    kept = TraceWriter(tmp_path / "kept.db", retention=policy, retention_interval_s=0.0)
    TraceWriterCollector(kept, registry)
    for _ in range(3):
        assert kept.submit(*make_trace(layers=1))
    assert kept.flush(timeout=10)
    wait_until(lambda: kept.retention_deleted == 2)  # a pass runs after each batch
    assert scrape(registry)[("xsp_trace_retention_deleted_total", ())] == 2
    kept.close()

    path = tmp_path / "locked.db"
    TraceStore(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(
        "CREATE TRIGGER keep BEFORE DELETE ON traces BEGIN SELECT RAISE(ABORT, 'kept'); END"
    )
    conn.close()
    registry = CollectorRegistry()
    failing = TraceWriter(path, retention=policy, retention_interval_s=0.0)
    TraceWriterCollector(failing, registry)
    for _ in range(2):
        assert failing.submit(*make_trace(layers=1))
    assert failing.flush(timeout=10)
    wait_until(lambda: failing.retention_errors >= 1)
    failing.close()
    samples = scrape(registry, over_http=True)
    assert samples[("xsp_trace_retention_errors_total", ())] == failing.retention_errors >= 1
    assert samples[("xsp_trace_retention_deleted_total", ())] == 0


def test_nothing_is_exported_without_a_writer() -> None:
    registry = CollectorRegistry()
    TraceWriterCollector(None, registry)  # the store could not be opened
    assert not any(name.startswith("xsp_trace") for name, _ in scrape(registry))
