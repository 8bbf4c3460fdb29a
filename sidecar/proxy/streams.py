"""Per-connection stream bookkeeping: from scanned frames to ended gRPC calls.

A `ConnectionTracker` owns the two frame scanners of one relayed connection (client->backend
and backend->client) and the state of each open stream: method, model name (read from the
first bytes of the request), bytes each way, and the gRPC status from the response trailers.
When a stream ends (trailers, RST_STREAM, GOAWAY, connection loss) it is counted in
`ProxyMetrics` and reported to the optional `ConnectionObserver`.

A header block that cannot be read does not end observation. A block too large to hold
(`frames.py`) is skimmed: its effect on the dynamic table is applied (`headers.BlockSkimmer`)
and the next blocks decode as usual; it counts in `xsp_observation_failures_total{reason=
"oversize"}`. When a block cannot be decoded (bad HPACK, or a skim that failed) the direction's
dynamic table is unknown: counted once per connection (`hpack`/`oversize`), the decoder
restarts with an empty table (`HeaderDecoder.reset`). Entries the peer adds from then on are
the newest in its table, so a later block that refers only to them, the static table and
literals decodes exactly; one that refers to an entry we never saw fails cleanly. A request
whose headers cannot be read is still counted by its stream id, with method and model
`_unknown`, and in `xsp_unobserved_streams_total`; it is not offered to the observer (its
sampling headers are unknown). Only a broken frame layer (not HTTP/2) stops observation.

The observer is the hook for request sampling. It is given each new request's headers and may
return header fields to append to *that* request's header block (e.g. a W3C `traceparent`) and
ask for the full request body; it is told when each stream ends, unless it answered the headers
with a `QuietEnd` (then the relay only counts the end where the observer said). Where it gives
the relay its `QuickDecisions`, the C walk answers a request it would not pick itself. Its
exceptions are logged and never reach the data path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote

from sidecar.backends import MethodInfo
from sidecar.proxy import frames, native
from sidecar.proxy.frames import (
    FLAG_ACK,
    GOAWAY,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    FrameScanner,
    ScanError,
)
from sidecar.proxy.headers import (
    BlockSkimmer,
    HeaderDecoder,
    RawHeaders,
    encode_literal_without_indexing,
)
from sidecar.proxy.inferences import MessageSampling, StreamInferences
from sidecar.proxy.metrics import DURATION_BUCKETS, ProxyMetrics
from sidecar.proxy.model_name import (
    HEAD_LIMIT,
    NEED_MORE,
    UNKNOWN_MODEL,
    extract_model_name,
    method_info,
)

log = logging.getLogger(__name__)

GRPC_CODES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip
_STATUS_NAMES = {str(i).encode(): name for i, name in enumerate(GRPC_CODES)}
# gRPC's mapping of HTTP statuses for responses without grpc-status
_HTTP_TO_GRPC = {
    b"400": "INTERNAL", b"401": "UNAUTHENTICATED", b"403": "PERMISSION_DENIED",
    b"404": "UNIMPLEMENTED", b"429": "UNAVAILABLE", b"502": "UNAVAILABLE",
    b"503": "UNAVAILABLE", b"504": "UNAVAILABLE",
}  # fmt: skip
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_RST_REFUSED_STREAM = 0x7
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_MAX_FRAME_SIZE = 0x5
DEFAULT_CAPTURE_LIMIT = 256 << 20


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """A relayed client connection, as given to an `ObserverFactory`."""

    connection_id: int
    peer: str


# The two records made for every call a hook observes are NamedTuples: as immutable as a
# frozen dataclass, and made in a fifth of the time (a frozen dataclass's __init__ sets each
# field through object.__setattr__: ~1.2 us per StreamEnd, docs/benchmarks.md).
class RequestStart(NamedTuple):
    """A new request's headers, as decoded (raw bytes; do not mutate)."""

    connection_id: int
    stream_id: int
    path: str
    method: str
    raw_headers: list[tuple[bytes, bytes]]

    @property
    def metadata(self) -> dict[str, str]:
        """The non-pseudo header fields (gRPC metadata), decoded on each access."""
        return {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in self.raw_headers
            if not name.startswith(b":")
        }


@dataclass(frozen=True, slots=True)
class HeaderDecision:
    """What an observer wants done with one request."""

    extra_headers: Sequence[tuple[str, str]] = ()  # appended to the request's header block
    capture_body: bool = False  # deliver the full request body to `on_request_body`
    capture_limit: int = DEFAULT_CAPTURE_LIMIT  # bodies larger than this are not delivered
    # an inference stream's per-message sampling (`inferences.MessageSampling`)
    messages: MessageSampling | None = None


