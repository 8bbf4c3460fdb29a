"""The backend's side of a sampled TF-Serving request: a short capture by TensorFlow's profiler.

TensorFlow Serving serves TensorFlow's `ProfilerService` on its gRPC port (what TensorBoard's
"capture profile" calls). When a request is sampled, `TfProfilerCapture.request` asks the
backend for a capture of `duration_ms` (host tracer only, no Python tracer) on a background
thread: never on the relay's loop, never delaying the request. One capture runs at a time;
requests sampled while it still records share it, later ones are counted as `busy`.

TensorFlow 2.19's server does not return the XSpace in the response: it writes it to
`<repository_root>/<session_id>/<host_name>.xplane.pb` on its own file system, so the
sidecar and the backend must share `repository_root` (the same path in both containers).

The capture's op events that overlap the request's window (its proxy span, once
`request_ended` gave it; else from its arrival to the end of the capture) become backend
spans (`Level.SERVER`, kind `tf_op`, named after the TensorFlow node, its name scopes in
`name_scope`) under the proxy's span. The backend and the sidecar read the same wall clock
(one host); a capture whose session times or op events fall outside the interval the sidecar
saw the call take is rejected (`clock_mismatch`) rather than misplaced. Which run is the
request's is decided by time alone: with concurrent requests, their ops overlap the window too.
Every outcome is counted in `xsp_backend_captures_total{outcome}`; failures are logged at most
once a minute per outcome and never raised to the caller.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.live._proto.tensorflow.tsl.profiler.protobuf import (
    profiler_options_pb2,
    profiler_service_pb2,
    profiler_service_pb2_grpc,
)
from sidecar.live.xspace import HostCapture, OpEvent, XSpaceError, parse_xspace
from sidecar.trace import schema
from sidecar.trace.spans import Level, Source, Span

log = logging.getLogger(__name__)

SPAN_KIND = schema.TF_OP
HOST_NAME = "xsp"  # the XSpace file's name on the server: <host_name>.xplane.pb
CLOCK_TOLERANCE_NS = 50_000_000
_LOG_INTERVAL_S = 60.0
_MAX_WINDOWS = 1024

# What became of a sampled request's capture: the label set of
# `xsp_backend_captures_total{outcome}`.
CAPTURE_OUTCOMES = (
    "ok",  # the request's op events were handed to the store
    "no_ops",  # no op event in the request's window (it ran before the profiler started)
    "busy",  # another capture was running and had stopped recording
    "unavailable",  # the profiler could not be reached
    "unimplemented",  # the backend serves no ProfilerService
    "timeout",  # the capture did not answer in time
    "unreadable",  # no readable XSpace where the sidecar looks (no shared repository root?)
    "clock_mismatch",  # the capture's times lie outside the call as the sidecar saw it
    "dropped",  # the store did not want the spans (the request was not profiled after all)
    "error",  # any other failure (the RPC, storing the spans)
)
_RPC_OUTCOMES = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.UNIMPLEMENTED: "unimplemented",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}

# (trace_id, spans) -> False if the spans were not kept (any other value: kept)
SpansCallback = Callable[[str, list[Span]], object]


@dataclass(frozen=True)
class TfProfilerSettings:
    """Where the backend's profiler listens, how long a capture lasts, the shared folder."""

    address: str
    capture_ms: int
    repository_root: Path


@dataclass(frozen=True)
class SampledRequest:
    """A request sampled at header time: its trace, its proxy span and when it arrived."""

    trace_id: str
    span_id: str  # the proxy's span: parent of the backend spans
    received_ns: int  # wall clock (Unix epoch ns)
    model: str = ""


@dataclass
class _Session:
    session_id: str
    planned_stop_ns: int
    requests: list[SampledRequest] = field(default_factory=list)
    windows: dict[str, tuple[int, int]] = field(default_factory=dict)


def select_ops(ops: Iterable[OpEvent], start_ns: int, end_ns: int) -> list[OpEvent]:
    """The op events that overlap `[start_ns, end_ns]`."""
    return [op for op in ops if op.end_ns >= start_ns and op.start_ns <= end_ns]


def clock_problem(capture: HostCapture, sent_ns: int, answered_ns: int) -> str | None:
    """Why the capture's times cannot be placed on the sidecar's clock, or None if they can.

    The session must run while the call was open (`sent_ns`..`answered_ns`), and every op event
    must lie inside the session; each within `CLOCK_TOLERANCE_NS`.
    """
    low, high = sent_ns - CLOCK_TOLERANCE_NS, answered_ns + CLOCK_TOLERANCE_NS
    start = capture.start_ns if capture.start_ns is not None else sent_ns
    stop = capture.stop_ns if capture.stop_ns is not None else answered_ns
    if not low <= start <= stop <= high:
        return (
            f"the capture ran {start}..{stop} ns, outside the call {sent_ns}..{answered_ns} ns "
            "on the sidecar's clock"
        )
    outside = [
        op
        for op in capture.ops
        if op.start_ns < start - CLOCK_TOLERANCE_NS or op.end_ns > stop + CLOCK_TOLERANCE_NS
    ]
    if outside:
        return (
            f"{len(outside)} of {len(capture.ops)} op events lie outside the capture "
            f"{start}..{stop} ns (first: {outside[0].name} at {outside[0].start_ns})"
        )
    return None


