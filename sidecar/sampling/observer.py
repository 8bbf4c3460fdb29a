"""The relay's sampling hook: decide per request, mark sampled ones, hand copies to the worker.

For every request the relay calls `on_request_headers` (before forwarding the headers) and
`on_stream_end`, except where the hook answers the headers with a `QuietEnd` (a request not
picked while `sample_slow` is off; a method never replayed): the relay then counts that end
itself where the hook says (the pressure's end count, `skipped_rate`), with no call into the
hook. With `sample_slow` off the relay's C frame walk also answers such a request itself once
its header block is cached (`quick`, a `streams.QuickDecisions` of this hook's own counter, coin
and `QuietEnd`s): most requests then never reach the hook at all. Only for tentatively sampled
requests does it collect the body and call `on_request_body`. A sampled request gets a W3C
`traceparent` so the backend's own spans (Triton's OpenTelemetry trace) join the same trace,
under the proxy's span. Each request's start and end also bump the relay's request counters
(`ServingPressure`), the profiling worker's view of how busy serving is.

With `sample_slow` on, a request the header-time step did not pick is still asked for its body
(up to the same capture limit), held until its stream ends: if its response was slower than the
threshold (`slow.SlowDetector`), the held body becomes a job with reason `slow` under the same
budget and duty-cycle gates; otherwise it is dropped. Decided after the fact, such a request
carried no `traceparent`: its trace has the relay's request span but none of the backend's.

A forced or slow sample that meets a closed duty-cycle gate is held until the gate opens
(`held.HeldSamples`) instead of being turned away. A sample whose model no replay can run
(`backends.replayability`) queues no job: its trace keeps its live side (`take`).

An inference stream (a backend's `inference_streams`, e.g. Triton's `ModelStreamInfer`) is not
decided on as one call: each of its request messages is, by `stream_sampling.StreamSampling`.

The HTTP relay's connections get their hooks from `http_observer_factory`: `HttpSamplingObserver`
on the hub's `HttpPlane`, the same sampler, metrics, pressure, hold and slow detector deciding
on the backend's `http_replayable` calls (each one request, so each judged by `sample_slow`),
answering with `quick` as the gRPC hook does (the HTTP relay makes the same decision in Python,
`proxy/http/calls.py`). A sampled HTTP request's job message is its body packed with what its
decoder needs (`backends.http_message.pack`: the JSON length Triton's `Inference-Header-Content-
Length` gives, the request target, the `Content-Encoding`), read from its headers at header
time; its request span says `protocol: http` and names its route (the path, no query).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from operator import itemgetter

from sidecar.backends import TRITON, Backend
from sidecar.backends.http_message import HttpMessageError, pack, target_path
from sidecar.proxy.streams import (
    ConnectionInfo,
    HeaderDecision,
    QuickDecisions,
    QuietEnd,
    RequestStart,
    StreamEnd,
)
from sidecar.sampling.handler import SampleHandler
from sidecar.sampling.held import Held, HeldSamples
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.pressure import ServingPressure
from sidecar.sampling.sampled_request import HTTP, RelayedRequest, Sample, store_request_span
from sidecar.sampling.sampler import Decision, Sampler, Tentative
from sidecar.sampling.slow import SlowDetector
from sidecar.sampling.stream_sampling import StreamSampling
from sidecar.sampling.take import Taken, take
from sidecar.trace import schema
from sidecar.trace.spans import new_span_id, new_trace_id

log = logging.getLogger(__name__)

MAX_SAMPLED_BODY = 64 << 20
# What a request held for `sample_slow` asks of the relay: its body, no header.
_HOLD_FOR_SLOW = HeaderDecision(capture_body=True, capture_limit=MAX_SAMPLED_BODY)
# Job reasons (the trace's `sample_reason`) of what the hook samples.
_REASONS = {Tentative.RATE: "rate", Tentative.FORCED: "forced", Tentative.SLOW: "slow"}
# Model names whose label the hub keeps (names read from requests are unbounded; past this
# many the rest are looked up each time).
_CACHED_MODELS = 1024
_NAME = itemgetter(0)  # a raw header field's name


@dataclass(slots=True)
class _Pending:
    trace_id: str
    span_id: str
    tentative: Tentative
    method: str = "ModelInfer"  # the job's method
    decision: Decision | None = None
    queued: Taken = False  # where its request span goes at its end (`take.Taken`)
    body: bytes | None = None  # held for `sample_slow` until the stream ends
    http: _HttpHeaders | None = None  # an HTTP request's: what packing its body needs


@dataclass(frozen=True, slots=True)
class _HttpHeaders:
    """What an HTTP request's headers say of its body (`http_message.pack`)."""

    target: str
    json_length: int | None  # Inference-Header-Content-Length (None: all JSON; -1: unreadable)
    encoding: str  # Content-Encoding