@dataclass(frozen=True, slots=True)
class QuietEnd:
    """An observer's answer to a request it wants nothing more of, its end included.

    Returned by `on_request_headers` instead of a decision: the relay calls no hook at that
    request's end (no `StreamEnd` is made); it adds 1 to `ended[index]` and, where `per_model`
    is given, to `per_model[label]` under the model's bounded label (`ProxyMetrics.
    model_label`). Nearly every request of a sampling hook ends unpicked: counting it here
    spares a call into the hook after the response's write, when its objects are cold
    (docs/benchmarks.md, issue 24).
    """

    ended: MutableSequence[int]  # e.g. a shared-memory counter array
    index: int
    per_model: dict[str, int] | None = None


@dataclass(slots=True)
class QuickDecisions:
    """What a hook lets the relay decide itself at a new request's headers: where the request
    direction's HPACK cache holds the block (C walk only), an unpicked request is then never
    handed to the hook (docs/benchmarks.md, issue 24). `ConnectionObserver.quick`, read for
    each such request, so the settings behind it may change at any time.

    The relay decides as the hook would: it adds 1 to `started[0]`; a method (its bounded
    label) in `per_call` whose block lacks the `coin.hot.force_header` field (a name in bytes,
    or None) flips the coin, `coin.rand()`, and `coin.rand() >= coin.hot.pick_rate` is
    answered `unpicked`; a method not in `replayable` is answered `not_replayable`. Any other
    request (a force header, a picked coin, a per-message method) goes to the hook as before,
    with no count made; where the relay's coin came up picked, `coin_picked` is True during
    that call and the hook must not flip again (one draw per request, as without the relay).
    """

    coin: Any  # `sampler.Sampler`: `.hot` (`.pick_rate`, `.force_header`) and `.rand()`
    per_call: frozenset[str]  # methods decided by one coin flip at their headers
    replayable: frozenset[str]  # methods the hook answers at all (others: `not_replayable`)
    started: MutableSequence[int]  # index 0 counts every request the hook would have seen
    unpicked: QuietEnd
    not_replayable: QuietEnd
    coin_picked: bool = False


class StreamEnd(NamedTuple):
    """One ended gRPC call as the relay saw it."""

    connection_id: int
    stream_id: int
    path: str
    method: str
    model: str | None  # as read from the request (unbounded; labels use ProxyMetrics)
    grpc_code: str
    grpc_message: str
    start_ns: int  # wall clock (Unix epoch ns) at the request headers
    duration_s: float  # from the request headers to the response's end passed to the client
    request_bytes: int
    response_bytes: int
    sampled: bool = False
    # The relay's own marks, seconds after the request headers (monotonic clock), None where
    # the stream ended before it: the request's end forwarded to the backend, and the
    # response's first frame (its headers) from the backend.
    request_end_s: float | None = None
    response_start_s: float | None = None


# Made for every call a hook observes, by `tuple.__new__` straight from a tuple of every field
# (in order, defaults included): 0.13 us a StreamEnd against 0.36 through the NamedTuple's
# generated __new__ (docs/benchmarks.md, issue 24's hook section).
_record = tuple.__new__


class ConnectionObserver(Protocol):
    """Hooks for one relayed connection (see module docstring)."""

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | QuietEnd | None: ...

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None: ...

    def on_stream_end(self, end: StreamEnd) -> None: ...


# An observer may also have an attribute `quick` (`QuickDecisions` or None): see there.

ObserverFactory = Callable[[ConnectionInfo], "ConnectionObserver | None"]


@dataclass(slots=True)
class _PyStream:
    """One open stream's record. Where the C frame walker is built, `_framewalk.Stream` (the
    same attributes) is used instead: the walk updates it on DATA frames without calling the
    sink (`_framewalk.c`); this dataclass is the fallback and, in the tests, the reference."""

    sid: int
    path: bytes
    method: str  # bounded label value
    model_field: tuple[int, ...] | None
    start: float
    timeout: bytes | None = None
    model: str | None = None
    head: bytearray | None = None
    body: bytearray | None = None
    capture_limit: int = 0
    start_ns: int = 0
    request_end: float = 0.0  # perf_counter at the request's END_STREAM (0: not yet)
    response_start: float = 0.0  # perf_counter at the response's first HEADERS (0: not yet)
    request_bytes: int = 0
    response_bytes: int = 0
    http_status: bytes = b""
    grpc_status: bytes | None = None
    grpc_message: bytes = b""
    sampled: bool = False
    inferences: StreamInferences | None = None  # an inference stream: one per request message
    path_text: str = ""  # `path` decoded, once the observer was asked (its records carry it)


