"""A small OTLP/HTTP trace receiver (`POST /v1/traces`) for the backend's server spans.

Triton's OpenTelemetry trace mode exports OTLP/JSON over HTTP; OTLP/protobuf is accepted too
when `opentelemetry-proto` is installed (otherwise such payloads get a 415 saying so). Bodies
may be gzip-compressed. Parsed spans go to a callback; the receiver never raises into its
caller: every bad request gets a 4xx (or 503) answer and is counted under one of
`REJECT_REASONS`; callback failures are logged and counted.

It runs on stdlib `ThreadingHTTPServer` threads, off the serving path, within bounds:

- at most `max_connections` connections at once (one thread each); more are answered 503;
- a request must arrive whole (headers and body) within `read_timeout_s` of the connection
  opening or of the previous response; otherwise it gets a 408 and the connection is closed.
  The deadline is enforced by the accept loop, so a client that trickles bytes cannot hold a
  thread for longer; an idle keep-alive connection is closed after the same time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

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

# Why a request was rejected: the fixed label set of `xsp_otlp_rejected_total{reason}`.
REJECT_REASONS = (
    "method",  # 405 not POST, 501 a method http.server does not know
    "path",  # 404 not /v1/traces
    "length",  # 411 no Content-Length
    "too_large",  # 413 over max_body_bytes, declared or once decompressed
    "timeout",  # 408 the request did not arrive whole within read_timeout_s
    "truncated",  # 400 the client closed the connection in the middle of the body
    "encoding",  # 400 bad gzip, 415 a Content-Encoding other than gzip
    "content_type",  # 415 neither OTLP/JSON nor OTLP/protobuf
    "protobuf",  # 415 OTLP/protobuf without opentelemetry-proto installed
    "malformed",  # 400 the body is not a valid ExportTraceServiceRequest
    "bad_request",  # 400/414/431 HTTP that http.server itself refuses
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
    return {
        HTTPStatus.UNSUPPORTED_MEDIA_TYPE: _UNIMPLEMENTED,
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE: _RESOURCE_EXHAUSTED,
        HTTPStatus.REQUEST_TIMEOUT: _DEADLINE_EXCEEDED,
        HTTPStatus.SERVICE_UNAVAILABLE: _UNAVAILABLE,
    }.get(HTTPStatus(status), _INVALID_ARGUMENT)


class _GzipTooLarge(OtlpPayloadError):
    """The decompressed body is over the size limit."""


def _gunzip(body: bytes, limit: int) -> bytes:
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = decompressor.decompress(body, limit + 1)
    if len(out) > limit or decompressor.unconsumed_tail:
        raise _GzipTooLarge(f"decompressed body is over the limit of {limit} bytes")
    if not decompressor.eof:
        raise OtlpPayloadError("gzip stream is truncated")
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


@dataclass
class _Connection:
    """What the accept loop knows of one open connection."""

    deadline: float | None  # monotonic time by which the current request must be read
    thread: threading.Thread | None = None
    timed_out: bool = False


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: the exporter reuses its connection
    state: _Connection

    def setup(self) -> None:
        # A per-read/write socket timeout, looser than the deadline that the accept loop
        # enforces (which answers 408): a backstop for writes to a client that does not read.
        super().setup()
        self.connection.settimeout(2 * self.server.owner.read_timeout_s + 1)
        self.state = self.server.connection(self.request)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("otlp %s: " + format, self.address_string(), *args)

    def _no_http09(self) -> None:
        """No OTLP client speaks HTTP/0.9: a cut or garbled request line still gets a status."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
            self.close_connection = True

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self._no_http09()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if status == HTTPStatus.SERVICE_UNAVAILABLE:
                self.send_header("Retry-After", "1")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:  # the client went away; nothing left to answer
            self.close_connection = True
            return
        if not self.close_connection:
            self.server.arm(self.state)  # the next request on this connection

    def _reject(self, status: int, reason: str, message: str, as_protobuf: bool) -> None:
        self.server.owner._count_rejected(reason, message, self.address_string())
        code = _rpc_code(status)
        if as_protobuf:
            self._send(status, PROTOBUF_CONTENT_TYPE, _status_protobuf(code, message))
        else:
            body = json.dumps({"code": code, "message": message}).encode()
            self._send(status, JSON_CONTENT_TYPE, body)

    def _reject_late(self, as_protobuf: bool) -> None:
        self.close_connection = True
        self._reject(
            HTTPStatus.REQUEST_TIMEOUT,
            "timeout",
            f"the request did not arrive whole within {self.server.owner.read_timeout_s} s",
            as_protobuf,
        )

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (bad request line, headers too long, unknown method)."""
        if self.state.timed_out:
            code, reason = HTTPStatus.REQUEST_TIMEOUT, "timeout"
            message = None  # the status line keeps its phrase; the body says why
            explain = (
                f"the request did not arrive whole within {self.server.owner.read_timeout_s} s"
            )
        elif code == HTTPStatus.NOT_IMPLEMENTED:
            reason = "method"
        else:
            reason = "bad_request"
        self.server.owner._count_rejected(
            reason, message or explain or HTTPStatus(code).phrase, self.address_string()
        )
        self._no_http09()
        try:
            super().send_error(code, message, explain)
        except OSError:
            self.close_connection = True

    def do_GET(self) -> None:
        if self.state.timed_out:
            self._reject_late(as_protobuf=False)
            return
        self._reject(
            HTTPStatus.METHOD_NOT_ALLOWED, "method", f"use POST {TRACES_PATH}", as_protobuf=False
        )

    def do_POST(self) -> None:
        owner = self.server.owner
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        as_protobuf = content_type == PROTOBUF_CONTENT_TYPE
        if self.state.timed_out:  # the headers did not arrive in time
            self._reject_late(as_protobuf)
            return
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.strip().isdigit():
            self.close_connection = True
            self._reject(
                HTTPStatus.LENGTH_REQUIRED, "length", "Content-Length is required", as_protobuf
            )
            return
        length = int(length_header)
        if length > owner.max_body_bytes:
            self.close_connection = True
            self._reject(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "too_large",
                f"body of {length} bytes is over the limit of {owner.max_body_bytes}",
                as_protobuf,
            )
            self._discard(length)
            return
        body = self._read_body(length, as_protobuf)
        if body is None:
            return
        if self.server.disarm(self.state):  # timed out just as the body completed
            self.close_connection = True
        if self.path.split("?")[0] != TRACES_PATH:
            self._reject(HTTPStatus.NOT_FOUND, "path", f"only {TRACES_PATH} is served", as_protobuf)
            return
        spans = self._decode(body, content_type, as_protobuf)
        if spans is None:
            return
        owner._deliver(spans)
        if as_protobuf:  # an empty ExportTraceServiceResponse
            self._send(HTTPStatus.OK, PROTOBUF_CONTENT_TYPE, b"")
        else:
            self._send(HTTPStatus.OK, JSON_CONTENT_TYPE, b"{}")

    def _discard(self, length: int) -> None:
        """Read and drop a refused body (until the deadline at most): a client that sends all
        of it before reading would otherwise get a connection reset instead of the answer."""
        with contextlib.suppress(OSError):
            while length > 0 and (chunk := self.rfile.read(min(length, 1 << 16))):
                length -= len(chunk)

    def _read_body(self, length: int, as_protobuf: bool) -> bytes | None:
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            body, self.state.timed_out = b"", True
        except OSError:  # reset by the client: count it, there is nobody to answer
            self.close_connection = True
            self.server.owner._count_rejected(
                "truncated", "connection reset during the body", self.address_string()
            )
            return None
        if len(body) == length:
            return body
        self.close_connection = True
        if self.state.timed_out:
            self._reject_late(as_protobuf)
        else:
            self._reject(
                HTTPStatus.BAD_REQUEST,
                "truncated",
                f"the body ended after {len(body)} of {length} bytes",
                as_protobuf,
            )
        return None

    def _decode(self, body: bytes, content_type: str, as_protobuf: bool) -> list[OtlpSpan] | None:
        owner = self.server.owner
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = _gunzip(body, owner.max_body_bytes)
            elif encoding not in ("", "identity"):
                self._reject(
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                    "encoding",
                    f"Content-Encoding {encoding!r} is not supported (use gzip or none)",
                    as_protobuf,
                )
                return None
        except _GzipTooLarge as exc:
            self._reject(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "too_large", str(exc), as_protobuf)
            return None
        except (OSError, EOFError, zlib.error, OtlpPayloadError) as exc:
            self._reject(HTTPStatus.BAD_REQUEST, "encoding", f"bad gzip body: {exc}", as_protobuf)
            return None
        try:
            if content_type == JSON_CONTENT_TYPE:
                return parse_otlp_json(body)
            if as_protobuf:
                return parse_otlp_protobuf(body)
        except ProtobufNotSupportedError as exc:
            self._reject(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "protobuf", str(exc), as_protobuf=False)
            return None
        except OtlpPayloadError as exc:
            self._reject(HTTPStatus.BAD_REQUEST, "malformed", str(exc), as_protobuf)
            return None
        except Exception as exc:  # a bad payload the decoder did not foresee: still a 400
            log.debug("unexpected error decoding an OTLP payload", exc_info=True)
            message = f"body could not be decoded ({type(exc).__name__})"
            self._reject(HTTPStatus.BAD_REQUEST, "malformed", message, as_protobuf)
            return None
        self._reject(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            "content_type",
            f"Content-Type {content_type!r} is not supported; use {JSON_CONTENT_TYPE} "
            f"or {PROTOBUF_CONTENT_TYPE}",
            as_protobuf=False,
        )
        return None


def _refuse(sock: socket.socket) -> None:
    """Answer 503 without blocking the accept loop (the connection is over the limit)."""
    body = json.dumps(
        {"code": _UNAVAILABLE, "message": "too many OTLP connections; retry later"}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        f"Content-Type: {JSON_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n"
        "Retry-After: 1\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        sock.setblocking(False)
        sock.send(head + body)
    except OSError:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() joins the handler threads itself, with a time limit
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: connections over the cap get their 503 promptly

    def __init__(self, address: tuple[str, int], owner: OtlpReceiver) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.connections: dict[socket.socket, _Connection] = {}
        super().__init__(address, _Handler)

    def connection(self, sock: socket.socket) -> _Connection:
        with self.lock:
            return self.connections.get(sock) or _Connection(deadline=None)

    def arm(self, state: _Connection) -> None:
        with self.lock:
            state.deadline = time.monotonic() + self.owner.read_timeout_s

    def disarm(self, state: _Connection) -> bool:
        """Stop the clock (the request is read); whether it had already run out."""
        with self.lock:
            state.deadline = None
            return state.timed_out

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            admitted = len(self.connections) < self.owner.max_connections
            if admitted:
                state = _Connection(deadline=time.monotonic() + self.owner.read_timeout_s)
                self.connections[request] = state
        if not admitted:
            self.owner._count_rejected(
                "overloaded",
                f"over {self.owner.max_connections} connections at once",
                str(client_address[0]),
            )
            _refuse(request)
            self.shutdown_request(request)
            return
        state.thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name="otlp-connection",
            daemon=True,
        )
        state.thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.connections.pop(request, None)

    def service_actions(self) -> None:
        """Called by the accept loop every poll interval: cut off requests past their deadline."""
        now = time.monotonic()
        with self.lock:
            late = [
                sock
                for sock, state in self.connections.items()
                if state.deadline is not None and now >= state.deadline
            ]
            for sock in late:
                state = self.connections[sock]
                state.timed_out, state.deadline = True, None
        for sock in late:  # the handler's blocked read returns EOF; its answer can still go out
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)

    def close_all(self, join_timeout_s: float) -> None:
        with self.lock:
            open_connections = list(self.connections.items())
        for sock, _ in open_connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + join_timeout_s
        for _, state in open_connections:
            if state.thread is not None:
                state.thread.join(max(deadline - time.monotonic(), 0.0))

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("OTLP connection from %s ended with an error", client_address, exc_info=True)


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
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stats = ReceiverStats()
        self._last_warning: dict[str, float] = {}

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the OTLP receiver is not started; call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The endpoint to give an exporter, e.g. Triton's `opentelemetry,url=`."""
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    @property
    def active_connections(self) -> int:
        server = self._server
        if server is None:
            return 0
        with server.lock:
            return len(server.connections)

    def start(self) -> OtlpReceiver:
        if self._server is not None:
            return self
        try:
            self._server = _Server((self.host, self.requested_port), self)
        except OSError as exc:
            raise OSError(
                f"cannot listen for OTLP on {self.host}:{self.requested_port}: {exc.strerror}; "
                "pick another --otlp-port"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": min(0.2, self.read_timeout_s / 4)},
            name="otlp-receiver",
            daemon=True,
        )
        self._thread.start()
        log.info("OTLP receiver listening on %s", self.url)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_all(join_timeout_s=5.0)
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

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

    def _count_rejected(self, reason: str, message: str, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._stats.rejected += 1
            self._stats.rejected_by_reason[reason] = (
                self._stats.rejected_by_reason.get(reason, 0) + 1
            )
            loud = now - self._last_warning.get(reason, -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S
            if loud:
                self._last_warning[reason] = now
        # a flood of bad payloads must not flood the log: one warning per reason and minute
        level = logging.WARNING if loud else logging.DEBUG
        log.log(level, "rejected OTLP request from %s (%s): %s", peer, reason, message[:300])

    def _deliver(self, spans: list[OtlpSpan]) -> None:
        with self._lock:
            self._stats.accepted += 1
            self._stats.spans += len(spans)
        if not spans:
            return
        try:
            self.on_spans(spans)
        except Exception:  # telemetry never raises into the exporter's request
            log.exception("the OTLP span callback failed; %d spans lost", len(spans))
            with self._lock:
                self._stats.callback_errors += 1

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
