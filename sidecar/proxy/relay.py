"""The relay: one backend connection per client connection, bytes forwarded unchanged.

Built on `asyncio.Protocol` callbacks (run it on uvloop) rather than streams: a chunk read from
one side is written to the other in the same callback and then scanned (`streams.py`).
Back-pressure is per direction: when a transport's write buffer passes its high-water mark,
its protocol's `pause_writing()` pauses reading on the opposite side until `resume_writing()`.

If the backend refuses the connection, the client is answered with gRPC UNAVAILABLE
(`unavailable.py`); the next client connection tries the backend again.

Closing: a FIN from one side is passed on as a FIN (`write_eof`) to the other; once both
directions have ended, or either side is gone, the pair is closed. A connection with no call in
flight for `idle_timeout` seconds (for one the scanner cannot observe: no bytes either way) is
*drained*: the backend connection is closed, the client gets a GOAWAY (when the backend's frames
end on a frame boundary) and a FIN, and is closed if it does not close first within
`DRAIN_LINGER_S`. Shutdown drains each connection as soon as it has nothing in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from typing import cast

from sidecar.endpoint import Endpoint, translate_bind_errors
from sidecar.proxy.frames import FrameScanner, goaway_frame
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.model_name import UNKNOWN_MODEL, method_info
from sidecar.proxy.streams import ConnectionInfo, ConnectionTracker, ObserverFactory
from sidecar.proxy.unavailable import UnavailableResponder

log = logging.getLogger(__name__)

HIGH_WATER = 1 << 20
LOW_WATER = 256 << 10
CONNECT_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 300.0  # drain a connection with no call in flight for this long
DRAIN_LINGER_S = 1.0  # after GOAWAY + FIN, wait this long for the client to close first
SHUTDOWN_QUIET_S = 0.5  # at shutdown, an unobservable connection this quiet is closed


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
        try:
            client.transport.write(data)
        except RuntimeError:  # uvloop: the client transport is already closed
            client.backend_lost()
            return
        scanner = client.response_scanner
        if not scanner.failed:
            scanner.observe(data)
        else:
            client.chunks += 1

    def eof_received(self) -> bool:
        client = self.client
        client.backend_eof = True
        transport = client.transport
        if client.client_eof or transport.is_closing() or not transport.can_write_eof():
            return False  # both directions ended (or no half-close): close the pair
        transport.write_eof()
        return True

    def pause_writing(self) -> None:
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.client.transport.is_closing():
            self.client.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.backend_lost()


class _ClientProtocol(asyncio.Protocol):
    """The client side of one relayed connection."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.backend: asyncio.Transport | None = None
        self.unavailable: UnavailableResponder | None = None
        self.pending: list[bytes] | None = []  # client bytes before the backend connected
        self.closed = False
        self.connection_id = next(relay._ids)
        self.tracker: ConnectionTracker = None  # type: ignore[assignment]
        self.response_scanner: FrameScanner = None  # type: ignore[assignment]
        self.hold = False
        self.client_eof = False  # the client sent FIN
        self.backend_eof = False  # the backend sent FIN
        self.draining = False
        self.chunks = 0  # chunks relayed while unobservable (activity for the idle check)
        self._idle_mark: object = None
        self._idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- client side ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport
        relay = self.relay
        _nodelay(transport)
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        observer = None
        if relay.observer_factory is not None:
            peer = transport.get_extra_info("peername")
            info = ConnectionInfo(self.connection_id, str(peer))
            try:
                observer = relay.observer_factory(info)
            except Exception:
                relay.metrics.observer_errors["connection"] += 1
                log.exception("observer factory failed; connection relayed without observer")
        self.tracker = ConnectionTracker(
            relay.metrics, observer=observer, connection_id=self.connection_id
        )
        self.response_scanner = self.tracker.response_scanner
        self.hold = observer is not None
        relay.metrics.connections.inc()
        relay.metrics.connections_active.inc()
        relay.connections.add(self)
        self._idle_since = relay.loop.time()
        relay.loop.create_task(self._connect_backend())

    def data_received(self, data: bytes) -> None:
        backend = self.backend
        if backend is not None:
            scanner = self.tracker.request_scanner
            try:
                if self.hold:
                    pieces = scanner.process(data)
                    if len(pieces) == 1:
                        backend.write(pieces[0])
                    elif pieces:
                        backend.writelines(pieces)
                    if scanner.failed:
                        self.chunks += 1
                else:
                    backend.write(data)
                    if not scanner.failed:
                        scanner.observe(data)
                    else:
                        self.chunks += 1
            except RuntimeError:  # uvloop: the backend transport is already closed
                self.close()
        elif self.pending is not None:
            self.pending.append(data)
            if sum(map(len, self.pending)) > HIGH_WATER:
                self.transport.pause_reading()
        elif self.unavailable is not None:
            self.unavailable.data_received(data)

    def eof_received(self) -> bool:
        self.client_eof = True
        backend = self.backend
        if backend is None:
            return self.pending is not None  # still connecting: the FIN follows the bytes
        if self.backend_eof or backend.is_closing() or not backend.can_write_eof():
            return False  # both directions ended (or no half-close): close the pair
        backend.write_eof()
        return True

    def pause_writing(self) -> None:
        if self.backend is not None:
            self.backend.pause_reading()

    def resume_writing(self) -> None:
        if self.backend is not None and not self.backend.is_closing():
            self.backend.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.tracker.close("CANCELLED")
        if self.backend is not None:
            self.backend.close()
        if self.unavailable is not None:
            self.unavailable.close()
        relay = self.relay
        relay.connections.discard(self)
        relay.metrics.connections_active.dec()

    # -- backend side ---------------------------------------------------------------------

    async def _connect_backend(self) -> None:
        relay = self.relay
        loop = relay.loop
        target = relay.backend
        try:
            if target.unix_path:
                coro = loop.create_unix_connection(lambda: _BackendProtocol(self), target.unix_path)
            else:
                coro = loop.create_connection(
                    lambda: _BackendProtocol(self), target.host, target.port
                )
            transport, _ = await asyncio.wait_for(coro, relay.connect_timeout)
        except (TimeoutError, OSError) as exc:
            relay.metrics.backend_connect_failures.inc()
            reason = (
                exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            )
            log.warning("backend %s unavailable: %s", target, reason)
            if self.closed:
                return
            pending, self.pending = self.pending or [], None
            self.unavailable = UnavailableResponder(
                self.transport,
                f"xsp-sidecar: backend {target} unavailable ({reason})",
                on_request=self._answered_unavailable,
            )
            for data in pending:
                self.unavailable.data_received(data)
            self.transport.resume_reading()
            return
        if self.closed or self.draining:
            transport.close()
            return
        backend = self.backend = cast(asyncio.Transport, transport)
        pending, self.pending = self.pending or [], None
        for data in pending:
            self.data_received(data)
        if self.client_eof:
            if backend.can_write_eof() and not backend.is_closing():
                backend.write_eof()
            else:
                self.close()
        elif pending:
            self.transport.resume_reading()

    def _answered_unavailable(self, path: bytes) -> None:
        metrics = self.relay.metrics
        method = metrics.method_label(method_info(path).name)
        metrics.record(method, UNKNOWN_MODEL, "UNAVAILABLE", 0.0, 0, 0)

    def backend_lost(self) -> None:
        if self.draining:
            return  # the relay closed the backend on purpose
        self.tracker.close("UNAVAILABLE")
        if not self.transport.is_closing():
            self.transport.close()

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Close both sides now, dropping unsent bytes."""
        if self.backend is not None:
            self.backend.abort()
        self.transport.abort()

    # -- idle connections and shutdown ----------------------------------------------------

    def drain(self) -> None:
        """Close the backend side; tell the client to go away, then close (see module doc)."""
        if self.draining or self.closed:
            return
        self.draining = True
        backend, self.backend = self.backend, None
        self.pending = None  # from now on client bytes are dropped
        if backend is not None:
            backend.close()
        transport = self.transport
        tracker = self.tracker
        if (
            backend is None
            or transport.is_closing()
            or not tracker.response.settings_seen
            or not self.response_scanner.at_frame_boundary()
        ):
            self.close()
            return
        transport.write(goaway_frame(tracker.last_stream_id))
        if not transport.can_write_eof():
            self.close()
            return
        transport.write_eof()
        with contextlib.suppress(Exception):
            transport.resume_reading()  # read on until the client's FIN, dropping the bytes
        self._timer = self.relay.loop.call_later(DRAIN_LINGER_S, self.close)

    def idle_check(self, now: float, timeout: float) -> bool:
        """Whether nothing happened on this connection for `timeout` s (nothing in flight)."""
        tracker = self.tracker
        if tracker.failed:
            mark: object = ("bytes", self.chunks)  # unobservable: bytes are all we see
        elif tracker.streams:
            self._idle_mark = None
            self._idle_since = now
            return False
        else:
            mark = tracker.last_stream_id
        if mark != self._idle_mark:
            self._idle_mark = mark
            self._idle_since = now
        return now - self._idle_since >= timeout


class Relay:
    """Accepts client connections and relays each to its own backend connection."""

    def __init__(
        self,
        backend: Endpoint,
        metrics: ProxyMetrics,
        *,
        observer_factory: ObserverFactory | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        idle_timeout: float | None = IDLE_TIMEOUT_S,
    ) -> None:
        """`idle_timeout`: drain connections with no call in flight this long (None: never)."""
        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError("idle_timeout must be a positive number of seconds or None")
        self.idle_timeout = idle_timeout
        self.backend = backend
        self.metrics = metrics
        self.observer_factory = observer_factory
        self.ssl_context = ssl_context
        self.connect_timeout = connect_timeout
        self.connections: set[_ClientProtocol] = set()
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def start(self, listen: Endpoint) -> Endpoint:
        """Start listening; returns the bound address (useful with port 0)."""
        self.loop = asyncio.get_running_loop()
        with translate_bind_errors(str(listen), "gRPC clients", "--listen"):
            if listen.unix_path:
                self._server = await self.loop.create_unix_server(
                    lambda: _ClientProtocol(self), listen.unix_path, ssl=self.ssl_context
                )
            else:
                self._server = await self.loop.create_server(
                    lambda: _ClientProtocol(self),
                    listen.host,
                    listen.port,
                    ssl=self.ssl_context,
                    reuse_address=True,
                )
        self._schedule_sweep()
        if listen.unix_path:
            return listen
        sockname = self._server.sockets[0].getsockname()
        return Endpoint(sockname[0], int(sockname[1]))

    def _schedule_sweep(self) -> None:
        if self.idle_timeout is not None:
            interval = min(self.idle_timeout / 4, 10.0)
            self._sweep_handle = self.loop.call_later(interval, self._sweep)

    def _sweep(self) -> None:
        """Drain connections idle for `idle_timeout` (one timer for all connections)."""
        assert self.idle_timeout is not None
        now = self.loop.time()
        for conn in list(self.connections):
            if conn.backend is not None and conn.idle_check(now, self.idle_timeout):
                conn.drain()
        self._schedule_sweep()

    @property
    def in_flight(self) -> int:
        return sum(c.tracker.in_flight for c in self.connections if c.tracker is not None)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def shutdown(self, grace_period: float) -> None:
        """Stop accepting; drain each connection once nothing is in flight on it, for up to
        `grace_period` s; then close what is left. Returns as soon as all are closed."""
        self.stop_accepting()
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        loop = self.loop
        deadline = loop.time() + grace_period
        while self.connections and loop.time() < deadline:
            now = loop.time()
            for conn in list(self.connections):
                if conn.draining:
                    continue
                if conn.backend is None:
                    conn.close()  # not connected yet, or answering UNAVAILABLE
                elif not conn.tracker.failed and conn.tracker.in_flight == 0:
                    conn.drain()
                elif conn.tracker.failed and conn.idle_check(now, SHUTDOWN_QUIET_S):
                    conn.drain()  # unobservable: waited on while bytes flow
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let connection_lost run
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