_Stream = _PyStream  # the static type of either record (they have the same attributes)
_NativeStream: type[_PyStream] | None
_framewalk = native.load("_framewalk")  # None: not built, or XSP_NATIVE=off
if _framewalk is None:
    _NativeStream = None
else:
    _NativeStream = _framewalk.Stream
    # what the walk counts a call's end with where it ends one itself (see ConnectionTracker)
    _framewalk.configure(_STATUS_NAMES, UNKNOWN_MODEL, DURATION_BUCKETS)


def _parse_settings(payload: bytes) -> list[tuple[int, int]]:
    return [
        (int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(payload[i + 2 : i + 6], "big"))
        for i in range(0, len(payload) - 5, 6)
    ]


def _timeout_s(value: bytes | None) -> float | None:
    if not value or value[-1:] not in _TIMEOUT_UNITS:
        return None
    try:
        return int(value[:-1]) * _TIMEOUT_UNITS[value[-1:]]
    except ValueError:
        return None


def _request_summary(
    by_path: Mapping[bytes, MethodInfo], headers: RawHeaders
) -> tuple[bytes, bytes | None, MethodInfo]:
    path = b""
    timeout = None
    for name, value in headers:
        if name == b":path":
            path = value
        elif name == b"grpc-timeout":
            timeout = value
    return path, timeout, method_info(path, by_path)


def _response_summary(headers: RawHeaders) -> tuple[bytes | None, bytes, bytes]:
    status = None
    message = b""
    http_status = b""
    for name, value in headers:
        if name == b"grpc-status":
            status = value
        elif name == b"grpc-message":
            message = value
        elif name == b":status":
            http_status = value
    return status, message, http_status


class _Side:
    """Shared part of the two directions' frame sinks."""

    decoder: HeaderDecoder[Any]

    def __init__(self, tracker: ConnectionTracker) -> None:
        self.tracker = tracker
        self.scanner: FrameScanner | None = None
        self.other: _Side | None = None
        self.pending_settings: deque[list[tuple[int, int]]] = deque()
        self.desynced = False  # a header block was lost: the decoder restarted empty
        self.settings_seen = False
        self.skimmer: BlockSkimmer | None = None

    def skim_header_block(self, chunk: bytes) -> None:
        if self.skimmer is None:
            self.skimmer = self.decoder.skimmer()
        self.skimmer.feed(chunk)

    def block_lost(self, reason: str) -> None:
        """A header block was not read: keep or restart the HPACK table (see module doc)."""
        skimmer, self.skimmer = self.skimmer, None
        failures = self.tracker.metrics.observation_failures
        if reason == "oversize":
            failures.labels(reason).inc()
            if skimmer is not None and skimmer.complete:
                return  # the table is still in step
        self.decoder.reset()
        if self.desynced:
            return
        self.desynced = True
        if reason != "oversize":
            failures.labels(reason).inc()
        log.warning(
            "connection %d: a header block could not be decoded (%s); calls are counted by "
            "stream until the HPACK table is known again",
            self.tracker.connection_id, reason,
        )  # fmt: skip

    def _settings(self, flags: int, payload: bytes) -> None:
        self.settings_seen = True
        if flags & FLAG_ACK:
            # This side acknowledges settings the other side sent: from now on this side's
            # encoder may use them, so they bound this side's decoder and frame size.
            if self.pending_settings:
                for ident, value in self.pending_settings.popleft():
                    if ident == SETTINGS_HEADER_TABLE_SIZE:
                        self.decoder.set_max_table_size(value)
                    elif ident == SETTINGS_MAX_FRAME_SIZE and self.scanner is not None:
                        self.scanner.max_frame_size = value
        elif self.other is not None:
            self.other.pending_settings.append(_parse_settings(payload))

    def on_control(self, frame_type: int, flags: int, stream_id: int, payload: bytes) -> None:
        if frame_type == SETTINGS:
            self._settings(flags, payload)
        elif frame_type == RST_STREAM:
            st = self.tracker.streams.get(stream_id)
            if st is not None:
                self.tracker.end_reset(st, int.from_bytes(payload[:4], "big"), self)
        elif frame_type == GOAWAY:
            self.on_goaway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF)
        elif frame_type == PING and flags & FLAG_ACK:
            on_ack = self.tracker.on_ping_ack
            if on_ack is not None and self is self.tracker.request:
                on_ack(payload)

    def on_goaway(self, last_stream_id: int) -> None:
        pass


