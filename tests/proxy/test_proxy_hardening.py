"""Issue 9, data plane: closed connections do not leak, idle ones are drained, shutdown returns
when nothing is in flight, the UNAVAILABLE responder never writes after its FIN, and a header
block the relay cannot decode does not hide the connection's later calls.

Against the real Triton (`triton` fixture) wherever a backend is needed; waits poll a condition
with a generous deadline (never a timing assertion).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import h2.connection
import h2.events
import pytest
from hpack import Encoder
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sidecar.endpoint import Endpoint
from sidecar.proxy import HeaderDecision, RequestStart, StreamEnd
from sidecar.proxy.frames import FLAG_END_HEADERS, HEADERS, MAX_HEADER_BLOCK, frame_header
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.relay import Relay
from sidecar.proxy.streams import ConnectionTracker
from tests.harness.process import free_port
from tests.proxy.proxy_h2build import (
    Conversation,
    data_frames,
    grpc_message,
    headers_frames,
    request_headers,
)
from tests.proxy.proxy_harness import RelayThread
from tests.proxy.test_proxy_triton import add_sub_request, sleep_request

READY = "/inference.GRPCInferenceService/ServerReady"
INFER = "/inference.GRPCInferenceService/ModelInfer"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def total(relay: RelayThread, name: str) -> float:
    """Sum of a metric's samples over all label values."""
    return sum(
        s.value for metric in relay.registry.collect() for s in metric.samples if s.name == name
    )


def active(relay: RelayThread) -> float:
    return relay.registry.get_sample_value("xsp_connections_active") or 0.0


def relay_state(relay: RelayThread, fn: Callable[[Relay], Any]) -> Any:
    """Read relay state on its own loop thread."""

    async def read() -> Any:
        return fn(relay.relay)

    return relay.run(read())


def recv_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes (socket timeout from the caller)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.fixture
def relay(triton: Any) -> Iterator[RelayThread]:
    side = RelayThread(Endpoint("127.0.0.1", triton.grpc_port))
    yield side
    side.close()


@pytest.mark.triton
def test_closed_connections_release_their_sockets(relay: RelayThread) -> None:
    def cycle() -> None:
        with grpc.insecure_channel(relay.address, options=OWN_CONNECTION) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ModelInfer(add_sub_request(4), timeout=10).model_name == "add_sub"

    cycle()  # warm up: grpcio's own fds, the loop's
    wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "warm-up closed")
    fds = open_fds()
    for _ in range(60):
        cycle()
    wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "pairs closed")
    assert active(relay) == 0
    assert relay.registry.get_sample_value("xsp_connections_total") == 61
    # A leak holds two sockets per cycle (120 here); allow grpcio a few of its own.
    assert open_fds() <= fds + 4


@pytest.mark.triton
def test_fin_only_slowloris_connections_are_closed(relay: RelayThread) -> None:
    partial = [b"", b"PRI * HTTP/2.0\r\n", bytes(Conversation().client)[:40]]
    socks = []
    for i in range(30):
        sock = socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20)
        sock.sendall(partial[i % len(partial)])
        socks.append(sock)
    wait_until(lambda: active(relay) == 30, "all accepted")
    for sock in socks:
        sock.shutdown(socket.SHUT_WR)  # FIN, and never another byte
    for sock in socks:
        recv_until_closed(sock)  # the relay closes its side
        sock.close()
    wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "pairs closed")
    assert active(relay) == 0


def _h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    return conn