def _span_id(trace_id: str, op: OpEvent) -> str:
    key = f"{trace_id}/{op.thread}/{op.start_ns}/{op.name}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def op_spans(request: SampledRequest, ops: Iterable[OpEvent], session_id: str) -> list[Span]:
    """Backend spans of `ops` under the request's proxy span, numbered in start order."""
    spans: list[Span] = []
    for index, op in enumerate(sorted(ops, key=lambda o: (o.start_ns, o.name))):
        attributes: dict[str, object] = {
            schema.OP_TYPE: op.op_type,
            schema.NAME_SCOPE: op.name_scope,
            schema.THREAD: op.thread,
            schema.DERIVED_FROM: "tf_profiler",
            schema.CAPTURE_SESSION: session_id,
        }
        if request.model:
            attributes[schema.MODEL] = request.model
        spans.append(
            Span(
                trace_id=request.trace_id,
                span_id=_span_id(request.trace_id, op),
                parent_id=request.span_id,
                level=Level.SERVER,
                name=op.name,
                kind=SPAN_KIND,
                start_ns=op.start_ns,
                end_ns=op.end_ns,
                source=Source.BACKEND,
                index=index,
                attributes=attributes,
            )
        )
    return spans


def _ignore_state(state: grpc.ChannelConnectivity) -> None:
    """A connectivity callback that only makes the channel connect."""