_JSON_LENGTH = b"inference-header-content-length"
_CONTENT_ENCODING = b"content-encoding"


def http_headers(start: RequestStart) -> _HttpHeaders:
    """An HTTP request's header fields its body's packing needs."""
    json_length: int | None = None
    encoding = ""
    for name, value in start.raw_headers:
        if name == _JSON_LENGTH:
            try:
                json_length = int(value)
            except ValueError:
                json_length = -1  # refused by `pack`: the sample is dropped as unreadable
        elif name == _CONTENT_ENCODING:
            encoding = value.decode("latin-1")
    return _HttpHeaders(start.path, json_length, encoding)


def first_message(body: bytes) -> bytes | None:
    """The first gRPC message of a request body (None if compressed or truncated)."""
    if len(body) < 5 or body[0] != 0:
        return None
    length = int.from_bytes(body[1:5], "big")
    if len(body) < 5 + length:
        return None
    return body[5 : 5 + length]


def relay_marks(end: StreamEnd) -> dict[str, int]:
    """The relay's own timestamps of a call (request span attributes, docs/contracts.md), on
    the span's clock: Unix epoch ns, the request's headers read at `start_ns` and every later
    mark that many monotonic ns after it. A mark the call never reached is left out."""
    start = end.start_ns
    marks = {schema.RELAY_REQUEST_START_NS: start}
    if end.request_end_s is not None:
        marks[schema.RELAY_REQUEST_END_NS] = start + int(end.request_end_s * 1e9)
    if end.response_start_s is not None:
        marks[schema.RELAY_RESPONSE_START_NS] = start + int(end.response_start_s * 1e9)
    marks[schema.RELAY_RESPONSE_END_NS] = start + int(end.duration_s * 1e9)
    return marks


