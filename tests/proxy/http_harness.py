"""The HTTP relay in-process on uvloop, raw-socket HTTP/1.1 exchanges, and the backend's
routes (the record's `http_route` where the backend record has one, else a stand-in)."""

from __future__ import annotations

import re
import socket
import time
from typing import Any, NamedTuple
from urllib.parse import unquote

import httptools
from prometheus_client import CollectorRegistry

from sidecar.endpoint import Endpoint
from sidecar.proxy.http import HttpLimits, HttpRelay
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ObserverFactory
from tests.proxy.proxy_harness import LoopThread


class Routed(NamedTuple):
    method: str
    model: str | None


_M = r"/v2/models/(?P<model>[^/]+)(?:/versions/[^/]+)?"
_TRITON_ROUTES = (
    (b"POST", re.compile(_M + r"/infer"), "ModelInfer"),
    (b"GET", re.compile(_M + r"/ready"), "ModelReady"),
    (b"GET", re.compile(_M + r"/config"), "ModelConfig"),
    (b"GET", re.compile(_M + r"/stats"), "ModelStatistics"),
    (b"GET", re.compile(_M), "ModelMetadata"),
    (b"GET", re.compile(r"/v2/health/live"), "ServerLive"),
    (b"GET", re.compile(r"/v2/health/ready"), "ServerReady"),
    (b"GET", re.compile(r"/v2"), "ServerMetadata"),
)


class TritonRoutesStandIn:
    """Triton's HTTP routes as `Backend.http_route` answers them (issue 42's I1), for the
    relay's tests until the record declares them."""

    def http_route(self, verb: bytes, target: bytes) -> Routed:
        path = target.split(b"?", 1)[0].decode("latin-1")
        for want, pattern, method in _TRITON_ROUTES:
            match = pattern.fullmatch(path)
            if match and verb == want:
                model = match.groupdict().get("model")
                return Routed(method, unquote(model) if model else None)
        return Routed("_unknown", None)


def triton_routes() -> Any:
    """The Triton record where it declares HTTP routes, else the stand-in."""
    from sidecar.backends import TRITON

    if getattr(TRITON, "http_routes", None):
        return TRITON
    return TritonRoutesStandIn()


class HttpRelayThread(LoopThread):
    """Just the HTTP relay, on 127.0.0.1:0."""

    def __init__(
        self,
        backend: str,
        *,
        observer_factory: ObserverFactory | None = None,
        limits: HttpLimits | None = None,
        registry: CollectorRegistry | None = None,
        routes: Any = None,
        ssl_context: Any = None,
    ) -> None:
        super().__init__()
        self.registry = registry or CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry)
        host, port = backend.rsplit(":", 1)
        self.relay = HttpRelay(
            Endpoint(host, int(port)), routes or triton_routes(), self.metrics,
            observer_factory, limits or HttpLimits(), ssl_context=ssl_context,
        )  # fmt: skip
        self.endpoint = self.run(self.relay.start(Endpoint("127.0.0.1", 0)))
        self.address = f"127.0.0.1:{self.endpoint.port}"

    def close(self, grace: float = 0.0) -> None:
        self.run(self.relay.shutdown(grace))
        self.stop()

    def in_loop(self, fn: Any) -> Any:
        """`fn()` run on the relay's loop (to read its counters between events)."""

        async def call() -> Any:
            return fn()

        return self.run(call())


class Response(NamedTuple):
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class _Collector:
    def __init__(self) -> None:
        self.done: list[Response] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.status = 0
        self.parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done.append(Response(self.status, self.headers, bytes(self.body)))
        self.headers, self.body = [], bytearray()


def address_of(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def connect(address: str, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(address_of(address), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_responses(
    sock: socket.socket, count: int, timeout: float = 10.0
) -> tuple[list[Response], bytes]:
    """Read until `count` responses are complete (1xx included) or the peer closes; returns
    them and the raw bytes read."""
    collector = _Collector()
    parser = httptools.HttpResponseParser(collector)
    collector.parser = parser
    raw = bytearray()
    deadline = time.monotonic() + timeout
    while len(collector.done) < count:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(1 << 20)
        except (TimeoutError, ConnectionResetError):
            break
        if not data:
            break
        raw += data
        parser.feed_data(data)
    return collector.done, bytes(raw)


def exchange(address: str, data: bytes, count: int = 1, timeout: float = 10.0) -> list[Response]:
    """Send `data` on a new connection and read `count` responses."""
    with connect(address, timeout) as sock:
        sock.sendall(data)
        return read_responses(sock, count, timeout)[0]


def read_until_close(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Every byte until the peer closes (or `timeout`)."""
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    return bytes(out)


class RecordingBackend:
    """A plain-socket HTTP/1.1 server (not Triton) that records every byte it is sent and
    answers each complete request with `reply(request_number)` (default: 200 "ok"), for the
    byte-exact and broken-backend tests."""

    def __init__(self, reply: Any = None) -> None:
        import threading

        self.reply = reply or (lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        self.received = bytearray()
        self.requests = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while not self._closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        backend = self

        class Sink:
            def on_message_complete(self) -> None:
                backend.requests += 1
                conn.sendall(backend.reply(backend.requests))

        parser = httptools.HttpRequestParser(Sink())
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 20)
                except OSError:
                    return
                if not data:
                    return
                self.received += data
                try:
                    parser.feed_data(data)
                except httptools.HttpParserError:
                    return

    def close(self) -> None:
        self._closed = True
        self.server.close()
