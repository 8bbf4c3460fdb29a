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
`DRAIN_LINGER_S`.

Shutdown (`Relay.shutdown(grace_period)`, SIGTERM) drains every connection, idle or busy, as
HTTP/2 defines it (`drain.py`): GOAWAY(2^31-1) + PING, then after the PING ACK the final
GOAWAY(last forwarded stream id); streams the client still opens above it get RST_STREAM
REFUSED_STREAM and never reach the backend. A connection is closed (backend closed, FIN to the
client) as soon as its accepted streams have ended; at the end of the grace period the calls
still in flight are ended with grpc-status UNAVAILABLE and what is left is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import socket
import ssl
from typing import TYPE_CHECKING, cast

from sidecar.endpoint import Endpoint, translate_bind_errors
from sidecar.proxy import frames, native
from sidecar.proxy.drain import DRAIN_PING, PING_TIMEOUT_S, RefusingFilter, cut_frames
from sidecar.proxy.frames import (
    CANCEL,
    MAX_STREAM_ID,
    REFUSED_STREAM,
    FrameScanner,
    goaway_frame,
    ping_frame,
    rst_stream_frame,
)
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.model_name import UNKNOWN_MODEL, method_info
from sidecar.proxy.streams import ConnectionInfo, ConnectionTracker, ObserverFactory
from sidecar.proxy.unavailable import UnavailableResponder

if TYPE_CHECKING:
    from collections.abc import Callable

    from sidecar.proxy._pump import Pump

log = logging.getLogger(__name__)

# The relay's C `data_received` (`_pump.c`, built where the C frame walker is): it writes each
# chunk to the other side and walks it in C (sampling on: walks, then writes what is due),
# calling Python only where the scanner must; the `data_received` methods below are the
# reference and the fallback, and handle every chunk while a direction's state wants Python (a
# drain's frames of our own or its refused streams, a failed scanner). `native_pump` may be set
# to None to relay through Python only (the tests do).
native_pump: type[Pump] | None
_pump = native.load("_pump")  # None: not built, or XSP_NATIVE=off
native_pump = None if _pump is None else _pump.Pump

HIGH_WATER = 1 << 20
LOW_WATER = 256 << 10
CONNECT_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 300.0  # drain a connection with no call in flight for this long
DRAIN_LINGER_S = 1.0  # after GOAWAY + FIN, wait this long for the client to close first
SHUTDOWN_QUIET_S = 0.5  # at shutdown, an unobservable connection this quiet is closed
CUT_LINGER_S = 1.0  # after the grace period, wait this long for cut connections to close


class ConnState(enum.IntEnum):
    """Where one relayed connection is: the one state its client protocol is in.

    CONNECTING -> RELAYING, or -> UNAVAILABLE when the backend cannot be reached. A drain at
    shutdown (`drain.py`) goes RELAYING -> ANNOUNCED -> FINAL_DUE (or straight on) -> REFUSING;
    any of them -> CLOSING (`_finish`: the backend closed, the client half-closed) -> CLOSED
    (the client connection lost, from any state). The C pump takes client chunks only while
    RELAYING or ANNOUNCED (`arm_request`).
    """

    CONNECTING = 0  # the backend connection is being opened: client bytes wait in `pending`
    UNAVAILABLE = 1  # the backend could not be reached: the client is answered UNAVAILABLE
    RELAYING = 2  # both sides connected: bytes flow both ways
    ANNOUNCED = 3  # drain step 1 sent or queued (GOAWAY(2^31-1) + PING): still relaying
    FINAL_DUE = 4  # the PING came back: the final GOAWAY goes at the client's next boundary
    REFUSING = 5  # the final GOAWAY is sent: streams above it are refused (`refusing`)
    CLOSING = 6  # the backend is closed and the client half-closed: waiting for it to close
    CLOSED = 7  # the client connection is lost


# the members as plain names: the per-chunk checks below compare them by identity
CONNECTING, UNAVAILABLE, RELAYING, ANNOUNCED, FINAL_DUE, REFUSING, CLOSING, CLOSED = ConnState
# connected to the backend: a transport in `backend`
_CONNECTED = frozenset({RELAYING, ANNOUNCED, FINAL_DUE, REFUSING})


