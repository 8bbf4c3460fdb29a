"""Speak just enough HTTP/2 to tell a client the backend is down.

When the relay cannot open its backend connection, the client's own HTTP/2 connection is
answered here (with the `h2` library): its preface gets our SETTINGS, every request HEADERS
gets a trailers-only response `grpc-status: 14` (UNAVAILABLE) with a `grpc-message`, then a
GOAWAY, and the connection is closed. A client thus sees an ordinary, quick gRPC UNAVAILABLE,
and its next connection makes the relay try the backend again. After the GOAWAY (and our FIN)
nothing more is written: what the client still sends is read and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from urllib.parse import quote

import h2.config
import h2.connection
import h2.events
import h2.exceptions

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 2.0  # close a connection that sends no request this long after its preface
LINGER_S = 1.0  # after GOAWAY, wait this long for the client to close first


class UnavailableResponder:
    """Answers every gRPC request on one client connection with UNAVAILABLE, then closes."""

    def __init__(
        self,
        transport: asyncio.Transport,
        message: str,
        on_request: Callable[[bytes], None] | None = None,
    ) -> None:
        self.transport = transport
        self.message = message
        self.on_request = on_request  # called with each answered request's :path
        self.closed = False
        self._goaway_sent = False
        self._eof_sent = False
        self._conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self._conn.initiate_connection()
        self._flush()
        loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = loop.call_later(IDLE_TIMEOUT_S, self._goaway)

    def data_received(self, data: bytes) -> None:
        if self.closed or self._goaway_sent:
            return  # after GOAWAY: requests the client still sends are retried elsewhere
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("client spoke invalid HTTP/2 to the unavailable responder: %s", exc)
            self._flush()
            self.close()
            return
        answered = False
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self._answer(event.stream_id)
                answered = True
                if self.on_request is not None:
                    path = dict(event.headers or []).get(b":path", b"")
                    self.on_request(path if isinstance(path, bytes) else path.encode())
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._flush()
                self.close()
                return
        self._flush()
        if answered:
            # Let requests that are already on their way in this burst be answered too.
            asyncio.get_running_loop().call_soon(self._goaway)

    def _answer(self, stream_id: int) -> None:
        headers = [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", b"14"),
            (b"grpc-message", quote(self.message, safe=" ").encode()),
        ]
        try:
            self._conn.send_headers(stream_id, headers, end_stream=True)
        except h2.exceptions.H2Error as exc:  # e.g. the client already reset the stream
            log.debug("could not answer stream %d: %s", stream_id, exc)

    def _goaway(self) -> None:
        if self.closed or self._goaway_sent:
            return
        self._goaway_sent = True
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(h2.exceptions.H2Error):
            self._conn.close_connection()
        self._flush()
        # Half-close and let the client close: closing with unread bytes would reset the
        # connection and could discard the answers before the client reads them.
        transport = self.transport
        self._eof_sent = True  # nothing may be written after write_eof()
        if transport.can_write_eof() and not transport.is_closing():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data and not (self.closed or self._eof_sent or self.transport.is_closing()):
            self.transport.write(data)

    def close(self) -> None:
        """Close the client connection (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.transport.close()