def _ready_call(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.send_headers(
        sid,
        [(":method", "POST"), (":scheme", "http"), (":path", READY),
         (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")],
    )  # fmt: skip
    conn.send_data(sid, b"\0\0\0\0\0", end_stream=True)


@pytest.mark.triton
def test_idle_connections_are_drained_with_goaway(triton: Any) -> None:
    relay = RelayThread(Endpoint("127.0.0.1", triton.grpc_port), idle_timeout=0.3)
    try:
        silent = socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20)
        with socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20) as sock:
            conn = _h2_client()
            _ready_call(conn, 1)
            sock.sendall(conn.data_to_send())
            events: list[h2.events.Event] = []
            while not any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
                chunk = sock.recv(65536)
                assert chunk, "closed without a GOAWAY"
                events += conn.receive_data(chunk)
                sock.sendall(conn.data_to_send())
            ended = [e for e in events if isinstance(e, h2.events.StreamEnded)]
            goaway = next(e for e in events if isinstance(e, h2.events.ConnectionTerminated))
            assert [e.stream_id for e in ended] == [1]  # the call went through first
            assert (goaway.error_code, goaway.last_stream_id) == (0, 1)
            recv_until_closed(sock)
        # A connection that never sends a byte is closed too (after Triton's SETTINGS).
        recv_until_closed(silent)
        silent.close()
        wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "drained")
        assert active(relay) == 0
        # A grpcio channel whose connection was drained reconnects on its next call.
        with grpc.insecure_channel(relay.address, options=OWN_CONNECTION) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
            wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "idle")
            assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
    finally:
        relay.close()


@pytest.mark.triton
def test_shutdown_waits_for_in_flight_calls_only(relay: RelayThread) -> None:
    channels = [grpc.insecure_channel(relay.address, options=OWN_CONNECTION) for _ in range(4)]
    try:
        stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]
        for stub in stubs:  # idle connections after a call each
            assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
        slow = stubs[0].ModelInfer.future(sleep_request(1500), timeout=20)
        wait_until(lambda: relay.registry.get_sample_value("xsp_requests_in_flight") == 1, "sent")
        # The grace period is 30 s: returning before it expires means shutdown did not wait
        # for the idle connections, yet it let the in-flight call finish.
        future = asyncio.run_coroutine_threadsafe(relay.relay.shutdown(30.0), relay.loop)
        future.result(timeout=25)
        assert slow.result().model_name == "sleep"
        assert relay_state(relay, lambda r: len(r.connections)) == 0
        assert active(relay) == 0
    finally:
        for channel in channels:
            channel.close()


@pytest.mark.triton
def test_shutdown_with_nothing_in_flight_returns_before_the_grace_period(
    relay: RelayThread,
) -> None:
    with grpc.insecure_channel(relay.address, options=OWN_CONNECTION) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
        garbage = socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20)
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # unobservable
        half = socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20)
        half.sendall(b"PRI * HTTP/2.0\r\n")
        wait_until(lambda: active(relay) >= 2, "connections open")
        future = asyncio.run_coroutine_threadsafe(relay.relay.shutdown(30.0), relay.loop)
        future.result(timeout=25)
        assert relay_state(relay, lambda r: len(r.connections)) == 0
        assert active(relay) == 0
        garbage.close()
        half.close()


def test_backend_down_never_writes_after_eof(caplog: pytest.LogCaptureFixture) -> None:
    relay = RelayThread(Endpoint("127.0.0.1", free_port()))  # nothing listens there
    errors: list[dict[str, Any]] = []
    relay.loop.call_soon_threadsafe(
        relay.loop.set_exception_handler, lambda loop, ctx: errors.append(ctx)
    )
    try:
        # A client that keeps sending requests after the relay's GOAWAY and FIN.
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20) as sock:
                conv = Conversation()
                conv.request(1, READY, b"")
                sock.sendall(bytes(conv.client))
                received = b""
                while b"grpc-status" not in received and (chunk := sock.recv(65536)):
                    received += chunk
                wait_until(lambda: _relay_sent_fin(sock), "relay half-closed")
                start = len(conv.client)
                for sid in (3, 5, 7):
                    conv.request(sid, READY, b"")
                with contextlib.suppress(OSError):  # the relay may have closed already
                    sock.sendall(bytes(conv.client[start:]))
                    recv_until_closed(sock)

        # And several grpcio clients with concurrent calls on each channel.
        def client() -> None:
            with grpc.insecure_channel(relay.address, options=OWN_CONNECTION) as channel:
                call = channel.unary_unary(READY, None, None)
                futures = [call.future(b"", timeout=10) for _ in range(10)]
                for f in futures:
                    with pytest.raises(grpc.RpcError) as info:
                        f.result()
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "closed")
    finally:
        relay.close()
    assert errors == []
    assert not [r for r in caplog.records if "write_eof" in r.getMessage()]


