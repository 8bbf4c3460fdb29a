"""Everything sampling needs beside the relay, started and stopped as one unit.

sampler + relay hook -> bounded queue -> profiling worker (own process) -> SQLite; the hook's
request counters (`ServingPressure`) tell the worker when serving leaves it room;
the proxy's request spans, the backend's spans and the worker's results go to the trace
assembler (`trace.assembly`), which owns each sampled trace from its first part to its last
(what it expects is told when the job is queued) and writes through a background writer.
With `otlp_export` set, every part the store commits is also exported to the fleet's tracing
backend over OTLP. Failures here are logged and counted, never raised into the relay.

A sample of a model no replay can run (`backends.replayability`, from the model's
configuration in the repository) takes no worker time: the pipeline stores its live-only trace
row (`status=live_only`, `replay` = `not_replayable: <reason>`) and counts it in
`xsp_profiles_total{outcome="live_only"}`; its live spans join it as any sample's do.

A trace store that cannot be opened at start-up switches sampling off (`disabled_reason`)
instead of stopping the sidecar: the relay forwards as without sampling, and the reason is on
/metrics, the `xsp.sampling` health service and in the log. Store writes that fail at run
time make the sampler back off until a write succeeds again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar import __version__
from sidecar.backends import backend_named
from sidecar.backends.base import SpanSource
from sidecar.backends.model_repository import model_in_repository, python_models
from sidecar.backends.replayability import Replayability, ReplayabilityCache
from sidecar.live.otlp_metrics import OtlpMetricsCollector
from sidecar.live.otlp_receiver import OtlpReceiver
from sidecar.live.tf_profiler import (
    SampledRequest,
    TfCaptureMetricsCollector,
    TfProfilerCapture,
    TfProfilerSettings,
)
from sidecar.live.triton_spans import TritonSpanCollector, TritonTrace
from sidecar.proxy.streams import ConnectionInfo, ConnectionObserver, RequestStart
from sidecar.replay.job_records import JobResult, Outcome, ProfileJob
from sidecar.replay.options import ReplayOptions
from sidecar.sampling.batch_windows import ATTRIBUTE as WINDOW_ATTRIBUTE
from sidecar.sampling.batch_windows import BatchWindows
from sidecar.sampling.last_requests import LastRequests
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.pressure import ServingPressure
from sidecar.sampling.ratelog import RateLimitedLog
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings
from sidecar.sampling.stream_sampling import sequence_model
from sidecar.sampling.worker import ProfilingWorker, WorkerConfig
from sidecar.trace import schema
from sidecar.trace.assembly import TRACING_OFF, Part, TraceAssembler, parts_expected
from sidecar.trace.errors import TraceStoreError
from sidecar.trace.metrics import TraceWriterCollector
from sidecar.trace.otlp_export import OtlpExportCollector, OtlpTraceExport
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.spans import LIVE_ONLY, Level, Source, Span, Trace
from sidecar.trace.writer import TraceWriter

__all__ = ["SamplingConfig", "SamplingPipeline", "TfProfilerSettings"]

log = logging.getLogger(__name__)

BACKEND_SPANS_TIMEOUT_S = 30.0  # the span collector's `max_age_s`
NOT_TRACED = "the request carried no traceparent (a stream's message or a slow sample)"


@dataclass(frozen=True)
class SamplingConfig:
    """What the pipeline needs; built by `serve` from its frozen config (no defaults here)."""

    settings: SamplingSettings
    replay_options: ReplayOptions  # passed unchanged to the worker and the replay
    otlp_host: str
    otlp_port: int | None  # None: no receiver
    queue_size: int
    profile_timeout_s: float
    retention: RetentionPolicy
    tf_profiler: TfProfilerSettings | None = None  # None: no capture of the backend's side
    otlp_export: str = ""  # OTLP endpoint every stored trace is also exported to; "" = off
    otlp_export_protocol: str = "auto"
    # the backend's gRPC target and protocol, for the batches it executed around each sampled
    # request (None: not read)
    backend_target: str | None = None
    backend_protocol: str = "triton"
    # how long a sampled trace waits for its parts (None: as long as a queued job can take,
    # `profile_timeout_s` for each job ahead of it and its own, plus the backend's span timeout)
    assembly_timeout_s: float | None = None

    @property
    def db_path(self) -> Path:
        return self.replay_options.db_path

    @property
    def model_repository(self) -> Path:
        return self.replay_options.model_repository

    @property
    def trace_timeout_s(self) -> float:
        """How long a sampled trace waits for its parts (`assembly_timeout_s`)."""
        if self.assembly_timeout_s is not None:
            return self.assembly_timeout_s
        return self.profile_timeout_s * (self.queue_size + 1) + BACKEND_SPANS_TIMEOUT_S


class SamplingPipeline:
    """Owns the sampler, the worker, the trace writer and the OTLP receiver; the relay's hub
    hands it what it samples (it is the hub's `SampleHandler`)."""

    def __init__(
        self,
        config: SamplingConfig,
        registry: CollectorRegistry,
        model_label: Callable[[str | None], str],
        record_exemplar: Callable[[str, str, float, str], object] | None = None,
    ) -> None:
        self.config = config
        self.metrics = SamplingMetrics(registry)
        self.sampler = Sampler(config.settings)
        self._model_label = model_label
        self._record_exemplar = record_exemplar
        self.last_requests = LastRequests(self.known_model)
        self._log = RateLimitedLog(log, interval_s=30.0)
        self.disabled_reason: str | None = None
        self.export: OtlpTraceExport | None = None
        if config.otlp_export:
            self.export = OtlpTraceExport.to(config.otlp_export, config.otlp_export_protocol)
        self.writer: TraceWriter | None = None
        self.assembler: TraceAssembler | None = None
        try:
            self.writer = TraceWriter(
                config.db_path,
                retention=config.retention,
                on_error=self._store_failed,
                on_written=lambda n: self._store_ok(),
            )
            self.assembler = TraceAssembler(
                self.writer, timeout_s=config.trace_timeout_s, export=self.export
            )
        except (TraceStoreError, OSError) as exc:
            self.disabled_reason = f"the trace store cannot be used: {exc}"
            log.error("sampling is off (requests are still relayed): %s", exc)
        self.pressure = ServingPressure()  # the relay's request counters, read by the worker
        self.worker = ProfilingWorker(
            WorkerConfig(
                options=config.replay_options,
                queue_size=config.queue_size,
                job_timeout_s=config.profile_timeout_s,
            ),
            on_result=self._on_result,
            on_restart=lambda reason: self.metrics.worker_restarts.inc(),
            skip=self._skip_job,
            pressure=self.pressure,
        )
        self.metrics.bind_queue_depth(self.worker.queue_depth)
        self.metrics.bind_state(self.state, lambda: self.last_requests.total_bytes)
        self.tf_capture: TfProfilerCapture | None = None
        if config.tf_profiler is not None and self.enabled:
            self.tf_capture = TfProfilerCapture(
                config.tf_profiler.address,
                config.tf_profiler.capture_ms,
                repository_root=config.tf_profiler.repository_root,
                on_spans=self._on_backend_spans,
            )
            TfCaptureMetricsCollector(self.tf_capture, registry)
        backend = backend_named(config.backend_protocol)
        self.hub = SamplingHub(self.sampler, self.metrics, self, self.pressure, backend)
        # the method label whose sampled calls get a capture of the backend's side, over gRPC or
        # HTTP (None: no capture), and the job methods of those calls
        self._capture_method: str | None = None
        self._capture_jobs: frozenset[str] = frozenset()
        if backend.capture_path is not None:
            self._capture_method = backend.capture_path.rsplit("/", 1)[-1]
            self._capture_jobs = frozenset(
                jobs[self._capture_method]
                for jobs in (backend.replayable, backend.http_replayable)
                if self._capture_method in jobs
            )
        find = python_models(backend.repository.find, config.replay_options.python_models)
        self._replayability = ReplayabilityCache(find, config.model_repository)
        self.batch_windows: BatchWindows | None = None
        self._backend = backend
        reader = backend.statistics
        if config.backend_target is not None and reader is not None and self.enabled:
            self.batch_windows = BatchWindows(config.backend_target, reader)
        self.collector = TritonSpanCollector(self._on_backend_trace)
        self.receiver: OtlpReceiver | None = None
        if config.otlp_port is not None and self.enabled:
            self.receiver = OtlpReceiver(
                self.collector.add, host=config.otlp_host, port=config.otlp_port
            )
        OtlpMetricsCollector(self.receiver, self.collector, registry)
        TraceWriterCollector(self.writer, registry)
        OtlpExportCollector(self.export, registry)

    @property
    def enabled(self) -> bool:
        """False when sampling is off for good (the store could not be opened)."""
        return self.disabled_reason is None

    def state(self) -> str | None:
        """Why no live request can become a profile now (a `DISABLED_REASONS` value), or
        None while sampling works."""
        if self.disabled_reason is not None:
            return "store_unavailable"
        if self.sampler.store.closed():
            return "store_failing"
        if not self.sampler.settings.enabled:
            return "settings"
        return None

    def serving(self) -> bool:
        """For the `xsp.sampling` health service: sampling is on and its store works."""
        return self.enabled and not self.sampler.store.failing

    def start(self) -> None:
        if not self.enabled:
            return
        if self.receiver is not None:
            self.collector.start()  # expires unfinished backend traces by time
            self.receiver.start()
            log.info("OTLP receiver for backend spans on %s", self.receiver.url)
        if self.tf_capture is not None:
            self.tf_capture.connect()
        if self.assembler is not None:
            self.assembler.start()  # finishes what a previous run left overdue
        self.worker.start()
        threading.Thread(
            target=self._replayability.warm, name="xsp-replayability", daemon=True
        ).start()

    def stop(self) -> None:
        self.hub.held.stop()
        if self.receiver is not None:
            self.receiver.stop()
        self.collector.close()  # stops its sweeper, emits what is pending
        if self.tf_capture is not None:
            self.tf_capture.close(timeout_s=5.0)  # a running capture may still store its spans
        if self.batch_windows is not None:
            self.batch_windows.stop()  # windows being closed still store their request spans
        self.worker.stop()
        if self.assembler is not None:
            self.assembler.close()  # and the writer
        if self.export is not None:
            self.export.close()

    # -- the hub's `SampleHandler` (the relay's threads) -------------------------------------
    def model_label(self, model: str | None) -> str:
        return self._model_label(model)

    def known_model(self, model: str) -> bool:
        return model_in_repository(self.config.model_repository, model)

    def sequence_model(self, model: str) -> bool:
        return sequence_model(self.config.model_repository, model)

    def replayability(self, model: str) -> Replayability:
        return self._replayability.of(model)

    def keep_live(self, job: ProfileJob, why: Replayability) -> bool:
        """The live-only trace row of a sample no replay can run, to the writer; counted as a
        profile with outcome `live_only`."""
        trace = Trace(
            trace_id=job.trace_id,
            model=job.model,
            created_ns=time.time_ns(),
            sample_reason=job.reason,
            sidecar_version=__version__,
            status=LIVE_ONLY,
            attributes={
                schema.REPLAY: why.attribute,
                schema.METHOD: job.method,
                schema.REQUEST_SPAN_ID: job.parent_span_id,
                schema.RECEIVED_NS: job.received_ns,
            },
        )
        expected, absent = parts_expected(
            live=True, no_backend=self._no_backend_spans(job), no_replay=why.attribute
        )
        if (
            self.assembler is None
            or not self.assembler.expect(job.trace_id, expected, absent)
            or not self.assembler.add_trace(trace)
        ):
            self.metrics.store_write_failures.inc()
            return False
        self.metrics.profiles.labels(self._model_label(job.model), LIVE_ONLY).inc()
        return True

    def submit(self, job: ProfileJob) -> bool:
        """Queue a job for the worker (the hub's samples and the admin API's); a queued job is
        counted by its reason."""
        if not self.worker.submit(job):
            return False
        if self.assembler is not None:
            expected, absent = parts_expected(
                live=job.reason != "admin",  # the admin API replays a remembered request
                no_backend=self._no_backend_spans(job),
            )
            self.assembler.expect(job.trace_id, expected, absent)
        self.metrics.sampled.labels(self._model_label(job.model), job.reason).inc()
        return True

    def remember(self, model: str, method: str, message: bytes) -> None:
        self.last_requests.remember(model, method, message)

    def record_exemplar(self, method: str, model: str, duration_s: float, trace_id: str) -> None:
        if self._record_exemplar is not None:
            self._record_exemplar(method, model, duration_s, trace_id)

    def http_observer_factory(self, info: ConnectionInfo) -> ConnectionObserver:
        """The HTTP relay's hook of one connection (`SamplingHub.http_observer_factory`)."""
        return self.hub.http_observer_factory(info)

    def on_sampled(self, start: RequestStart, trace_id: str, span_id: str) -> None:
        """A request picked at header time: its batch window opens (a backend that counts
        its batches); a call of the backend's capture path's method (TF-Serving's Predict,
        over gRPC or REST) gets a capture of the backend's side."""
        if self.batch_windows is not None:
            self.batch_windows.open(trace_id)
        if self.tf_capture is None or start.method != self._capture_method:
            return
        try:
            self.tf_capture.request(SampledRequest(trace_id, span_id, time.time_ns()))
        except Exception:  # e.g. no thread could be started: the request goes on regardless
            self._log.log("tf_capture", logging.WARNING, "could not start a capture", exc_info=True)

    def store_spans(self, trace_id: str, spans: list[Span]) -> bool:
        request = next(
            (s for s in spans if s.level is Level.REQUEST and s.source is Source.PROXY), None
        )
        if request is not None and self.tf_capture is not None:
            # the proxy's span: the window of the backend's op events
            self.tf_capture.request_ended(trace_id, request.start_ns, request.end_ns)
        if request is not None and self.batch_windows is not None:
            model = str(request.attributes.get(schema.MODEL) or "")
            answered = request.attributes.get(schema.RELAY_RESPONSE_START_NS, request.end_ns)

            def with_window(found: dict[str, object]) -> None:
                request.attributes[WINDOW_ATTRIBUTE] = found
                self._write_spans(trace_id, spans)

            if self.batch_windows.close(
                trace_id, model, int(answered), with_window, started_ns=request.start_ns
            ):
                return True  # written when the window's second read is done
        return self._write_spans(trace_id, spans)

    def _no_backend_spans(self, job: ProfileJob) -> str | None:
        """Why the backend's own spans of a sampled call will not come, or None when they
        may: it carried the trace's traceparent, and they are sent to the OTLP receiver or
        captured on its path."""
        if not job.traced:
            return NOT_TRACED
        if self._backend.spans is SpanSource.OTLP:
            return None if self.receiver is not None else TRACING_OFF
        captured = self.tf_capture is not None and job.method in self._capture_jobs
        return None if captured else TRACING_OFF

    def _write_spans(self, trace_id: str, spans: list[Span]) -> bool:
        accepted = self.assembler is not None and self.assembler.add_spans(trace_id, spans)
        if not accepted:
            self.metrics.store_write_failures.inc()
        return accepted

    # -- callbacks of the worker, the writer and the receivers (other threads) -------------
    def _skip_job(self, job: ProfileJob) -> bool:
        """Drop queued live samples while the store fails (admin requests still run)."""
        if job.reason == "admin" or not self.sampler.store.closed():
            return False
        self.hub.drop(self._model_label(job.model), "store_failing")
        if self.assembler is not None:
            self.assembler.refused(job.trace_id, Part.REPLAY, "dropped: the store was failing")
        return True

    def _store_failed(self, error: Exception) -> None:
        self.metrics.store_write_failures.inc()
        if not self.sampler.store.failing:
            log.warning("trace store writes fail; sampling backs off until they work: %s", error)
        self.sampler.store.failed()

    def _store_ok(self) -> None:
        if self.sampler.store.failing:
            log.info("trace store writes work again; sampling resumes")
        self.sampler.store.succeeded()

    def _on_result(self, result: JobResult) -> None:
        self.sampler.duty.record_busy(result.busy_s)
        label = self._model_label(result.model)
        self.metrics.record_result(result, label)
        if result.outcome is Outcome.STORE_ERROR:
            self._store_failed(TraceStoreError(result.error))
        elif result.outcome is Outcome.OK:
            self._store_ok()
        if self.assembler is not None:
            self.assembler.replay_done(result.trace_id, result.outcome, result.error)
        if result.outcome is not Outcome.OK:
            self._log.log(
                f"profile:{result.outcome}",
                logging.WARNING,
                "profile of %r: %s (%s)",
                result.model[:256],
                result.outcome,
                result.error[:1000],
            )

    def _on_backend_spans(self, trace_id: str, spans: list[Span]) -> bool:
        """Store the backend's spans of a trace the relay sampled (anything else is not ours:
        a request picked at header time may still be dropped before it is profiled)."""
        if not self.hub.is_sampled_trace(trace_id):
            return False
        self.store_spans(trace_id, spans)
        return True

    def _on_backend_trace(self, trace: TritonTrace) -> None:
        if not self._on_backend_spans(trace.trace_id, trace.spans):
            return
        model = self._model_label(trace.model)
        phases: dict[str, float] = {}
        for phase in trace.phases:
            phases[phase.phase] = phases.get(phase.phase, 0.0) + phase.seconds
        self.metrics.record_phases(model, phases)
