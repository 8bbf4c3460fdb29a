"""The HTTP/1.1 relay: one backend connection per client connection, bytes forwarded unchanged.

Built like the gRPC relay (`proxy/relay.py`) on `asyncio.Protocol` callbacks (run it on
uvloop): a chunk read from one side is written to the other in the same callback. Back-pressure
is per direction: a transport whose write buffer passes its high-water mark pauses reading on
the other side until it drains.

Requests (`request_reader.py`): each header block is held until complete, checked by llhttp and
then forwarded, with the observer's extra header lines; bodies are forwarded as they come.
Responses (`response_reader.py`) are written to the client first and then parsed: each final
response ends the call at the head of the connection's FIFO (`calls.py`), so pipelined
requests are matched with their responses in order.

Refusals (`refusals.py`): a malformed request, an ambiguous one (Content-Length with Transfer-
Encoding, differing Content-Lengths: request smuggling) and an upgrade with a body get 400; a
header block over the limit 431; a body over the limit 413; a header block not complete within
the header timeout 408. The refused request is never forwarded (a chunked body found too long
part-way is cut there). The answer goes to the client once the responses to the requests
before it have been relayed; then the connection is closed. Each is counted in
`xsp_http_refused_total{reason}`.

Upgrade requests: Triton's HTTP endpoint (evhtp) implements no protocol upgrade: it answers a
request with `Connection: upgrade` + `Upgrade: h2c` or `websocket` as if the two fields were not
there (200 over HTTP/1.1, measured on Triton 2.5x), and a CONNECT with 404. The relay forwards
such a request unchanged, so the client gets the server's own answer. llhttp parses no body of
an upgrade request, so one that has a body is refused with 400 (`reason="upgrade"`) instead of
being relayed unchecked. A backend that did answer 101 would turn the connection into an
unobserved tunnel (`response_reader.py`).

Backend down: a client connection whose backend connection cannot be opened gets 503 with a
Triton-style JSON body for its first request (counted as a call with grpc_code UNAVAILABLE and
in `xsp_http_refused_total{reason="backend_unavailable"}`), then is closed; the next client
connection tries the backend again. A backend that closes with requests open ends them as
UNAVAILABLE (the head one answered 503 where none of its response was sent yet).

Timeouts: one sweep per relay (not a timer per request) answers 408 to a header block begun
more than `HttpLimits.header_timeout_s` ago and closes a connection with nothing in flight and
no byte either way for `idle_timeout_s`.

Observation can fail; forwarding must not: an error reading a client's requests (from the
hook's objects, or a bug; `_httppump.c` likewise) or a backend's response stops observing that
connection, counted in `xsp_observation_failures_total` (`http_internal`, `http_response`),
and its bytes go on unobserved, the ones held so far first.

TLS (`ssl_context`, HTTPS): terminated on the client side as the gRPC relay terminates it; the
backend connection stays plain HTTP (Triton's HTTP endpoint has no TLS). A handshake not done
within the header timeout closes the connection, as a slow header block is answered 408.

Shutdown (`shutdown(grace_period)`): stop accepting; each connection is closed as soon as no
request is open or part-way read on it (one gone unobserved, once no byte flowed either way for
`SHUTDOWN_QUIET_S`, as the idle timeout waits on it); after the grace period the rest are
closed (their open calls end as UNAVAILABLE). HTTP/1.1 has no way to tell a client to stop
before a response, so a request sent into that moment sees the connection close, as with any
HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import socket
import ssl
import time
from typing import TYPE_CHECKING, cast

from sidecar.endpoint import Endpoint, translate_bind_errors
from sidecar.proxy import native
from sidecar.proxy.http import refusals
from sidecar.proxy.http.calls import Call, CallBook
from sidecar.proxy.http.limits import HttpLimits
from sidecar.proxy.http.request_reader import Refused, RequestReader
from sidecar.proxy.http.response_reader import BrokenResponse, ResponseReader
from sidecar.proxy.http.routes import HttpRoutes
from sidecar.proxy.http.status import grpc_code
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionInfo, ObserverFactory

if TYPE_CHECKING:
    from sidecar.proxy._httppump import Pump

log = logging.getLogger(__name__)

# The client direction's C `data_received` (`_httppump.c`): whole requests (a Content-Length
# body or none) forwarded and booked with no bytecode while the connection is RELAYING and
# observed; the `data_received` below is the reference and takes every other chunk.
# `native_http_pump` may be set to None to relay through Python only (the tests do).
native_http_pump: type[Pump] | None
_httppump = native.load("_httppump")  # None: not built, or XSP_NATIVE=off
native_http_pump = None if _httppump is None else _httppump.Pump

HIGH_WATER = 1 << 20
LOW_WATER = 256 << 10
CONNECT_TIMEOUT_S = 3.0
LINGER_S = 1.0  # after our last answer and FIN, wait this long for the client to close
SHUTDOWN_QUIET_S = 0.5  # at shutdown, an unobserved connection this quiet is closed
MAX_PENDING = 1 << 20  # client bytes held while the backend connection opens


class State(enum.IntEnum):
    """Where one relayed connection is."""

    CONNECTING = 0  # the backend connection is being opened: client bytes wait in `pending`
    RELAYING = 1  # both sides connected
    UNAVAILABLE = 2  # the backend could not be reached: the first request is answered 503
    REFUSING = 3  # a refusal waits for the responses before it; client bytes are dropped
    CLOSING = 4  # our last answer is sent: waiting for the client to close
    CLOSED = 5  # the client connection is lost


CONNECTING, RELAYING, UNAVAILABLE, REFUSING, CLOSING, CLOSED = State


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _BackendProtocol(asyncio.Protocol):
    """The backend side of one relayed connection."""

    def __init__(self, client: _ClientProtocol) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport
        _nodelay(transport)
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)

    def data_received(self, data: bytes) -> None:
        client = self.client
        client.activity += 1
        try:
            client.transport.write(data)
        except RuntimeError:  # uvloop: the client transport is already closed
            client.backend_lost()
            return
        responses = client.responses
        if responses is not None:
            try:
                responses.feed(data)
            except BrokenResponse as exc:
                client.unobservable(str(exc))
                return
            if responses.tunnel:
                client.unobservable("")
            elif client.state is REFUSING and not client.book.open:
                client.send_refusal()

    def eof_received(self) -> bool:
        client = self.client
        if client.responses is not None:
            with contextlib.suppress(BrokenResponse):
                client.responses.eof()
        client.backend_eof = True
        transport = client.transport
        if client.state is REFUSING and not client.book.open:
            client.send_refusal()
            return False
        if client.client_eof or transport.is_closing() or not transport.can_write_eof():
            return False
        transport.write_eof()
        return True

    def pause_writing(self) -> None:
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        client = self.client
        if client.state is RELAYING and not client.transport.is_closing():
            client.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.backend_lost()


class _ClientProtocol(asyncio.Protocol):
    """The client side of one relayed connection."""

    def __init__(self, relay: HttpRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.backend: asyncio.Transport | None = None
        self.state = CONNECTING
        self.connection_id = next(relay._ids)
        self.pending: list[bytes] = []
        self.book: CallBook = None  # type: ignore[assignment]
        self.requests: RequestReader = None  # type: ignore[assignment]
        self.responses: ResponseReader | None = None  # None: not observed (any more)
        self.refusal: bytes | None = None  # our answer, due once `book.open` is empty
        self.client_eof = False
        self.backend_eof = False
        self.activity = 0  # chunks either way (the idle sweep's clock)
        self._idle_mark = -1
        self._idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._unavailable_text = ""
        # the C data_received of client chunks (None: Python's), routed once the backend is
        # connected and armed by `arm` while RELAYING and observed
        self.pump: Pump | None = None
        if native_http_pump is not None:
            self.pump = native_http_pump(self.data_received, self.close, self.native_failed)
            vars(self)["data_received"] = self.pump  # uvloop calls protocol.data_received

    def arm(self) -> None:
        """Let the C pump take client chunks while RELAYING and observed (after each change
        of `state`, `backend` or `responses`); disarmed, it hands what it holds to Python."""
        pump = self.pump
        if pump is None:
            return
        armed = self.state is RELAYING and self.responses is not None and self.backend is not None
        if pump.armed != armed:
            pump.armed = armed

    # -- client side ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        relay = self.relay
        _nodelay(transport)
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        observer = None
        if relay.observer_factory is not None:
            info = ConnectionInfo(self.connection_id, str(transport.get_extra_info("peername")))
            try:
                observer = relay.observer_factory(info)
            except Exception:
                relay.metrics.observer_errors["connection"] += 1
                log.exception("observer factory failed; connection relayed without observer")
        self.book = CallBook(relay.metrics, observer, self.connection_id)
        self.requests = RequestReader(relay.limits, self.book, relay.routes)
        self.responses = ResponseReader(self.book)
        relay.metrics.connections.inc()
        relay.metrics.connections_active.inc()
        relay.connections.add(self)
        self._idle_since = time.monotonic()
        relay.loop.create_task(self._connect_backend())

    def data_received(self, data: bytes) -> None:
        if self.state is RELAYING:
            self.activity += 1
            backend = self.backend
            assert backend is not None
            if self.responses is None:  # unobserved: a plain pipe
                backend.write(data)
                return
            requests = self.requests
            held = requests.head  # bytes held before this chunk: not forwarded yet
            try:
                pieces = requests.feed(data)
            except Exception as exc:  # observation can fail; forwarding must not
                try:
                    backend.write(held + data if held else data)
                except RuntimeError:
                    self.close()
                self.observation_failed(exc)
                return
            try:
                if pieces is None:
                    backend.write(data)
                elif len(pieces) == 1:
                    backend.write(pieces[0])
                elif pieces:
                    backend.writelines(pieces)
            except RuntimeError:  # uvloop: the backend transport is already closed
                self.close()
                return
            if requests.refused is not None:
                self.refuse(requests.refused)
        elif self.state is CONNECTING:
            self.pending.append(data)
            if sum(map(len, self.pending)) > MAX_PENDING:
                self.transport.pause_reading()
        elif self.state is UNAVAILABLE:
            self._unavailable_data(data)
        # REFUSING, CLOSING: dropped

    def eof_received(self) -> bool:
        self.client_eof = True
        backend = self.backend
        if self.state is CONNECTING:
            return True  # the FIN follows the pending bytes
        if self.state is not RELAYING or backend is None:
            return False
        if self.backend_eof or backend.is_closing() or not backend.can_write_eof():
            return False
        backend.write_eof()
        return True

    def pause_writing(self) -> None:
        if self.backend is not None:
            self.backend.pause_reading()

    def resume_writing(self) -> None:
        if self.backend is not None and not self.backend.is_closing():
            self.backend.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = CLOSED
        if self.pump is not None:
            self.pump.release()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.book.close("CANCELLED")
        if self.backend is not None:
            self.backend.close()
        relay = self.relay
        relay.connections.discard(self)
        relay.metrics.connections_active.dec()

    # -- backend side ---------------------------------------------------------------------

    async def _connect_backend(self) -> None:
        relay = self.relay
        target = relay.backend
        try:
            if target.unix_path:
                coro = relay.loop.create_unix_connection(
                    lambda: _BackendProtocol(self), target.unix_path
                )
            else:
                coro = relay.loop.create_connection(
                    lambda: _BackendProtocol(self), target.host, target.port
                )
            transport, _ = await asyncio.wait_for(coro, relay.connect_timeout)
        except (TimeoutError, OSError) as exc:
            relay.metrics.backend_connect_failures.inc()
            reason = (
                exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            )
            log.warning("backend %s unavailable: %s", target, reason)
            if self.state is not CONNECTING:
                return
            self.state = UNAVAILABLE
            self.book.observer = None  # no call reaches the backend: nothing to sample
            self._unavailable_text = f"xsp-sidecar: backend {target} unavailable ({reason})"
            pending, self.pending = self.pending, []
            for data in pending:
                self._unavailable_data(data)
            if self.state is UNAVAILABLE:
                self.transport.resume_reading()
                if self.client_eof:
                    self._answer_unavailable()
            return
        if self.state is not CONNECTING:  # closed meanwhile
            transport.close()
            return
        backend = cast(asyncio.Transport, transport)
        self.relaying(backend)
        pending, self.pending = self.pending, []
        for data in pending:
            self.data_received(data)
        if self.client_eof and self.state is RELAYING:
            if backend.can_write_eof() and not backend.is_closing():
                backend.write_eof()
            else:
                self.close()
        elif pending:
            self.transport.resume_reading()

    def relaying(self, backend: asyncio.Transport) -> None:
        """The backend connection is open: relay to it (the C pump routed to it and armed)."""
        self.backend = backend
        self.state = RELAYING
        if self.pump is not None:
            self.pump.route(backend, self.requests, self.relay.route_cache, Call)
            self.arm()

    def _unavailable_data(self, data: bytes) -> None:
        """Client bytes while the backend is down: answer the first request with 503."""
        requests = self.requests
        requests.feed(data)
        if self.book.open or requests.refused is not None:
            self._answer_unavailable()

    def _answer_unavailable(self) -> None:
        metrics = self.relay.metrics
        self.book.close("UNAVAILABLE")
        metrics.http_refused.labels(refusals.BACKEND_UNAVAILABLE).inc()
        self.finish(refusals.refusal(refusals.BACKEND_UNAVAILABLE, self._unavailable_text))

    def backend_lost(self) -> None:
        """The backend connection closed: end what is open; the client is closed."""
        state = self.state
        if state is CLOSED or state is CLOSING:
            return
        if state is REFUSING:
            self.book.close("UNAVAILABLE")
            self.send_refusal()
            return
        book = self.book
        head = book.open[0] if book.open else None
        answer = None
        if head is not None and not head.response_start and self.responses is not None:
            text = f"xsp-sidecar: backend {self.relay.backend} closed the connection"
            answer = refusals.refusal(refusals.BACKEND_UNAVAILABLE, text)
        book.close("UNAVAILABLE")
        if answer is not None:
            self.finish(answer)
        elif not self.transport.is_closing():
            self.transport.close()

    def observation_failed(self, exc: BaseException) -> None:
        """Reading this connection's requests raised (the hook's objects, or a bug): it is
        relayed unobserved from then on, counted in `xsp_observation_failures_total{reason=
        "http_internal"}` (the bytes not forwarded yet were written as they are)."""
        if self.responses is None:
            return
        self.relay.metrics.observation_failures.labels("http_internal").inc()
        log.error(
            "connection %d: observing its requests failed; bytes keep flowing unobserved",
            self.connection_id, exc_info=exc,
        )  # fmt: skip
        self.unobservable("")

    def native_failed(self, exc: BaseException, booked: bool) -> None:
        """The C pump met `exc` (`_httppump.c`): booked, after forwarding or booking part of a
        chunk, so observation stops; else Python's reader takes the connection's chunks from
        this one on (and meets the fault again where it is the hook's)."""
        if booked:
            self.observation_failed(exc)
            return
        log.warning(
            "connection %d: the C pump failed (%s: %s); Python's reader goes on with it",
            self.connection_id, type(exc).__name__, exc,
        )  # fmt: skip

    def unobservable(self, reason: str) -> None:
        """Stop observing this connection (a broken response, or a tunnel): bytes go on."""
        if self.responses is None:
            return
        self.responses = None
        self.arm()
        if reason:
            self.relay.metrics.observation_failures.labels("http_response").inc()
            log.warning(
                "connection %d: backend response not understood (%s); bytes keep flowing "
                "unobserved", self.connection_id, reason,
            )  # fmt: skip
        self.book.close("UNKNOWN")
        if self.state is REFUSING:
            self.send_refusal()

    # -- refusals and closing -------------------------------------------------------------

    def refuse(self, refused: Refused) -> None:
        """Answer `refused` once the responses before it are relayed, then close."""
        metrics = self.relay.metrics
        metrics.http_refused.labels(refused.reason).inc()
        log.info("connection %d: refused (%s): %s", self.connection_id, refused.reason,
                 refused.message)  # fmt: skip
        answer = refusals.refusal(refused.reason, refused.message)
        cut = self.requests.call  # a request cut part-way: its response will not come
        if cut is not None:
            self.requests.call = None
            status = refusals.STATUS[refused.reason][0]
            self.book.end(cut, grpc_code(status, refused.message), refused.message)
        self.refusal = answer
        self.state = REFUSING
        self.arm()
        self.transport.pause_reading()
        if not self.book.open or self.responses is None:
            self.send_refusal()

    def send_refusal(self) -> None:
        answer, self.refusal = self.refusal, None
        if answer is None:
            return
        if self.responses is None or self.book.open:
            answer = b""  # the response stream cannot take it: just close
            self.book.close("UNAVAILABLE")
        self.finish(answer)

    def finish(self, answer: bytes) -> None:
        """Write our last answer, close the backend, half-close the client and let it close
        (closing with unread bytes could reset the connection before it reads the answer)."""
        self.state = CLOSING
        backend, self.backend = self.backend, None
        self.arm()
        if backend is not None:
            backend.close()
        transport = self.transport
        if transport.is_closing():
            return
        if answer:
            transport.write(answer)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        with contextlib.suppress(Exception):
            transport.resume_reading()  # read on (dropping the bytes) until the client's FIN
        self._timer = self.relay.loop.call_later(LINGER_S, self.close)

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.backend is not None:
            self.backend.abort()
        self.transport.abort()

    # -- the sweep ------------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing open or part-way read on this connection. An unobserved one shows nothing
        but its bytes, so it counts as idle here and is waited on while they flow (`quiet`)."""
        if self.responses is None:
            return True
        return not self.book.open and not self.requests.in_message()

    def quiet(self, now: float, seconds: float) -> bool:
        """Idle, and no chunk either way for `seconds` s (called on a clock: each call marks)."""
        activity = self.activity + (0 if self.pump is None else self.pump.chunks)
        if activity != self._idle_mark or not self.idle():
            self._idle_mark = activity
            self._idle_since = now
            return False
        return now - self._idle_since >= seconds

    def sweep(self, now: float, limits: HttpLimits) -> None:
        """Answer a header block trickling in too long with 408; close one idle too long."""
        requests = self.requests
        state = self.state
        if state is not RELAYING and state is not UNAVAILABLE and state is not CONNECTING:
            return
        if requests.head and now - requests.head_since > limits.header_timeout_s:
            refused = Refused(refusals.HEADER_TIMEOUT, "request header block timed out")
            requests.head = b""
            requests.refused = refused
            if state is UNAVAILABLE:
                self._answer_unavailable()
            else:
                self.refuse(refused)
            return
        if limits.idle_timeout_s is not None and self.quiet(now, limits.idle_timeout_s):
            self.finish(b"")


class HttpRelay:
    """Accepts HTTP/1.1 client connections and relays each to its own backend connection."""

    def __init__(
        self,
        backend: Endpoint,
        routes: HttpRoutes,
        metrics: ProxyMetrics,
        observer_factory: ObserverFactory | None = None,
        limits: HttpLimits = HttpLimits(),  # noqa: B008 (frozen)
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.backend = backend
        self.routes = routes
        self.metrics = metrics
        self.observer_factory = observer_factory
        self.limits = limits
        self.connect_timeout = connect_timeout
        self.ssl_context = ssl_context  # TLS terminated on the client side (HTTPS)
        self.connections: set[_ClientProtocol] = set()
        # request line up to its version -> (method label, model): the C pump's routes
        self.route_cache: dict[bytes, tuple[str, str | None]] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def start(self, listen: Endpoint) -> Endpoint:
        """Start listening; returns the bound address (useful with port 0)."""
        self.loop = asyncio.get_running_loop()
        context = self.ssl_context
        # a client that opens a connection and never ends its handshake is a header trickle
        # too: it gets the header block's time
        handshake = self.limits.header_timeout_s if context is not None else None
        with translate_bind_errors(str(listen), "HTTP clients", "--http-listen"):
            if listen.unix_path:
                self._server = await self.loop.create_unix_server(
                    lambda: _ClientProtocol(self), listen.unix_path, ssl=context,
                    ssl_handshake_timeout=handshake,
                )  # fmt: skip
            else:
                self._server = await self.loop.create_server(
                    lambda: _ClientProtocol(self), listen.host, listen.port, reuse_address=True,
                    ssl=context, ssl_handshake_timeout=handshake,
                )  # fmt: skip
        self._schedule_sweep()
        if listen.unix_path:
            return listen
        sockname = self._server.sockets[0].getsockname()
        return Endpoint(sockname[0], int(sockname[1]))

    def _schedule_sweep(self) -> None:
        limits = self.limits
        interval = min(limits.header_timeout_s / 4, 1.0)
        if limits.idle_timeout_s is not None:
            interval = min(interval, limits.idle_timeout_s / 4)
        self._sweep_handle = self.loop.call_later(interval, self._sweep)

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self.connections):
            try:
                conn.sweep(now, self.limits)
            except Exception:  # never let one connection stop the sweep
                log.exception("connection %d: sweep failed", conn.connection_id)
                conn.abort()
        self._schedule_sweep()

    def in_flight(self) -> int:
        """Requests forwarded whose responses have not ended."""
        return sum(len(c.book.open) for c in self.connections if c.book is not None)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def shutdown(self, grace_period: float) -> None:
        """Stop accepting; close each connection once idle, for up to `grace_period` s; then
        close what is left (its open calls end as UNAVAILABLE)."""
        self.stop_accepting()
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        loop = self.loop
        deadline = loop.time() + grace_period
        while True:
            now = time.monotonic()  # (the sweep's clock: `quiet` keeps its marks)
            for conn in list(self.connections):
                if conn.state is RELAYING and (
                    conn.quiet(now, SHUTDOWN_QUIET_S) if conn.responses is None else conn.idle()
                ):
                    conn.finish(b"")
                elif conn.state is UNAVAILABLE or conn.state is CONNECTING:
                    conn.close()
            if not self.connections or loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.book.close("UNAVAILABLE")
            conn.abort()
        await asyncio.sleep(0)  # let connection_lost run
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