class _RequestSide(_Side):
    """Client -> backend."""

    def __init__(self, tracker: ConnectionTracker) -> None:
        super().__init__(tracker)
        self.decoder = HeaderDecoder(functools.partial(_request_summary, tracker.metrics.by_path))

    def on_header_block(
        self, stream_id: int, end_stream: bool, block: bytes, frame_type: int
    ) -> bytes | None:
        try:
            headers, (path, timeout, info) = self.decoder.decode(block)
        except ScanError as exc:
            self.on_header_block_lost(stream_id, end_stream, frame_type, exc.reason)
            return None
        t = self.tracker
        if frame_type != HEADERS or stream_id <= t.last_stream_id:
            if end_stream:  # client trailers end the request
                self.on_end_stream(stream_id)
            return None  # client trailers, or a push promise (never sent by clients)
        if t.refuse_above is not None:
            t.refuse(stream_id)  # decoded (the table stays in step), never a call
            return None
        t.last_stream_id = stream_id
        st = t.stream_type(
            stream_id, path, t.metrics.method_label(info.name), info.model_field,
            time.perf_counter(), timeout,
        )  # fmt: skip
        if end_stream:
            st.request_end = st.start  # a request of headers only
        elif info.model_field is not None:
            st.head = bytearray()
        if info.per_message:
            st.inferences = StreamInferences(t.metrics, st.method)
            t.metrics.streams.stream_opened(st.method)
        t.streams[stream_id] = st
        t.metrics.open_streams += 1
        if t.observer is None:
            return None
        st.start_ns = time.time_ns()
        return t.ask_observer(st, headers)

    def on_header_block_lost(
        self, stream_id: int, end_stream: bool, frame_type: int, reason: str = "oversize"
    ) -> None:
        self.block_lost(reason)
        t = self.tracker
        if frame_type != HEADERS or stream_id <= t.last_stream_id:
            return
        if t.refuse_above is not None:
            t.refuse(stream_id)
            return
        # A new request we cannot read: count it by its stream id, method and model unknown.
        t.last_stream_id = stream_id
        t.metrics.unobserved_streams.inc()
        st = t.stream_type(
            stream_id, b"", t.metrics.method_label(UNKNOWN_MODEL), None, time.perf_counter()
        )
        st.start_ns = time.time_ns()
        t.streams[stream_id] = st
        t.metrics.open_streams += 1

    def on_data(self, stream_id: int, length: int) -> bool:
        st = self.tracker.streams.get(stream_id)
        if st is None:
            return False
        st.request_bytes += length
        return st.head is not None or st.body is not None or st.inferences is not None

    def on_data_payload(self, stream_id: int, chunk: bytes) -> None:
        st = self.tracker.streams.get(stream_id)
        if st is None:
            return
        if st.inferences is not None:
            st.inferences.request_data(chunk)
        head = st.head
        if head is not None and st.model_field is not None:
            head += chunk[: HEAD_LIMIT - len(head)]
            name = extract_model_name(head, st.model_field)
            if name is NEED_MORE:
                if len(head) >= HEAD_LIMIT:
                    st.head = None
            else:
                st.model = name if isinstance(name, str) else None
                st.head = None
        body = st.body
        if body is not None:
            if len(body) + len(chunk) > st.capture_limit:
                st.body = None
                log.info("request body of stream %d exceeds the capture limit", stream_id)
            else:
                body += chunk

    def on_end_stream(self, stream_id: int) -> None:
        st = self.tracker.streams.get(stream_id)
        if st is None:
            return
        # scanned right before (hold mode) or after (observe mode) the forwarding write
        st.request_end = time.perf_counter()
        st.head = None
        if st.body is not None:
            body, st.body = st.body, None
            self.tracker.deliver_body(st, bytes(body))