def _pump_in(protocol: asyncio.Protocol, lost: Callable[[], None]) -> Pump | None:
    """Stand a C pump in for `protocol.data_received`, or None where there is none. uvloop
    reads that attribute once, when it attaches the protocol: right after its factory."""
    if native_pump is None or frames.native_walk is None:
        return None
    pump = native_pump(protocol.data_received, lost)
    vars(protocol)["data_received"] = pump
    return pump


def _route(pump: Pump | None, transport: asyncio.Transport, scanner: FrameScanner) -> bool:
    """Give `pump` the transport it writes to and the scanner it walks for; False where there
    is no pump (or no C walk any more)."""
    if pump is None or frames.native_walk is None:
        return False
    pump.route(transport, scanner, frames.native_walk)
    scanner.pump = pump
    return True


def _unroute(pump: Pump | None, scanner: FrameScanner) -> None:
    """The connection is gone: the scanner and the pump let go of each other."""
    if pump is not None:
        scanner.pump = None
        pump.release()


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
        client.response_pump = _pump_in(self, client.backend_lost)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport
        _nodelay(transport)
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        client = self.client
        if _route(client.response_pump, client.transport, client.response_scanner):
            client.arm_response()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client.inject_queue:
            client.backend_data_injecting(data)
            return
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
        client = self.client
        _unroute(client.response_pump, client.response_scanner)
        client.backend_lost()