class TfProfilerCapture:
    """Captures the backend's side of sampled requests through TensorFlow's ProfilerService.

    `address` is the profiler's gRPC address (`HOST:PORT` or `unix:PATH`); `repository_root`
    the folder the server writes its XSpace into and the sidecar reads it from; `on_spans`
    receives `(trace_id, spans)` for each request whose op events were found and returns False
    when it did not keep them.
    """

    def __init__(
        self,
        address: str,
        duration_ms: int = 200,
        *,
        repository_root: Path,
        on_spans: SpansCallback,
        timeout_s: float | None = None,
        host_tracer_level: int = 2,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if duration_ms <= 0:
            raise ValueError("the capture's duration must be positive")
        self.address = address
        self.duration_ms = duration_ms
        self.repository_root = Path(repository_root)
        self.on_spans = on_spans
        self.timeout_s = timeout_s if timeout_s is not None else duration_ms / 1000 + 10.0
        self.host_tracer_level = host_tracer_level
        self._clock = clock
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._thread: threading.Thread | None = None
        self._channel: grpc.Channel | None = None
        self._closed = False
        self._counts = dict.fromkeys(CAPTURE_OUTCOMES, 0)
        self._last_warning: dict[str, float] = {}

    # -- from the relay's side (any thread; never blocks) ---------------------------------
    def request(self, sampled: SampledRequest) -> None:
        """Capture around `sampled`: start a capture, join the running one, or count `busy`."""
        now = self._clock()
        with self._lock:
            if self._closed:
                return
            session = self._session
            if session is not None:
                if now < session.planned_stop_ns:
                    session.requests.append(sampled)
                    return
                busy = True
            else:
                busy = False
                session = _Session(
                    session_id=f"xsp-{uuid.uuid4().hex[:16]}",
                    planned_stop_ns=now + self.duration_ms * 1_000_000,
                    requests=[sampled],
                )
                self._session = session
                self._thread = threading.Thread(
                    target=self._run, args=(session,), name="tf-profiler-capture", daemon=True
                )
        if busy:
            self._record(
                ["busy"], "a capture was running; request %s not captured", sampled.trace_id
            )
            return
        assert self._thread is not None
        try:
            self._thread.start()
        except BaseException:  # no thread to be had: the next sample tries again
            with self._lock:
                self._session = self._thread = None
            raise

    def request_ended(self, trace_id: str, start_ns: int, end_ns: int) -> None:
        """The request's span as the proxy saw it: the window its op events are taken from."""
        with self._lock:
            session = self._session
            if session is not None and len(session.windows) < _MAX_WINDOWS:
                session.windows[trace_id] = (start_ns, end_ns)

    # -- lifecycle -----------------------------------------------------------------------
    def connect(self) -> None:
        """Start connecting to the profiler now, in the background: the first capture would
        otherwise wait for the connection, and a short request runs before it records."""
        self._stub()
        assert self._channel is not None
        self._channel.subscribe(_ignore_state, try_to_connect=True)

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new captures, wait for the running one (at most `timeout_s`)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(self.timeout_s + 1 if timeout_s is None else timeout_s)
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no capture runs (for tests and shutdown); True if idle."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def counts(self) -> dict[str, int]:
        """Sampled requests so far by outcome (every label of `CAPTURE_OUTCOMES`)."""
        with self._lock:
            return dict(self._counts)

    # -- the capture thread --------------------------------------------------------------
    def _stub(self) -> profiler_service_pb2_grpc.ProfilerServiceStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return profiler_service_pb2_grpc.ProfilerServiceStub(self._channel)

    def _profile_request(self, session_id: str) -> profiler_service_pb2.ProfileRequest:
        options = profiler_options_pb2.ProfileOptions(
            version=1,
            host_tracer_level=self.host_tracer_level,
            device_tracer_level=0,
            python_tracer_level=0,
            duration_ms=self.duration_ms,
        )
        return profiler_service_pb2.ProfileRequest(
            duration_ms=self.duration_ms,
            opts=options,
            repository_root=str(self.repository_root),
            session_id=session_id,
            host_name=HOST_NAME,
        )

    def _run(self, session: _Session) -> None:
        try:
            self._capture(session)
        except Exception as exc:  # never let the thread die silently, nor raise elsewhere
            with self._lock:
                requests = list(session.requests)
            self._record(["error"] * len(requests), "capture failed: %s", exc)
        finally:
            with self._lock:
                self._session = None
            shutil.rmtree(self.repository_root / session.session_id, ignore_errors=True)

    def _capture(self, session: _Session) -> None:
        sent = self._clock()
        try:
            self._stub().Profile(self._profile_request(session.session_id), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            outcome = _RPC_OUTCOMES.get(code, "error") if code is not None else "error"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            self._finish(session, outcome, "ProfilerService at %s: %s (%s)", (
                self.address, code.name if code is not None else "?", details,
            ))  # fmt: skip
            return
        answered = self._clock()
        try:
            capture = parse_xspace(self._read_xspace(session.session_id))
        except (OSError, XSpaceError) as exc:
            self._finish(session, "unreadable", "no XSpace of the capture under %s: %s", (
                self.repository_root, exc,
            ))  # fmt: skip
            return
        problem = clock_problem(capture, sent, answered)
        if problem is not None:
            self._finish(session, "clock_mismatch", "capture rejected: %s", (problem,))
            return
        with self._lock:
            requests = list(session.requests)
            windows = dict(session.windows)
        outcomes: list[str] = []
        for request in requests:
            start, end = windows.get(request.trace_id, (request.received_ns, answered))
            ops = select_ops(capture.ops, start, end)
            if not ops:
                outcomes.append("no_ops")
                continue
            try:
                kept = self.on_spans(request.trace_id, op_spans(request, ops, session.session_id))
            except Exception:
                log.debug("storing the capture's spans failed", exc_info=True)
                outcomes.append("error")
            else:
                outcomes.append("dropped" if kept is False else "ok")
        self._record(outcomes, "capture %s: %d op events in all", (
            session.session_id, len(capture.ops),
        ))  # fmt: skip

    def _read_xspace(self, session_id: str) -> bytes:
        folder = self.repository_root / session_id
        files = sorted(folder.glob("*.xplane.pb"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no *.xplane.pb")
        return files[0].read_bytes()

    def _finish(self, session: _Session, outcome: str, msg: str, args: tuple[object, ...]) -> None:
        with self._lock:
            count = len(session.requests)
        self._record([outcome] * count, msg, args)

    def _record(self, outcomes: list[str], msg: str, args: object) -> None:
        """Count `outcomes`; log once per minute per failing outcome (debug otherwise)."""
        now = time.monotonic()
        loud: list[str] = []
        with self._lock:
            for outcome in outcomes:
                self._counts[outcome] += 1
            for outcome in sorted(set(outcomes) - {"ok"}):
                if now - self._last_warning.get(outcome, -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S:
                    self._last_warning[outcome] = now
                    loud.append(outcome)
        values = args if isinstance(args, tuple) else (args,)
        level = logging.WARNING if loud else logging.DEBUG
        log.log(level, "TensorFlow profiler capture (%s): " + msg, ",".join(outcomes), *values)


class TfCaptureMetricsCollector(Collector):
    """Exports `xsp_backend_captures_total{outcome}` from a capture's plain counters."""

    def __init__(
        self, capture: TfProfilerCapture, registry: CollectorRegistry | None = None
    ) -> None:
        self.capture = capture
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterable[Metric]:
        counts = self.capture.counts()
        family = CounterMetricFamily(
            "xsp_backend_captures",
            "Sampled requests whose server side was captured by the backend's profiler, by outcome",
            labels=["outcome"],
        )
        for outcome in CAPTURE_OUTCOMES:
            family.add_metric([outcome], counts.get(outcome, 0))
        yield family