class SamplingHub:
    """Shared sampling state of the relay; `observer_factory` gives each connection a hook.

    The hook decides with `sampler`, counts in `metrics` and `pressure`, and hands what it
    samples to `handler` (`SampleHandler`). It samples the replayable methods of `backend`,
    the one the sidecar relays to (Triton's, the default --backend-protocol, unless given),
    and no other method.
    """

    def __init__(
        self,
        sampler: Sampler,
        metrics: SamplingMetrics,
        handler: SampleHandler,
        pressure: ServingPressure | None = None,
        backend: Backend = TRITON,
    ) -> None:
        self.sampler = sampler
        self.pressure = pressure or ServingPressure()
        self.metrics = metrics
        self.handler = handler
        self.sampled_trace_ids: set[str] = set()
        self._lock = threading.Lock()
        self._backend = backend
        self.held = HeldSamples(self)  # forced and slow samples waiting for the duty cycle
        self.slow = SlowDetector.of(sampler.settings.slow)  # None: `sample_slow` is off
        # short method name of a replayable call -> the job's method
        self.replayable: dict[str, str] = dict(backend.replayable)
        # methods whose every request message is one inference: sampled message by message
        self.per_message = frozenset(
            info.name for info in backend.by_path.values()
            if info.per_message and info.name in self.replayable
        )  # fmt: skip
        # methods decided on as one call, at their headers and their stream's end
        self.per_call = frozenset(self.replayable) - self.per_message
        # methods `sample_slow` judges: those replayed as themselves, i.e. unary calls, whose
        # duration is one response's (a stream's is its whole life, however fast each came)
        self.slow_methods = frozenset(m for m, job in self.replayable.items() if m == job)
        # per model name read from requests (bounded: past `_CACHED_MODELS` names, uncached)
        self._labels: dict[str | None, str] = {}
        # What the relay counts itself at the end of a request the hook wants nothing more of
        # (no `on_stream_end` call): an unpicked one (the pressure's end and one `skipped_rate`
        # under the model's label, which the relay bounds as `handler.model_label` does), or
        # one of a method never replayed (the pressure's end only).
        self.quiet_unpicked = QuietEnd(self.pressure.counts, 1, metrics.decisions.skipped)
        self.quiet_not_replayable = QuietEnd(self.pressure.counts, 1)
        # What the relay may decide itself (where it has the request's headers cached): the
        # hook's own answers above, for an unpicked request or a method never replayed. Only
        # with `sample_slow` off (else an unpicked request may be held for its duration).
        self.quick = QuickDecisions(
            sampler, self.per_call, frozenset(self.replayable), self.pressure.counts,
            self.quiet_unpicked, self.quiet_not_replayable,
        )  # fmt: skip

    def observer_factory(self, info: ConnectionInfo) -> SamplingObserver:
        return SamplingObserver(self)

    @functools.cached_property
    def http(self) -> HttpPlane:
        """The hub as the HTTP relay's hooks see it (made on first use)."""
        return HttpPlane(self, self._backend)

    def http_observer_factory(self, info: ConnectionInfo) -> HttpSamplingObserver:
        """The hook of one HTTP relay connection (`proxy.streams` protocol, with `quick`)."""
        return HttpSamplingObserver(self.http)

    def is_sampled_trace(self, trace_id: str) -> bool:
        with self._lock:
            return trace_id in self.sampled_trace_ids

    def forget_trace(self, trace_id: str) -> None:
        with self._lock:
            self.sampled_trace_ids.discard(trace_id)

    def drop(self, label: str, reason: str) -> None:
        """A sample taken at body time is dropped before it runs: its share of the duty cycle
        is given back, and it is counted by `reason`."""
        self.sampler.duty.cancel()
        self.metrics.dropped.labels(label, reason).inc()

    def drop_held(self, label: str, reason: str) -> None:
        """`drop` for a held sample (it never started the gate)."""
        self.sampler.drop_held()
        self.metrics.dropped.labels(label, reason).inc()

    def give_back(self, held: bool) -> None:
        """A sample taken (started or `held`) that will not run, and is no drop: a live-only
        one."""
        if held:
            self.sampler.drop_held()
        else:
            self.sampler.duty.cancel()

    def label(self, model: str | None) -> str:
        """`handler.model_label(model)`, kept per model name (a name's label never changes:
        the proxy's cap only ever adds names)."""
        label = self._labels.get(model)
        if label is None:
            label = self.handler.model_label(model)
            if len(self._labels) < _CACHED_MODELS:
                self._labels[model] = label
        return label

    def mark_sampled(self, trace_id: str) -> None:
        with self._lock:
            if len(self.sampled_trace_ids) > 10_000:  # bounded: drop the oldest guesses
                self.sampled_trace_ids.clear()
            self.sampled_trace_ids.add(trace_id)


