"""A small OTLP/HTTP trace receiver (`POST /v1/traces`) for the backend's server spans.

Triton's OpenTelemetry trace mode exports OTLP/JSON over HTTP; OTLP/protobuf is accepted too
when `opentelemetry-proto` is installed (otherwise such payloads get a 415 saying so). Bodies
may be gzip-compressed. Parsed spans go to a callback; the receiver never raises into its
caller: every bad request gets a 4xx (or 503) answer and is counted under one of
`REJECT_REASONS`; callback failures are logged (rate-limited) and counted.

It is aiohttp's low-level web server on its own event loop in one daemon thread, off the
serving path; decoding, parsing and the callback run on one more thread, one payload at a time,
so a big payload does not hold up the event loop. Bounds:

- at most `max_connections` connections at once; more are answered 503 and closed;
- a request must arrive whole (headers and body) within `read_timeout_s` of the connection
  opening or of the previous response, else it gets a 408 and the connection is closed; an idle
  keep-alive connection is closed silently after the same time. aiohttp bounds the size of a
  request head but has no read timeout (only recent versions close, silently, a connection that
  never sends a whole head), so this is a timer per connection here; a client that does not
  read what it is sent is cut off `read_timeout_s` later;
- a body over `max_body_bytes` gets a 413: by its Content-Length before it is read, or once
  gunzipped; a request without Content-Length (chunked) gets a 411.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType
from typing import Any, cast

from aiohttp import hdrs, web

from sidecar.endpoint import PortInUseError, translate_bind_errors
from sidecar.live.otlp_payload import (
    OtlpEvent,
    OtlpPayloadError,
    OtlpSpan,
    ProtobufNotSupportedError,
    SpanCallback,
    parse_otlp_json,
    parse_otlp_protobuf,
    protobuf_supported,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_READ_TIMEOUT_S",
    "REJECT_REASONS",
    "OtlpEvent",
    "OtlpPayloadError",
    "OtlpReceiver",
    "OtlpSpan",
    "ProtobufNotSupportedError",
    "ReceiverStats",
    "SpanCallback",
    "parse_otlp_json",
    "parse_otlp_protobuf",
    "protobuf_supported",
]

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
JSON_CONTENT_TYPE = "application/json"
PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 16
_LOG_INTERVAL_S = 60.0  # at most one warning per rejection reason in this time
_STOP_GRACE_S = 1.0  # how long stop() lets requests in flight finish
_LINGER_S = 1.0  # how long a connection over the cap has to read its 503

# Why a request was rejected: the fixed label set of `xsp_otlp_rejected_total{reason}`.
REJECT_REASONS = (
    "method",  # 405 not POST
    "path",  # 404 not /v1/traces
    "length",  # 411 no Content-Length
    "too_large",  # 413 over max_body_bytes, declared or once decompressed
    "timeout",  # 408 the request did not arrive whole within read_timeout_s
    "truncated",  # 400 the client closed the connection in the middle of the body
    "encoding",  # 400 bad gzip, 415 a Content-Encoding other than gzip
    "content_type",  # 415 neither OTLP/JSON nor OTLP/protobuf
    "protobuf",  # 415 OTLP/protobuf without opentelemetry-proto installed
    "malformed",  # 400 the body is not a valid ExportTraceServiceRequest
    "bad_request",  # 400 HTTP that aiohttp's parser refuses (request line, headers, sizes)
    "overloaded",  # 503 more than max_connections connections at once
)

# google.rpc.Code values used in error bodies
_INVALID_ARGUMENT = 3
_DEADLINE_EXCEEDED = 4
_RESOURCE_EXHAUSTED = 8
_UNIMPLEMENTED = 12
_UNAVAILABLE = 14


def _status_protobuf(code: int, message: str) -> bytes:
    """A `google.rpc.Status{code, message}` encoded by hand (no googleapis dependency)."""
    text = message.encode()
    out = bytearray([0x08])  # field 1, varint
    out += _varint(code)
    out.append(0x12)  # field 2, length-delimited
    out += _varint(len(text))
    out += text
    return bytes(out)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _rpc_code(status: int) -> int:
    codes: dict[int, int] = {
        HTTPStatus.UNSUPPORTED_MEDIA_TYPE: _UNIMPLEMENTED,
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE: _RESOURCE_EXHAUSTED,
        HTTPStatus.REQUEST_TIMEOUT: _DEADLINE_EXCEEDED,
        HTTPStatus.SERVICE_UNAVAILABLE: _UNAVAILABLE,
    }
    return codes.get(status, _INVALID_ARGUMENT)


def _json_status(status: int, message: str) -> bytes:
    return json.dumps({"code": _rpc_code(status), "message": message}).encode()


def _error_response(status: int, message: str, as_protobuf: bool) -> web.Response:
    if as_protobuf:
        body, content_type = _status_protobuf(_rpc_code(status), message), PROTOBUF_CONTENT_TYPE
    else:
        body, content_type = _json_status(status, message), JSON_CONTENT_TYPE
    response = web.Response(status=status, body=body, content_type=content_type)
    if status == HTTPStatus.METHOD_NOT_ALLOWED:
        response.headers[hdrs.ALLOW] = "POST"
    return response


def _raw_answer(status: HTTPStatus, message: str) -> bytes:
    """A whole closing JSON answer, for a connection that has no aiohttp request to answer."""
    body = _json_status(status, message)
    retry = "Retry-After: 1\r\n" if status == HTTPStatus.SERVICE_UNAVAILABLE else ""
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {JSON_CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Rejected(Exception):
    """A request answered with an error, counted under `reason`."""

    def __init__(
        self, status: int, reason: str, message: str, as_protobuf: bool, close: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.as_protobuf, self.close = as_protobuf, close


def _gunzip(body: bytes, limit: int, as_protobuf: bool) -> bytes:
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = decompressor.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _Rejected(400, "encoding", f"bad gzip body: {exc}", as_protobuf) from None
    if len(out) > limit or decompressor.unconsumed_tail:
        message = f"decompressed body is over the limit of {limit} bytes"
        raise _Rejected(413, "too_large", message, as_protobuf)
    if not decompressor.eof:
        raise _Rejected(400, "encoding", "bad gzip body: the stream is truncated", as_protobuf)
    return out


@dataclass
class ReceiverStats:
    """Counters of the receiver (payloads are HTTP requests; spans are what they held)."""

    accepted: int = 0
    rejected: int = 0
    spans: int = 0
    callback_errors: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    active_connections: int = 0


class _Connection(web.RequestHandler):
    """aiohttp's HTTP/1.1 protocol for one connection, plus the connection cap and the deadline
    for each request's arrival."""

    def __init__(self, server: _Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.server = server
        self.receiver = server.receiver
        self.request: web.BaseRequest | None = None  # in the receiver's handler
        self.deadline = 0.0  # loop time by which the current request must have arrived
        self.partial = False  # bytes of a request that is not in the handler yet
        self.eof = False  # the client shut its side
        self.refused = False
        self.timer: asyncio.TimerHandle | None = None

    def peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return str(peer[0]) if peer else "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.server.open) >= self.receiver.max_connections:
            self.refused = True
            message = f"over {self.receiver.max_connections} connections at once"
            transport = cast(asyncio.Transport, transport)
            peer = transport.get_extra_info("peername")
            self.receiver._count_rejected("overloaded", message, str(peer[0] if peer else "?"))
            # half-close after the answer and drop what the client sends: closing with its
            # request unread would reset the connection, and the 503 with it
            transport.write(_raw_answer(HTTPStatus.SERVICE_UNAVAILABLE, message))
            transport.write_eof()
            self.timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)
            return
        self.server.open.add(self)
        super().connection_made(transport)
        self.arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.refused:
            return
        self.server.open.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.request is None:
            self.partial = True
        super().data_received(data)

    def eof_received(self) -> bool:  # type: ignore[override]
        """The client shut its side: a request still being sent will not complete. Keep the
        connection open for an answer when a request is under way, else close it."""
        self.eof = True
        if self.refused:
            return False
        if self.request is not None:
            self.request.content.feed_eof()
            return True
        return self.partial

    def arm(self) -> None:
        """Start the clock for the next request."""
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + self.receiver.read_timeout_s
        self.partial = False
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_at(self.deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        transport = self.transport
        if self.request is not None or transport is None:  # the handler keeps its own time
            return
        if self.partial and not transport.is_closing():
            message = f"the request did not arrive whole within {self.receiver.read_timeout_s} s"
            self.receiver._count_rejected("timeout", message, self.peer())
            transport.write(_raw_answer(HTTPStatus.REQUEST_TIMEOUT, message))
        self.force_close()  # closes once what is written is sent; if the client never reads:
        asyncio.get_running_loop().call_later(self.receiver.read_timeout_s, transport.abort)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's own refusals of unparsable HTTP: answered, counted, not logged as errors."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        text = (message or HTTPStatus(status).phrase)[:300]
        self.receiver._count_rejected("bad_request", text, self.peer())
        response = _error_response(status, text, as_protobuf=False)
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's low-level server making `_Connection`s for `receiver`."""

    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self.open: set[_Connection] = set()
        self.settings: dict[str, Any] = {
            "loop": asyncio.get_running_loop(),
            "keepalive_timeout": 2 * receiver.read_timeout_s,  # a backstop; `arm` comes first
            "lingering_time": 0,  # a refused body is drained by `_refuse`, within the deadline
            "auto_decompress": False,  # gunzipped here, within max_body_bytes
            "access_log": None,
        }
        super().__init__(receiver._handle, **self.settings)

    def __call__(self) -> _Connection:
        return _Connection(self, **self.settings)


class OtlpReceiver:
    """Accepts OTLP/HTTP trace exports on `host:port` (port 0 picks a free one) and hands each
    payload's spans to `on_spans`.

    Use as a context manager or call `start()` / `stop()`; `port` is the bound port once
    started; `stats()` returns a snapshot of the counters (exported by
    `sidecar.live.otlp_metrics.OtlpMetricsCollector`).
    """

    def __init__(
        self,
        on_spans: SpanCallback,
        host: str = "127.0.0.1",
        port: int = 4318,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if max_body_bytes <= 0 or max_connections <= 0 or not read_timeout_s > 0:
            raise ValueError(
                "max_body_bytes, read_timeout_s and max_connections must be positive, got "
                f"{max_body_bytes}, {read_timeout_s}, {max_connections}"
            )
        self.on_spans = on_spans
        self.host = host
        self.requested_port = port
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._port: int | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._parser: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stats = ReceiverStats()
        self._last_warning: dict[str, float] = {}

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the OTLP receiver is not started; call start() first")
        return self._port

    @property
    def url(self) -> str:
        """The endpoint to give an exporter, e.g. Triton's `opentelemetry,url=`."""
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    @property
    def active_connections(self) -> int:
        server = self._server
        return 0 if server is None else len(server.open)

    def start(self) -> OtlpReceiver:
        if self._thread is not None:
            return self
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="otlp-parse")
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(started),), name="otlp-receiver", daemon=True
        )
        self._thread.start()
        address = f"{self.host}:{self.requested_port}"
        try:
            with translate_bind_errors(address, "OTLP", "--otlp-port"):
                self._port = started.result()
        except Exception as exc:
            self._thread.join()
            self._thread = self._server = None
            self._parser.shutdown()
            if isinstance(exc, PortInUseError) or not isinstance(exc, OSError):
                raise
            # asyncio's bind error wraps the errno's text in a longer message
            errno = exc.errno or 0
            reason = os.strerror(errno) if errno > 0 else exc.strerror or str(exc)
            raise OSError(
                f"cannot listen for OTLP on {address}: {reason}; pick another --otlp-port"
            ) from None
        log.info("OTLP receiver listening on %s", self.url)
        return self

    async def _serve(self, started: concurrent.futures.Future[int]) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        self._server = _Server(self)
        runner = web.ServerRunner(self._server, shutdown_timeout=_STOP_GRACE_S)
        try:
            await runner.setup()
            await web.TCPSite(runner, self.host, self.requested_port, backlog=128).start()
            started.set_result(int(runner.addresses[0][1]))
            await self._stopping.wait()
        except Exception as exc:
            if started.done():
                raise
            started.set_exception(exc)
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._loop is not None and self._stopping is not None
        self._loop.call_soon_threadsafe(self._stopping.set)
        thread.join(10 + _STOP_GRACE_S)
        if self._parser is not None:
            self._parser.shutdown(wait=True)  # a payload being parsed is still delivered
        self._server = self._port = None

    def stats(self) -> ReceiverStats:
        active = self.active_connections
        with self._lock:
            return ReceiverStats(
                accepted=self._stats.accepted,
                rejected=self._stats.rejected,
                spans=self._stats.spans,
                callback_errors=self._stats.callback_errors,
                rejected_by_reason=dict(self._stats.rejected_by_reason),
                active_connections=active,
            )

    # ---------------------------------------------------------------- on the event loop

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = cast(_Connection, request.protocol)
        connection.request = request
        try:
            response = await self._respond(request, connection.deadline)
        except _Rejected as rejection:
            response = await self._refuse(request, rejection, connection)
        finally:
            connection.request = None
        if connection.eof:
            response.force_close()  # the client shut its side: nothing more will come
        connection.arm()
        return response

    async def _respond(self, request: web.BaseRequest, deadline: float) -> web.StreamResponse:
        content_type = request.headers.get(hdrs.CONTENT_TYPE, "").split(";")[0].strip().lower()
        as_protobuf = content_type == PROTOBUF_CONTENT_TYPE
        body = await self._read_body(request, deadline, as_protobuf)
        if request.path != TRACES_PATH:
            raise _Rejected(404, "path", f"only {TRACES_PATH} is served", as_protobuf)
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
        if encoding not in ("", "identity", "gzip"):
            message = f"Content-Encoding {encoding!r} is not supported (use gzip or none)"
            raise _Rejected(415, "encoding", message, as_protobuf)
        if content_type not in (JSON_CONTENT_TYPE, PROTOBUF_CONTENT_TYPE):
            message = (
                f"Content-Type {content_type!r} is not supported; use {JSON_CONTENT_TYPE} "
                f"or {PROTOBUF_CONTENT_TYPE}"
            )
            raise _Rejected(415, "content_type", message, as_protobuf=False)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._parser, self._accept, body, encoding, as_protobuf)
        if as_protobuf:  # an empty ExportTraceServiceResponse
            return web.Response(body=b"", content_type=PROTOBUF_CONTENT_TYPE)
        return web.Response(body=b"{}", content_type=JSON_CONTENT_TYPE)

    async def _read_body(
        self, request: web.BaseRequest, deadline: float, as_protobuf: bool
    ) -> bytes:
        if request.method != hdrs.METH_POST:
            raise _Rejected(405, "method", f"use POST {TRACES_PATH}", as_protobuf=False)
        length = request.content_length
        if length is None:
            message = "Content-Length is required"
            raise _Rejected(411, "length", message, as_protobuf, close=True)
        if length > self.max_body_bytes:
            message = f"body of {length} bytes is over the limit of {self.max_body_bytes}"
            raise _Rejected(413, "too_large", message, as_protobuf, close=True)
        if request.headers.get(hdrs.EXPECT, "").lower() == "100-continue" and request.transport:
            request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout_at(deadline):
                return await request.content.readexactly(length)
        except TimeoutError:
            message = f"the request did not arrive whole within {self.read_timeout_s} s"
            raise _Rejected(408, "timeout", message, as_protobuf, close=True) from None
        except asyncio.IncompleteReadError as exc:
            message = f"the body ended after {len(exc.partial)} of {length} bytes"
            raise _Rejected(400, "truncated", message, as_protobuf, close=True) from None
        except OSError:  # reset by the client: counted, though there is nobody to answer
            message = "connection reset during the body"
            raise _Rejected(400, "truncated", message, as_protobuf, close=True) from None

    async def _refuse(
        self, request: web.BaseRequest, rejection: _Rejected, connection: _Connection
    ) -> web.StreamResponse:
        """Answer with the error. When the body is left unread, send the answer at once, then
        drop what the client still sends until the deadline (a client that sends all of it
        before reading would otherwise get a connection reset), then close."""
        self._count_rejected(rejection.reason, rejection.message, connection.peer())
        response = _error_response(rejection.status, rejection.message, rejection.as_protobuf)
        if rejection.close:
            response.force_close()
        if request.content.is_eof():
            return response
        try:
            await response.prepare(request)
            await response.write_eof()
            async with asyncio.timeout_at(connection.deadline):
                while await request.content.readany():
                    pass
        except (TimeoutError, OSError):
            pass
        return response

    # ---------------------------------------------------------------- on the parser thread

    def _accept(self, body: bytes, encoding: str, as_protobuf: bool) -> None:
        """Decode a payload and hand its spans to the callback; `_Rejected` if it is bad."""
        if encoding == "gzip":
            body = _gunzip(body, self.max_body_bytes, as_protobuf)
        try:
            spans = parse_otlp_protobuf(body) if as_protobuf else parse_otlp_json(body)
        except ProtobufNotSupportedError as exc:
            raise _Rejected(415, "protobuf", str(exc), as_protobuf=False) from None
        except OtlpPayloadError as exc:
            raise _Rejected(400, "malformed", str(exc), as_protobuf) from None
        except Exception as exc:  # a bad payload the decoder did not foresee: still a 400
            log.debug("unexpected error decoding an OTLP payload", exc_info=True)
            message = f"body could not be decoded ({type(exc).__name__})"
            raise _Rejected(400, "malformed", message, as_protobuf) from None
        with self._lock:
            self._stats.accepted += 1
            self._stats.spans += len(spans)
        if not spans:
            return
        try:
            self.on_spans(spans)
        except Exception:  # telemetry never raises into the exporter's request
            with self._lock:
                self._stats.callback_errors += 1
            if self._loud("callback"):
                log.exception("the OTLP span callback failed; %d spans lost", len(spans))
            else:
                log.debug("the OTLP span callback failed; %d spans lost", len(spans))

    # ---------------------------------------------------------------- from either thread

    def _loud(self, key: str) -> bool:
        """Whether to warn about `key` now: once per key and `_LOG_INTERVAL_S`."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_warning.get(key, -_LOG_INTERVAL_S) < _LOG_INTERVAL_S:
                return False
            self._last_warning[key] = now
            return True

    def _count_rejected(self, reason: str, message: str, peer: str) -> None:
        with self._lock:
            self._stats.rejected += 1
            self._stats.rejected_by_reason[reason] = (
                self._stats.rejected_by_reason.get(reason, 0) + 1
            )
        # a flood of bad payloads must not flood the log: one warning per reason and minute
        level = logging.WARNING if self._loud(reason) else logging.DEBUG
        log.log(level, "rejected OTLP request from %s (%s): %s", peer, reason, message[:300])

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
