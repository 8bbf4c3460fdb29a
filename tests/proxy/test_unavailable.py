"""The relay's own UNAVAILABLE answer when the backend is down, driven by a real h2 client
connection over an in-memory transport fake."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import pytest

from sidecar.proxy import unavailable
from sidecar.proxy.unavailable import UnavailableResponder

MESSAGE = "backend 127.0.0.1:8001 is down: [Errno 111] Connection refused (100% sure)"
INFER = b"/inference.GRPCInferenceService/ModelInfer"


class FakeTransport:
    """Records what the responder writes; a write after `write_eof` is an error."""

    def __init__(self, can_eof: bool = True) -> None:
        self.can_eof = can_eof
        self.data = bytearray()
        self.eof = False
        self.closed = False
        self.writes_after_eof = 0

    def write(self, data: bytes) -> None:
        if self.eof or self.closed:
            self.writes_after_eof += 1
        self.data += data

    def can_write_eof(self) -> bool:
        return self.can_eof

    def write_eof(self) -> None:
        assert self.can_eof
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class Client:
    """A real h2 client connection talking to the responder through the fake transport."""

    def __init__(self, transport: FakeTransport, responder: UnavailableResponder) -> None:
        self.transport, self.responder = transport, responder
        self.conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.conn.initiate_connection()
        self.events: list[h2.events.Event] = []

    def request(self, path: bytes = INFER) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                   (b":authority", b"relay"), (b"content-type", b"application/grpc"),
                   (b"te", b"trailers")]  # fmt: skip
        self.conn.send_headers(stream_id, headers)
        self.conn.send_data(stream_id, b"\x00\x00\x00\x00\x02hi", end_stream=True)
        return stream_id

    def send(self) -> None:
        self.responder.data_received(self.conn.data_to_send())

    def receive(self) -> list[h2.events.Event]:
        events = self.conn.receive_data(self.transport.take())
        self.events += events
        return events

    def answers(self) -> dict[int, dict[bytes, bytes]]:
        return {
            e.stream_id: dict(e.headers)
            for e in self.events
            if isinstance(e, h2.events.ResponseReceived)
        }

    def goaway(self) -> bool:
        return any(isinstance(e, h2.events.ConnectionTerminated) for e in self.events)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 5))


@pytest.fixture(autouse=True)
def short_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unavailable, "IDLE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(unavailable, "LINGER_S", 0.05)


def test_a_request_gets_trailers_only_unavailable_then_goaway_and_close() -> None:
    async def test() -> None:
        transport, paths = FakeTransport(), list[bytes]()
        responder = UnavailableResponder(transport, MESSAGE, paths.append)  # type: ignore[arg-type]
        client = Client(transport, responder)
        stream_id = client.request()
        client.send()
        events = client.receive()
        assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events)
        answer = client.answers()[stream_id]
        assert answer[b":status"] == b"200" and answer[b"content-type"] == b"application/grpc"
        assert answer[b"grpc-status"] == b"14"
        assert unquote(answer[b"grpc-message"].decode()) == MESSAGE
        ended = [e for e in events if isinstance(e, h2.events.StreamEnded)]
        assert [e.stream_id for e in ended] == [stream_id]  # trailers-only: no DATA
        assert paths == [INFER]
        assert not client.goaway()
        await asyncio.sleep(0)  # the GOAWAY goes out once this burst's requests are answered
        client.receive()
        assert client.goaway() and transport.eof and not transport.closed
        await asyncio.sleep(unavailable.LINGER_S + 0.05)
        assert transport.closed and responder.closed
        assert transport.writes_after_eof == 0

    run(test)


def test_requests_of_one_burst_are_all_answered() -> None:
    async def test() -> None:
        transport = FakeTransport()
        responder = UnavailableResponder(transport, MESSAGE)  # type: ignore[arg-type]
        client = Client(transport, responder)
        ids = [client.request(), client.request(b"/tensorflow.serving.PredictionService/Predict")]
        client.send()
        client.receive()
        assert sorted(client.answers()) == ids
        assert {a[b"grpc-status"] for a in client.answers().values()} == {b"14"}

    run(test)


def test_nothing_is_written_or_answered_after_the_goaway() -> None:
    async def test() -> None:
        transport, paths = FakeTransport(), list[bytes]()
        responder = UnavailableResponder(transport, MESSAGE, paths.append)  # type: ignore[arg-type]
        client = Client(transport, responder)
        client.request()
        client.send()
        await asyncio.sleep(0)
        assert transport.eof  # the GOAWAY is out; the client has not read it yet
        client.request()  # a late request, crossing the GOAWAY
        client.send()
        client.receive()
        assert client.goaway() and len(client.answers()) == 1 and paths == [INFER]
        assert transport.data == b"" and transport.writes_after_eof == 0
        await asyncio.sleep(unavailable.LINGER_S + 0.05)
        assert transport.closed and transport.writes_after_eof == 0

    run(test)


def test_an_idle_connection_gets_a_goaway() -> None:
    async def test() -> None:
        transport = FakeTransport()
        responder = UnavailableResponder(transport, MESSAGE)  # type: ignore[arg-type]
        client = Client(transport, responder)
        client.send()  # the preface, no request
        client.receive()
        assert not client.goaway()
        await asyncio.sleep(unavailable.IDLE_TIMEOUT_S + 0.05)
        client.receive()
        assert client.goaway() and transport.eof
        await asyncio.sleep(unavailable.LINGER_S + 0.05)
        assert responder.closed and transport.writes_after_eof == 0

    run(test)


def test_invalid_http2_closes_at_once() -> None:
    async def test() -> None:
        transport = FakeTransport()
        responder = UnavailableResponder(transport, MESSAGE)  # type: ignore[arg-type]
        responder.data_received(b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n")
        assert responder.closed and transport.closed
        responder.data_received(b"more")  # ignored
        await asyncio.sleep(unavailable.IDLE_TIMEOUT_S + 0.05)  # no timer fires on a closed one
        assert transport.writes_after_eof == 0

    run(test)


def test_a_client_goaway_closes() -> None:
    async def test() -> None:
        transport = FakeTransport()
        responder = UnavailableResponder(transport, MESSAGE)  # type: ignore[arg-type]
        client = Client(transport, responder)
        client.conn.close_connection()
        client.send()
        assert responder.closed and transport.closed
        responder.close()  # idempotent

    run(test)


def test_a_transport_that_cannot_half_close_is_closed_after_the_linger() -> None:
    async def test() -> None:
        transport = FakeTransport(can_eof=False)
        responder = UnavailableResponder(transport, MESSAGE)  # type: ignore[arg-type]
        client = Client(transport, responder)
        client.request()
        client.send()
        await asyncio.sleep(0)
        client.receive()
        assert client.goaway() and not transport.eof
        await asyncio.sleep(unavailable.LINGER_S + 0.05)
        assert transport.closed

    run(test)