class SamplingObserver:
    """Per-connection hook (see module docstring)."""

    __slots__ = ("_hub", "_pending", "quick")

    def __init__(self, hub: SamplingHub) -> None:
        self._hub = hub
        self._pending: dict[int, _Pending] = {}
        # what the relay may answer for this hook (`streams.QuickDecisions`)
        self.quick = hub.quick if hub.slow is None else None

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | QuietEnd | None:
        hub = self._hub
        hub.pressure.counts[0] += 1  # `ServingPressure.request_started`, inline
        method = start.method
        if method not in hub.replayable:
            return hub.quiet_not_replayable
        sampler = hub.sampler
        forced = False
        wanted = sampler.hot.force_header
        # no dict per request (usually 5-8 fields), and the names compared in C
        if wanted is not None and wanted in map(_NAME, start.raw_headers):
            for name, value in start.raw_headers:
                if name == wanted:
                    forced = sampler.is_forced(value.decode("latin-1"))
                    break
        if method in hub.per_message:
            sampling = StreamSampling(hub, method, start.path, forced, MAX_SAMPLED_BODY)
            return HeaderDecision(messages=sampling)
        # the coin, unless the relay's walk flipped it (and it came up picked)
        if forced or hub.quick.coin_picked:
            tentative = sampler.after_coin(forced)
        else:
            tentative = sampler.at_headers(False)
        if tentative is Tentative.NO:  # the common case: nothing kept, nothing made
            if hub.slow is None:
                return hub.quiet_unpicked  # the relay counts its end: no call into the hook
            if method not in hub.slow_methods or not sampler.may_hold_for_slow():
                return None  # its duration still feeds the slow threshold at its end
            job = hub.replayable[method]
            self._pending[start.stream_id] = _Pending("", "", Tentative.SLOW, job)
            return _HOLD_FOR_SLOW
        if tentative is Tentative.GATED or tentative is Tentative.STORE_FAILING:
            self._pending[start.stream_id] = _Pending("", "", tentative)
            return None
        pending = _Pending(new_trace_id(), new_span_id(), tentative, hub.replayable[method])
        self._pending[start.stream_id] = pending
        hub.handler.on_sampled(start, pending.trace_id, pending.span_id)
        traceparent = f"00-{pending.trace_id}-{pending.span_id}-01"
        return HeaderDecision(
            extra_headers=(("traceparent", traceparent),),
            capture_body=True,
            capture_limit=MAX_SAMPLED_BODY,
        )

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        pending = self._pending.get(stream_id)
        if pending is None:
            return
        if pending.tentative is Tentative.SLOW:  # judged at the stream's end
            pending.body = body
            return
        hub = self._hub
        label = hub.handler.model_label(model)
        decision, held = hub.sampler.admit(label, pending.tentative)
        pending.decision = decision
        hub.metrics.record_decision(label, decision)
        if decision is not Decision.SAMPLED:
            return
        message = self._message(pending, body)
        if message is None or model is None:
            _drop(hub, label, "unreadable_request", held)
            return
        if not hub.handler.known_model(model):
            _drop(hub, label, "unknown_model", held)
            return
        sample = Sample(pending.trace_id, pending.span_id, model, pending.method)
        pending.queued = take(hub, label, sample, message, _REASONS[pending.tentative], held=held)

    def on_stream_end(self, end: StreamEnd) -> None:
        hub = self._hub
        hub.pressure.counts[1] += 1  # `ServingPressure.request_ended`, inline
        pending = self._pending.pop(end.stream_id, None) if self._pending else None
        if end.method not in hub.per_call:
            return  # not replayable, or an inference stream (its messages were decided on)
        if hub.slow is not None and end.method in hub.slow_methods:
            label = hub.label(end.model)
            slow = end.grpc_code == "OK" and hub.slow.observe(label, end.duration_s)
            if pending is not None and pending.tentative is Tentative.SLOW:
                if not (slow and self._profile_slow(pending, end, label)):
                    hub.metrics.record_decision(label, Decision.SKIPPED_RATE)
                return
        if pending is None:  # every request not picked at header time
            hub.metrics.count_skipped(hub.label(end.model))
            return
        if pending.tentative is Tentative.GATED or pending.tentative is Tentative.STORE_FAILING:
            label = hub.handler.model_label(end.model)
            hub.metrics.record_decision(label, hub.sampler.at_body(label, pending.tentative))
            return
        if pending.decision is None:  # picked, but its body never arrived whole
            # counted as sampled, like every other sample dropped before profiling
            label = hub.handler.model_label(end.model)
            hub.metrics.record_decision(label, Decision.SAMPLED)
            hub.metrics.dropped.labels(label, "body_unavailable").inc()
            return
        if pending.queued:
            self._store_request_span(pending, end)

    def _profile_slow(self, pending: _Pending, end: StreamEnd, label: str) -> bool:
        """A slow response of a request held for `sample_slow`: profile its held body, under
        the budget and duty cycle. False when it is no candidate (its body was not held whole,
        or its model is not in the repository): then it counts as not picked."""
        hub = self._hub
        message = self._message(pending, pending.body) if pending.body is not None else None
        model = end.model
        if message is None or model is None or not hub.handler.known_model(model):
            return False
        decision, held = hub.sampler.admit(label, Tentative.SLOW)
        hub.metrics.record_decision(label, decision)
        if decision is not Decision.SAMPLED:
            return True
        pending.trace_id, pending.span_id = new_trace_id(), new_span_id()
        sample = Sample(pending.trace_id, pending.span_id, model, pending.method, traced=False)
        pending.queued = take(hub, label, sample, message, "slow", held=held,
                              slowness_s=end.duration_s)  # fmt: skip
        if pending.queued:
            self._store_request_span(pending, end)
        return True

    def _message(self, pending: _Pending, body: bytes) -> bytes | None:
        """A sampled request's job message: its first gRPC message (None: unreadable)."""
        return first_message(body)

    def _relayed(self, end: StreamEnd) -> RelayedRequest:
        """What a sampled call's request span says."""
        return RelayedRequest(
            end.method, end.path, end.model, end.start_ns, end.start_ns + int(end.duration_s * 1e9),
            end.duration_s, end.grpc_code, end.grpc_message, end.request_bytes, end.response_bytes,
            relay_marks(end),
        )  # fmt: skip

    def _store_request_span(self, pending: _Pending, end: StreamEnd) -> None:
        """The relay's span of a queued request, to the store (a held one's once its job is
        queued); its exemplar on the latency."""
        request = self._relayed(end)
        if isinstance(pending.queued, Held):
            self._hub.held.ended(pending.queued, request)
            return
        try:
            store_request_span(self._hub, pending.trace_id, pending.span_id, request)
        except Exception:
            log.exception("could not hand the request span to the trace writer")