class _ResponseSide(_Side):
    """Backend -> client."""

    def __init__(self, tracker: ConnectionTracker) -> None:
        super().__init__(tracker)
        self.decoder = HeaderDecoder(_response_summary)

    def on_header_block(
        self, stream_id: int, end_stream: bool, block: bytes, frame_type: int
    ) -> bytes | None:
        try:
            _, (status, message, http_status) = self.decoder.decode(block)
        except ScanError as exc:
            self.on_header_block_lost(stream_id, end_stream, frame_type, exc.reason)
            return None
        st = self.tracker.streams.get(stream_id)
        if st is None or frame_type != HEADERS:
            return None
        if not st.response_start:
            st.response_start = time.perf_counter()  # written to the client just before
        if status is not None:
            st.grpc_status = status
            st.grpc_message = message
        if http_status:
            st.http_status = http_status
        if end_stream:
            self.tracker.end_response(st)
        return None

    def on_header_block_lost(
        self, stream_id: int, end_stream: bool, frame_type: int, reason: str = "oversize"
    ) -> None:
        self.block_lost(reason)
        st = self.tracker.streams.get(stream_id)
        if st is not None and frame_type == HEADERS:
            if not st.response_start:
                st.response_start = time.perf_counter()
            if end_stream:
                self.tracker.end_response(st)  # status unknown: counted as UNKNOWN

    def on_data(self, stream_id: int, length: int) -> bool:
        st = self.tracker.streams.get(stream_id)
        if st is None:
            return False
        st.response_bytes += length
        return st.inferences is not None

    def on_data_payload(self, stream_id: int, chunk: bytes) -> None:
        st = self.tracker.streams.get(stream_id)
        if st is not None and st.inferences is not None:
            st.inferences.response_data(chunk)

    def on_end_stream(self, stream_id: int) -> None:
        st = self.tracker.streams.get(stream_id)
        if st is not None:
            self.tracker.end_response(st)

    def on_goaway(self, last_stream_id: int) -> None:
        t = self.tracker
        for st in [s for sid, s in t.streams.items() if sid > last_stream_id]:
            t.end(st, "UNAVAILABLE")


