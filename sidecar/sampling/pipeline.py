"""Everything sampling needs beside the relay, started and stopped as one unit.

sampler + relay hook -> bounded queue -> profiling worker (own process) -> SQLite;
the proxy's request spans and the backend's OTLP spans go to the same traces through a
background writer. Failures here are logged and counted, never raised into the relay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.admin.service import LastRequests
from sidecar.live.otlp_receiver import OtlpReceiver
from sidecar.live.triton_spans import TritonSpanCollector, TritonTrace
from sidecar.sampling.jobs import ProfileResult
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings
from sidecar.sampling.worker import ProfilingWorker, WorkerConfig
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.spans import Span
from sidecar.trace.store import TraceStore
from sidecar.trace.writer import TraceWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingConfig:
    """What the pipeline needs; built by `serve` from its frozen config."""

    settings: SamplingSettings
    db_path: Path
    model_repository: Path | None = None
    otlp_host: str = "127.0.0.1"
    otlp_port: int | None = 4318  # None: no receiver
    levels: str = "M,L"
    iterations: int = 10
    warmup: int = 2
    queue_size: int = 8
    profile_timeout_s: float = 120.0
    store_raw_inputs: bool = False
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    worker_threads: int = 1
    replay: str = "sidecar.sampling.replay:replay_job"


class SamplingPipeline:
    """Owns the sampler, the worker, the trace writer and the OTLP receiver."""

    def __init__(
        self,
        config: SamplingConfig,
        registry: CollectorRegistry,
        model_label: Callable[[str | None], str],
    ) -> None:
        self.config = config
        self.metrics = SamplingMetrics(registry)
        self.sampler = Sampler(config.settings)
        self.last_requests = LastRequests()
        self._model_label = model_label
        # Open the store once here so a bad path is a clear error at start-up.
        TraceStore(config.db_path).close()
        self.writer = TraceWriter(
            config.db_path, retention=config.retention, on_error=self._store_failed
        )
        self.worker = ProfilingWorker(
            WorkerConfig(
                replay=config.replay,
                options={
                    "model_repository": str(config.model_repository or ""),
                    "db_path": str(config.db_path),
                    "levels": config.levels,
                    "iterations": config.iterations,
                    "warmup": config.warmup,
                    "store_raw_inputs": config.store_raw_inputs,
                },
                queue_size=config.queue_size,
                job_timeout_s=config.profile_timeout_s,
                threads=config.worker_threads,
            ),
            on_result=self._on_result,
            on_restart=lambda reason: self.metrics.worker_restarts.inc(),
        )
        self.metrics.bind_queue_depth(self.worker.queue_depth)
        self.hub = SamplingHub(
            self.sampler,
            self.metrics,
            self.worker.submit,
            self._store_spans,
            model_label,
            remember=self.last_requests.remember,
        )
        self.collector = TritonSpanCollector(self._on_backend_trace)
        self.receiver: OtlpReceiver | None = None
        if config.otlp_port is not None:
            self.receiver = OtlpReceiver(
                self.collector.add, host=config.otlp_host, port=config.otlp_port
            )

    def start(self) -> None:
        if self.receiver is not None:
            self.receiver.start()
            log.info("OTLP receiver for backend spans on %s", self.receiver.url)
        self.worker.start()

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
        self.collector.flush(everything=True)
        self.worker.stop()
        self.writer.close()

    # -- callbacks (other threads) ---------------------------------------------------------
    def _store_spans(self, trace_id: str, spans: list[Span]) -> bool:
        accepted = self.writer.submit_spans(trace_id, spans)
        if not accepted:
            self.metrics.store_write_failures.inc()
        return accepted

    def _store_failed(self, error: Exception) -> None:
        self.metrics.store_write_failures.inc()

    def _on_result(self, result: ProfileResult) -> None:
        self.sampler.duty.record_busy(result.busy_s)
        self.metrics.record_result(result)
        if result.outcome != "ok":
            log.warning("profile of %s: %s (%s)", result.model, result.outcome, result.error)

    def _on_backend_trace(self, trace: TritonTrace) -> None:
        # Only traces the relay sampled; anything else the backend sends is not ours.
        if not self.hub.is_sampled_trace(trace.trace_id):
            return
        self._store_spans(trace.trace_id, trace.spans)
        model = self._model_label(trace.model)
        phases: dict[str, float] = {}
        for phase in trace.phases:
            phases[phase.phase] = phases.get(phase.phase, 0.0) + phase.seconds
        self.metrics.record_phases(model, phases)