class HttpPlane(SamplingHub):
    """A hub's HTTP side: its sampler, metrics, pressure, handler, hold, slow detector, labels
    and sampled traces, shared (one budget, one duty cycle, one set of counters for both
    protocols), deciding on the backend's `http_replayable` calls. Every such call is one
    request (no inference streams), judged by `sample_slow` too; the HTTP relay gets its
    `quick` as the gRPC one does."""

    def __init__(self, hub: SamplingHub, backend: Backend) -> None:
        # not SamplingHub.__init__: the state is the hub's own, not a copy
        self.sampler, self.pressure, self.metrics = hub.sampler, hub.pressure, hub.metrics
        self.handler, self.held, self.slow = hub.handler, hub.held, hub.slow
        self.sampled_trace_ids, self._lock, self._labels = (
            hub.sampled_trace_ids, hub._lock, hub._labels
        )  # fmt: skip
        self._backend = backend
        self.replayable = dict(backend.http_replayable)
        self.per_message = frozenset()
        self.per_call = frozenset(self.replayable)
        self.slow_methods = self.per_call
        self.quiet_unpicked = hub.quiet_unpicked
        self.quiet_not_replayable = hub.quiet_not_replayable
        # the HTTP relay's (`proxy/http/calls.py`, in Python), as the gRPC relay's C walk
        self.quick = QuickDecisions(
            hub.sampler, self.per_call, self.per_call, self.pressure.counts,
            self.quiet_unpicked, self.quiet_not_replayable,
        )  # fmt: skip


class HttpSamplingObserver(SamplingObserver):
    """Per-connection hook of the HTTP relay (see module docstring)."""

    __slots__ = ()

    def __init__(self, plane: HttpPlane) -> None:
        super().__init__(plane)  # `quick`: the plane's, with `sample_slow` off

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | QuietEnd | None:
        decision = super().on_request_headers(start)
        if type(decision) is HeaderDecision and decision.capture_body:  # picked, or held
            pending = self._pending.get(start.stream_id)
            if pending is not None:
                pending.http = http_headers(start)
        return decision

    def _message(self, pending: _Pending, body: bytes) -> bytes | None:
        """The request's body packed with what its decoder needs (None: it cannot be)."""
        headers = pending.http
        if headers is None:
            return None
        try:
            return pack(body, headers.json_length, target=headers.target, encoding=headers.encoding)
        except HttpMessageError:
            return None

    def _relayed(self, end: StreamEnd) -> RelayedRequest:
        """An HTTP call's request span: its route (the path, no query) and `protocol: http`."""
        path = target_path(end.path)
        return RelayedRequest(
            end.method, path, end.model, end.start_ns, end.start_ns + int(end.duration_s * 1e9),
            end.duration_s, end.grpc_code, end.grpc_message, end.request_bytes, end.response_bytes,
            relay_marks(end), protocol=HTTP,
        )  # fmt: skip


def _drop(hub: SamplingHub, label: str, reason: str, held: bool) -> None:
    """Drop a taken sample before it is queued (`held`: `admit` said to hold it)."""
    if held:
        hub.drop_held(label, reason)
    else:
        hub.drop(label, reason)