class _ClientProtocol(asyncio.Protocol):
    """The client side of one relayed connection."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.state = CONNECTING
        self.backend: asyncio.Transport | None = None  # set while connected (`_CONNECTED`)
        self.unavailable: UnavailableResponder | None = None  # set on UNAVAILABLE
        self.pending: list[bytes] | None = []  # client bytes while CONNECTING
        self.connection_id = next(relay._ids)
        self.tracker: ConnectionTracker = None  # type: ignore[assignment]
        self.response_scanner: FrameScanner = None  # type: ignore[assignment]
        self.hold = False
        self.client_eof = False  # the client sent FIN
        self.backend_eof = False  # the backend sent FIN
        self.chunks = 0  # chunks relayed while unobservable (activity for the idle check)
        self._idle_mark: object = None
        self._idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # graceful drain (drain.py)
        self.inject_queue: list[bytes] = []  # our frames for the client, due at a boundary
        self.refusing: RefusingFilter | None = None  # set with the final GOAWAY (REFUSING)
        self._ping_timer: asyncio.TimerHandle | None = None
        # the C data_received of each direction (None: Python's), armed by `arm_request` /
        # `arm_response` while nothing Python must see is pending
        self.request_pump = _pump_in(self, self.close)
        self.response_pump: Pump | None = None  # made with the backend's protocol

    def to(self, state: ConnState) -> None:
        """Enter `state` (every change of state is made here); the C pump of client chunks
        follows it (`arm_request`)."""
        self.state = state
        self.arm_request()

    def arm_request(self) -> None:
        """Let the C pump take client chunks (observed, or held with sampling on, and forwarded)
        while RELAYING or ANNOUNCED and the scanner observes; Python's `data_received` takes
        them in every other state (a final GOAWAY due, streams refused, the backend gone)."""
        pump = self.request_pump
        if pump is None or self.tracker is None:
            return
        scanner = self.tracker.request_scanner
        if scanner.pump is None:
            return  # not routed: no backend yet
        state = self.state
        pump.armed = (state is RELAYING or state is ANNOUNCED) and not scanner.failed

    def arm_response(self) -> None:
        """Let the C pump take backend chunks while no frames of ours wait for a boundary."""
        pump = self.response_pump
        if pump is None or self.response_scanner.pump is None:
            return
        failed = self.response_scanner.failed
        pump.armed = self.state is not CLOSED and not self.inject_queue and not failed

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
            state = self.state
            try:
                if state is REFUSING:
                    assert self.refusing is not None
                    forward = self.refusing.process(data)
                    if forward:
                        backend.write(forward)
                    scanner.observe(data)  # refused header blocks too: HPACK stays in step
                elif self.hold:
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
            if self.state is FINAL_DUE:  # (the scan may have read the PING ACK)
                self._final_goaway()
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
        self.to(CLOSED)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        self.tracker.close("CANCELLED")
        _unroute(self.request_pump, self.tracker.request_scanner)
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
            if self.state is CLOSED:
                return
            if self.state is CONNECTING:
                self.to(UNAVAILABLE)  # (a CLOSING one answers what it still reads so too)
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
        if self.state is not CONNECTING:  # drained or closed meanwhile
            transport.close()
            return
        backend = self.backend = cast(asyncio.Transport, transport)
        _route(self.request_pump, backend, self.tracker.request_scanner)
        self.to(RELAYING)
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
        method = metrics.method_label(method_info(path, metrics.by_path).name)
        metrics.record(method, UNKNOWN_MODEL, "UNAVAILABLE", 0.0, 0, 0)

    def backend_lost(self) -> None:
        if self.state is CLOSING or self.state is CLOSED:
            return  # the relay closed the backend on purpose, or the client is gone
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
        if self.state is CLOSING or self.state is CLOSED:
            return
        transport = self.transport
        tracker = self.tracker
        can_goaway = (
            self.backend is not None
            and not transport.is_closing()
            and tracker.response.settings_seen
            and self.response_scanner.at_frame_boundary()
        )
        if can_goaway and not self.inject_queue:
            transport.write(goaway_frame(tracker.last_stream_id))
        self._finish(can_goaway)

    def _finish(self, graceful: bool = True) -> None:
        """Close the backend side; half-close the client side and wait for it to close."""
        backend, self.backend = self.backend, None
        self.to(CLOSING)
        self.arm_response()
        self.pending = None  # from now on client bytes are dropped
        if backend is not None:
            backend.close()
        transport = self.transport
        if not graceful or transport.is_closing():
            self.close()
            return
        if not transport.can_write_eof():
            self.close()
            return
        transport.write_eof()
        with contextlib.suppress(Exception):
            transport.resume_reading()  # read on until the client's FIN, dropping the bytes
        self._timer = self.relay.loop.call_later(DRAIN_LINGER_S, self.close)

    # -- graceful drain at shutdown (drain.py) --------------------------------------------

    def inject(self, ours: bytes) -> None:
        """Write frames of our own to the client, between two whole frames of the backend's."""
        if self.state is CLOSING or self.state is CLOSED or self.transport.is_closing():
            return
        if (
            not self.inject_queue
            and self.tracker.response.settings_seen
            and self.response_scanner.at_frame_boundary()
        ):
            self.transport.write(ours)
        else:
            self.inject_queue.append(ours)
            self.arm_response()  # backend chunks go through Python until the queue is out

    def backend_data_injecting(self, data: bytes) -> None:
        """Backend bytes while our frames wait: write them at the first frame boundary."""
        scanner = self.response_scanner
        transport = self.transport
        response = self.tracker.response
        off = scanner.next_boundary(data) if response.settings_seen else None
        try:
            if off is None:
                transport.write(data)
                scanner.observe(data)
                if not (response.settings_seen and scanner.at_frame_boundary()):
                    return
                off = len(data)
            elif off:
                transport.write(data[:off])
                scanner.observe(data[:off])
            queued, self.inject_queue = self.inject_queue, []
            self.arm_response()
            transport.writelines(queued)
            rest = data[off:]
            if rest:
                transport.write(rest)
                scanner.observe(rest)
        except RuntimeError:  # uvloop: the client transport is already closed
            self.backend_lost()

    def start_drain(self) -> bool:
        """Step 1: GOAWAY(2^31-1) + PING. False where this connection cannot be drained so
        (not connected to the backend yet, or not observable)."""
        state = self.state
        if state is ANNOUNCED or state is FINAL_DUE or state is REFUSING:
            return True
        if state is not RELAYING or self.tracker.failed:
            return False
        self.to(ANNOUNCED)
        tracker = self.tracker
        tracker.on_ping_ack = self._ping_ack
        tracker.on_refused = self._refused
        self.inject(goaway_frame(MAX_STREAM_ID) + ping_frame(DRAIN_PING))
        self._ping_timer = self.relay.loop.call_later(PING_TIMEOUT_S, self._ping_timeout)
        return True

    def _ping_timeout(self) -> None:
        """No PING ACK: send the final GOAWAY anyway. A client stuck inside a frame (e.g.
        its preface) with no call in flight is told GOAWAY(last) and closed."""
        self._ping_timer = None
        self._final_goaway()
        if self.state is FINAL_DUE and not self.tracker.streams:
            self.drain()

    def _ping_ack(self, payload: bytes) -> None:
        if payload == DRAIN_PING and self.state is ANNOUNCED:
            # sent once the chunk that carried the ACK is scanned
            pump = self.request_pump
            if pump is not None and pump.armed:  # that chunk is in the C pump: no Python after
                self.relay.loop.call_soon(self._final_goaway)
            self.to(FINAL_DUE)  # client chunks go through Python until it is sent

    def _final_goaway(self) -> None:
        """Step 2: GOAWAY(last forwarded stream id); later streams are refused."""
        if self.state is not ANNOUNCED and self.state is not FINAL_DUE:
            return
        tracker = self.tracker
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        if tracker.failed:
            return  # unobservable now: shutdown closes it once quiet
        scanner = tracker.request_scanner
        if not scanner.at_frame_boundary():
            self.to(FINAL_DUE)  # inside a client frame: after the next chunk
            return
        last = tracker.last_stream_id
        tracker.refuse_above = last
        scanner.hold = self.hold = False  # no request is accepted any more: nothing to add
        self.refusing = RefusingFilter(last, self._reset_accepted)
        self.to(REFUSING)  # every client chunk through Python from now on
        self.inject(goaway_frame(last))

    def _refused(self, stream_id: int) -> None:
        self.inject(rst_stream_frame(stream_id, REFUSED_STREAM))

    def _reset_accepted(self, stream_id: int) -> None:
        self.inject(rst_stream_frame(stream_id, CANCEL))
        st = self.tracker.streams.get(stream_id)
        if st is not None:
            self.tracker.end(st, "CANCELLED")

    def drained(self) -> bool:
        """Final GOAWAY sent and every stream it accepted has ended."""
        return self.state is REFUSING and not self.inject_queue and not self.tracker.streams

    def finish_drain(self) -> None:
        self._finish()

    def cut(self) -> None:
        """Grace period over: end the calls in flight with UNAVAILABLE where the response
        byte stream allows it (at a frame boundary), then close."""
        if self.state is CLOSING or self.state is CLOSED:
            return
        tracker = self.tracker
        transport = self.transport
        if (
            self.state not in _CONNECTED
            or tracker.failed
            or transport.is_closing()
            or not tracker.response.settings_seen
            or not self.response_scanner.at_frame_boundary()
        ):
            self.abort()
            return
        out = bytearray(b"".join(self.inject_queue))
        self.inject_queue = []
        self.arm_response()
        if self.state is not REFUSING:
            out += goaway_frame(tracker.last_stream_id)
        max_frame_size = self.response_scanner.max_frame_size
        for st in list(tracker.streams.values()):
            out += cut_frames(st.sid, bool(st.http_status), max_frame_size)
            tracker.end(st, "UNAVAILABLE")
        transport.write(bytes(out))
        self._finish()

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
            if conn.state is RELAYING and conn.idle_check(now, self.idle_timeout):
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
                state = conn.state
                if state is CLOSING or state is CONNECTING:
                    continue  # a CONNECTING one is drained once connected
                if state is UNAVAILABLE:
                    conn.close()
                elif conn.tracker.failed:
                    if conn.idle_check(now, SHUTDOWN_QUIET_S):
                        conn.drain()  # unobservable: waited on while bytes flow
                elif not conn.start_drain():
                    conn.drain()
                elif conn.drained():
                    conn.finish_drain()
            await asyncio.sleep(0.02)
        if self.connections:
            for conn in list(self.connections):
                conn.cut()
            cut_deadline = loop.time() + CUT_LINGER_S
            while self.connections and loop.time() < cut_deadline:
                await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let connection_lost run
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