class ConnectionTracker:
    """Observation state of one relayed connection."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        *,
        observer: ConnectionObserver | None = None,
        connection_id: int = 0,
    ) -> None:
        self.metrics = metrics
        self.observer = observer
        self.connection_id = connection_id
        self.streams: dict[int, _Stream] = {}
        self.last_stream_id = 0
        self.failed = False
        # Draining (`drain.py`): a new stream above `refuse_above` is refused, not a call.
        self.refuse_above: int | None = None
        self.on_refused: Callable[[int], None] | None = None
        self.on_ping_ack: Callable[[bytes], None] | None = None  # client PING ACK payloads
        self._refused: set[int] = set()
        self.quiet_ends: dict[int, QuietEnd] = {}  # stream id -> its observer's `QuietEnd`
        # what the C walk may decide itself for the observer (`QuickDecisions`), or None
        self.quick: QuickDecisions | None = getattr(observer, "quick", None)
        self.request = _RequestSide(self)
        self.response = _ResponseSide(self)
        self.request.other = self.response
        self.response.other = self.request
        # With an observer, client header blocks are held until complete so fields can be
        # appended; without one, the relay forwards first and scans afterwards.
        self.request_scanner = FrameScanner(
            self.request, client_side=True, hold=observer is not None, on_failure=self._failed
        )
        self.response_scanner = FrameScanner(
            self.response, client_side=False, on_failure=self._failed
        )
        self.request.scanner = self.request_scanner
        self.response.scanner = self.response_scanner
        # With the C walk, stream records it updates itself (no crossing into Python for a
        # DATA frame, a unary request's model name and end, or a response's cached headers);
        # the Python records otherwise. In observe mode it also starts a call whose request
        # block is cached (no observer to ask) and ends one whose trailers are cached (no
        # observer to tell, or a QuietEnd), counting it in `metrics` as `end` does: a unary
        # call then does not cross into Python at all once its blocks are cached.
        self.stream_type: type[_Stream] = _PyStream
        if frames.native_walk is not None and _NativeStream is not None:
            self.stream_type = _NativeStream
            self.request_scanner.streams = self.response_scanner.streams = self.streams
            self.request_scanner.header_cache = self.request.decoder.cache
            self.response_scanner.header_cache = self.response.decoder.cache
            self.request_scanner.tracker = self.response_scanner.tracker = self

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def _failed(self, reason: str) -> None:
        if self.failed:
            return
        self.failed = True
        self.metrics.observation_failures.labels(reason).inc()
        log.warning(
            "connection %d: stopped observing (%s); bytes keep flowing", self.connection_id, reason
        )
        self.request_scanner.stop()
        self.response_scanner.stop()
        self.metrics.open_streams -= len(self.streams)
        self.quiet_ends.clear()
        for st in self.streams.values():
            if st.inferences is not None:  # their responses will not be seen
                st.inferences.close("UNKNOWN", time.perf_counter() - st.start)
        self.streams.clear()

    def close(self, code: str) -> None:
        """The connection is gone: end every open stream with `code`."""
        for st in list(self.streams.values()):
            self.end(st, code)
        self.request_scanner.stop()
        self.response_scanner.stop()

    def refuse(self, stream_id: int) -> None:
        """A new stream the relay did not forward (it opened after our final GOAWAY)."""
        if stream_id in self._refused:
            return
        self._refused.add(stream_id)
        self.metrics.refused_streams.inc()
        if self.on_refused is not None:
            self.on_refused(stream_id)

    # -- stream ends ----------------------------------------------------------------------

    def end_response(self, st: _Stream) -> None:
        status = st.grpc_status
        if status is not None:
            code = _STATUS_NAMES.get(status.strip(), "UNKNOWN")
        elif st.http_status and st.http_status != b"200":
            code = _HTTP_TO_GRPC.get(st.http_status, "UNKNOWN")
        else:
            code = "UNKNOWN"  # a response ended without grpc-status
        self.end(st, code)

    def end_reset(self, st: _Stream, error_code: int, side: _Side) -> None:
        code = "CANCELLED"
        if error_code == _RST_REFUSED_STREAM:
            code = "UNAVAILABLE"
        elif side is self.request:
            timeout = _timeout_s(st.timeout)
            if timeout is not None and time.perf_counter() - st.start >= timeout * 0.98:
                code = "DEADLINE_EXCEEDED"  # the client gave up at its deadline
        self.end(st, code)

    def end(self, st: _Stream, code: str) -> None:
        if self.streams.pop(st.sid, None) is None:
            return
        metrics = self.metrics
        metrics.open_streams -= 1
        duration = time.perf_counter() - st.start
        label = None
        if st.inferences is not None:  # counted per request message, the stream apart
            st.inferences.close(code, duration)
        else:
            label = metrics.model_label(st.model)
            metrics.record(
                st.method, label, code, duration, st.request_bytes, st.response_bytes
            )  # fmt: skip
        if self.quiet_ends and (quiet := self.quiet_ends.pop(st.sid, None)) is not None:
            quiet.ended[quiet.index] += 1
            if (per_model := quiet.per_model) is not None:
                if label is None:
                    label = metrics.model_label(st.model)
                per_model[label] = per_model.get(label, 0) + 1
        elif self.observer is not None:
            start = st.start
            message = st.grpc_message
            end = _record(StreamEnd, (
                self.connection_id, st.sid, st.path_text, st.method, st.model, code,
                unquote(message.decode("utf-8", "replace")) if message else "",
                st.start_ns, duration, st.request_bytes, st.response_bytes, st.sampled,
                st.request_end - start if st.request_end else None,
                st.response_start - start if st.response_start else None,
            ))  # fmt: skip
            try:
                self.observer.on_stream_end(end)
            except Exception:
                metrics.observer_errors["stream_end"] += 1
                log.exception("observer.on_stream_end failed")

    # -- observer -------------------------------------------------------------------------

    def ask_observer(self, st: _Stream, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        assert self.observer is not None
        st.path_text = path = st.path.decode("utf-8", "replace")
        start = _record(RequestStart, (self.connection_id, st.sid, path, st.method, headers))
        try:
            decision = self.observer.on_request_headers(start)
        except Exception:
            self.metrics.observer_errors["request_headers"] += 1
            log.exception("observer.on_request_headers failed")
            return None
        if decision is None:
            return None
        if type(decision) is QuietEnd:
            self.quiet_ends[st.sid] = decision
            return None
        assert isinstance(decision, HeaderDecision)
        if decision.messages is not None and st.inferences is not None:
            st.inferences.sample_with(decision.messages)
        if decision.capture_body:
            st.sampled = True
            st.body = bytearray()
            st.capture_limit = decision.capture_limit
        if not decision.extra_headers:
            return None
        try:
            return encode_literal_without_indexing(decision.extra_headers)
        except ValueError:
            self.metrics.observer_errors["request_headers"] += 1
            log.exception("observer returned an invalid header field")
            return None

    def deliver_body(self, st: _Stream, body: bytes) -> None:
        if self.observer is None:
            return
        try:
            self.observer.on_request_body(st.sid, st.model, body)
        except Exception:
            self.metrics.observer_errors["request_body"] += 1
            log.exception("observer.on_request_body failed")
