"""The relay: one backend connection per client connection, bytes forwarded unchanged.

Built on `asyncio.Protocol` callbacks (run it on uvloop) rather than streams: a chunk read from
one side is written to the other in the same callback and then scanned (`streams.py`).
Back-pressure is per direction: when a transport's write buffer passes its high-water mark,
its protocol's `pause_writing()` pauses reading on the opposite side until `resume_writing()`.

If the backend refuses the connection, the client is answered with gRPC UNAVAILABLE
(`unavailable.py`); the next client connection tries the backend again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import socket
import ssl
import time
from dataclasses import dataclass
from typing import cast

from sidecar.proxy.frames import FrameScanner
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.model_name import UNKNOWN_MODEL, method_info
from sidecar.proxy.streams import ConnectionInfo, ConnectionTracker, ObserverFactory
from sidecar.proxy.unavailable import UnavailableResponder

log = logging.getLogger(__name__)

HIGH_WATER = 1 << 20
LOW_WATER = 256 << 10
CONNECT_TIMEOUT_S = 3.0


class PortInUseError(OSError):
    """A listening port is already taken by another process."""


@dataclass(frozen=True)
class Endpoint:
    """A TCP `host:port` or a Unix socket path."""

    host: str = ""
    port: int = 0
    unix_path: str | None = None

    def __str__(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"


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
        try:
            self.client.transport.write(data)
        except RuntimeError:  # uvloop: the client transport is already closed
            self.client.backend_lost()
            return
        scanner = self.client.response_scanner
        if not scanner.failed:
            scanner.observe(data)

    def eof_received(self) -> bool:
        client = self.client.transport
        if client.can_write_eof() and not client.is_closing():
            client.write_eof()
            return True
        return False

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
                log.exception("observer factory failed; connection relayed without observer")
        self.tracker = ConnectionTracker(
            relay.metrics, observer=observer, connection_id=self.connection_id
        )
        self.response_scanner = self.tracker.response_scanner
        self.hold = observer is not None
        relay.metrics.connections.inc()
        relay.metrics.connections_active.inc()
        relay.connections.add(self)
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
                else:
                    backend.write(data)
                    if not scanner.failed:
                        scanner.observe(data)
            except RuntimeError:  # uvloop: the backend transport is already closed
                self.close()
        elif self.pending is not None:
            self.pending.append(data)
            if sum(map(len, self.pending)) > HIGH_WATER:
                self.transport.pause_reading()
        elif self.unavailable is not None:
            self.unavailable.data_received(data)

    def eof_received(self) -> bool:
        backend = self.backend
        if backend is not None and backend.can_write_eof() and not backend.is_closing():
            backend.write_eof()
            return True
        return False

    def pause_writing(self) -> None:
        if self.backend is not None:
            self.backend.pause_reading()

    def resume_writing(self) -> None:
        if self.backend is not None and not self.backend.is_closing():
            self.backend.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
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
        if self.closed:
            transport.close()
            return
        self.backend = cast(asyncio.Transport, transport)
        pending, self.pending = self.pending or [], None
        for data in pending:
            self.data_received(data)
        if pending:
            self.transport.resume_reading()

    def _answered_unavailable(self, path: bytes) -> None:
        metrics = self.relay.metrics
        method = metrics.method_label(method_info(path).name)
        metrics.record(method, UNKNOWN_MODEL, "UNAVAILABLE", 0.0, 0, 0)

    def backend_lost(self) -> None:
        self.tracker.close("UNAVAILABLE")
        if not self.transport.is_closing():
            self.transport.close()

    def close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


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
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.observer_factory = observer_factory
        self.ssl_context = ssl_context
        self.connect_timeout = connect_timeout
        self.connections: set[_ClientProtocol] = set()
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def start(self, listen: Endpoint) -> Endpoint:
        """Start listening; returns the bound address (useful with port 0)."""
        self.loop = asyncio.get_running_loop()
        try:
            if listen.unix_path:
                self._server = await self.loop.create_unix_server(
                    lambda: _ClientProtocol(self), listen.unix_path, ssl=self.ssl_context
                )
                return listen
            self._server = await self.loop.create_server(
                lambda: _ClientProtocol(self),
                listen.host,
                listen.port,
                ssl=self.ssl_context,
                reuse_address=True,
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    exc.errno,
                    f"cannot listen on {listen}: the address is already in use "
                    "(choose another with --listen, or stop the process using it)",
                ) from None
            raise
        sockname = self._server.sockets[0].getsockname()
        return Endpoint(sockname[0], int(sockname[1]))

    @property
    def in_flight(self) -> int:
        return sum(c.tracker.in_flight for c in self.connections if c.tracker is not None)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def shutdown(self, grace_period: float) -> None:
        """Stop accepting, wait up to `grace_period` s for in-flight calls, then close all."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_period
        while self.connections and time.monotonic() < deadline:
            for conn in list(self.connections):
                # Idle connections close now; a connection we could not observe is waited on.
                if conn.tracker.in_flight == 0 and not conn.tracker.failed:
                    conn.close()
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