def _relay_sent_fin(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)
        sock.settimeout(20)


class _Profiler:
    """Observer recording which requests carried `x-xsp-profile` and every stream end."""

    def __init__(self) -> None:
        self.flagged: list[int] = []
        self.ends: list[StreamEnd] = []

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | None:
        if "x-xsp-profile" in start.metadata:
            self.flagged.append(start.stream_id)
            return HeaderDecision(capture_body=True)
        return None

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        pass

    def on_stream_end(self, end: StreamEnd) -> None:
        self.ends.append(end)


@pytest.mark.triton
@pytest.mark.parametrize("size", [2 << 20, 200_000])
def test_huge_header_does_not_hide_later_calls(triton: Any, size: int) -> None:
    profiler = _Profiler()
    relay = RelayThread(
        Endpoint("127.0.0.1", triton.grpc_port), observer_factory=lambda info: profiler
    )
    try:
        with grpc.insecure_channel(relay.address, options=OWN_CONNECTION) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            req = add_sub_request(4)
            assert stub.ModelInfer(req, timeout=10).model_name == "add_sub"
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(req, metadata=[("x-big", "a" * size)], timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for i in range(15):
                md = [("x-xsp-profile", "1")] if i % 3 == 0 else []
                assert stub.ModelInfer(req, metadata=md, timeout=10).model_name == "add_sub"
        wait_until(lambda: relay_state(relay, lambda r: len(r.connections)) == 0, "closed")
        assert total(relay, "xsp_requests_total") == 17  # every call counted
        # ... and every later call fully observed: method, model and its x-xsp-profile header.
        assert (
            relay.registry.get_sample_value(
                "xsp_requests_total",
                {"method": "ModelInfer", "model": "add_sub", "grpc_code": "OK", "protocol": "grpc"},
            )
            == 16
        )
        assert len(profiler.flagged) == 5
        oversize = 1 if size > MAX_HEADER_BLOCK else 0  # only the huge block itself is unread
        assert relay.registry.get_sample_value("xsp_unobserved_streams_total") == oversize
        failures = relay.registry.get_sample_value(
            "xsp_observation_failures_total", {"reason": "oversize"}
        )
        assert (failures or 0) == oversize
    finally:
        relay.close()


# -- scanner level: real HPACK encoders (the `hpack` library) on both sides ------------------


def _scan_split(client: bytes, server: bytes, step: int, hold: bool) -> tuple[Any, Any, bytes]:
    reg = CollectorRegistry()
    profiler = _Profiler()
    tracker = ConnectionTracker(ProxyMetrics(reg), observer=profiler if hold else None)
    out = b""
    for i in range(0, len(client), step):
        chunk = client[i : i + step]
        if hold:
            out += b"".join(tracker.request_scanner.process(chunk))
        else:
            tracker.request_scanner.observe(chunk)
    for i in range(0, len(server), step):
        tracker.response_scanner.observe(server[i : i + step])
    return reg, tracker, out


def _ok(reg: Any, model: str) -> float:
    labels = {"method": "ModelInfer", "model": model, "grpc_code": "OK", "protocol": "grpc"}
    return reg.get_sample_value("xsp_requests_total", labels) or 0.0


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("step", [7, 1000, 300_000])
@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("pad", [0, 5])
def test_oversize_block_keeps_the_hpack_table_in_step(
    hold: bool, step: int, indexed: bool, pad: int
) -> None:
    conv = Conversation()
    conv.request(1, INFER, b"\x0a\x03one")
    conv.response(1, b"ok")
    # 1.2 MB of metadata in CONTINUATION frames: added to the table (which it empties), or
    # never indexed; other fields of the block are added to the table as usual.
    fields: list[Any] = [
        *request_headers(INFER),
        ("x-big", "b" * 1_200_000, not indexed),
        ("x-small", "kept"),
    ]
    block = conv.client_encoder.encode(fields, huffman=False)
    conv.client += headers_frames(block, 3, split=16384, pad=pad)
    conv.client += _data(grpc_message(b"\x0a\x03two"), 3)
    conv.response(3, None, status=8)
    # Later requests refer to entries the encoder added before and during the big block.
    for sid in (5, 7):
        conv.request(sid, INFER, b"\x0a\x05three", metadata=[("x-small", "kept")])
        conv.response(sid, b"ok")
    reg, tracker, out = _scan_split(bytes(conv.client), bytes(conv.server), step, hold)
    assert not tracker.failed
    assert _ok(reg, "one") == 1 and _ok(reg, "three") == 2
    assert reg.get_sample_value("xsp_unobserved_streams_total") == 1
    assert reg.get_sample_value("xsp_observation_failures_total", {"reason": "oversize"}) == 1
    assert reg.get_sample_value("xsp_requests_in_flight") == 0
    if hold:
        assert out == bytes(conv.client)  # nothing held back, nothing changed


def _data(payload: bytes, sid: int) -> bytes:
    return data_frames(payload, sid, end_stream=True)


def test_bad_hpack_restarts_the_table_and_later_calls_are_counted() -> None:
    conv = Conversation()
    conv.request(1, INFER, b"\x0a\x03one")
    conv.response(1, b"ok")
    # Stream 3: an index no table has (HPACK the relay cannot decode; so would the backend).
    conv.client += headers_frames(b"\xff\xff\x7f", 3)
    conv.client += _data(grpc_message(b"\x0a\x03two"), 3)
    conv.response(3, None, status=13)
    # Stream 5 refers to entries from before: counted by stream id, method and model unknown.
    conv.request(5, INFER, b"\x0a\x05three")
    conv.response(5, b"ok")
    # The client restarts its table (size update to 0, then back): observed again.
    fresh = Encoder()
    block = b"\x20\x3f\xe1\x1f" + fresh.encode(request_headers(INFER))
    conv.client += headers_frames(block, 7)
    conv.client += _data(grpc_message(b"\x0a\x04four"), 7)
    conv.response(7, b"ok")
    conv.client_encoder = fresh
    conv.request(9, INFER, b"\x0a\x04four")  # refers to what stream 7 added
    conv.response(9, b"ok")
    for hold in (False, True):
        reg, tracker, _ = _scan_split(bytes(conv.client), bytes(conv.server), 11, hold)
        assert not tracker.failed
        assert _ok(reg, "one") == 1 and _ok(reg, "four") == 2
        unknown = {"method": "_unknown", "model": "_unknown", "protocol": "grpc"}
        assert reg.get_sample_value("xsp_requests_total", {**unknown, "grpc_code": "INTERNAL"}) == 1
        assert reg.get_sample_value("xsp_requests_total", {**unknown, "grpc_code": "OK"}) == 1
        assert reg.get_sample_value("xsp_unobserved_streams_total") == 2
        assert reg.get_sample_value("xsp_observation_failures_total", {"reason": "hpack"}) == 1


def test_16mb_header_frame_is_counted_and_observation_goes_on() -> None:
    conv = Conversation()
    conv.request(1, INFER, b"\x0a\x03one")
    conv.response(1, b"ok")
    junk = b"\xff" * ((1 << 24) - 1)  # not HPACK at all, in one frame
    conv.client += frame_header(len(junk), HEADERS, FLAG_END_HEADERS, 3) + junk
    conv.client += _data(grpc_message(b""), 3)
    conv.response(3, None, status=8)
    conv.request(5, INFER, b"\x0a\x03one")
    conv.response(5, b"ok")
    reg, tracker, _ = _scan_split(bytes(conv.client), bytes(conv.server), 256 << 10, False)
    assert not tracker.failed
    assert reg.get_sample_value("xsp_observation_failures_total", {"reason": "oversize"}) == 1
    # The junk block left the table unknown: stream 5 is counted too, by stream id.
    assert reg.get_sample_value("xsp_unobserved_streams_total") == 2
    assert _ok(reg, "one") == 1
    assert (
        reg.get_sample_value(
            "xsp_requests_total",
            {"method": "_unknown", "model": "_unknown", "grpc_code": "OK", "protocol": "grpc"},
        )
        == 1
    )
