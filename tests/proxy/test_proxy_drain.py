"""Graceful drain as HTTP/2 defines it (issue 14, part 2; `sidecar/proxy/drain.py`).

Frame building and injection are checked with the `h2` library as the peer; the relay tests
run a real relay in front of a real grpcio backend (`proxy_harness.grpc_backend`), and the
restart test runs `xsp-sidecar serve` as two processes on the same port.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from sidecar.endpoint import Endpoint
from sidecar.proxy import relay as relay_module
from sidecar.proxy.drain import CUT_MESSAGE, DRAIN_PING, RefusingFilter, cut_frames
from sidecar.proxy.frames import (
    CANCEL,
    CONTINUATION,
    DATA,
    FLAG_ACK,
    FLAG_END_HEADERS,
    GOAWAY,
    HEADERS,
    MAX_STREAM_ID,
    PING,
    REFUSED_STREAM,
    RST_STREAM,
    ping_frame,
)
from sidecar.proxy.streams import ConnectionTracker
from tests.harness.process import free_port
from tests.proxy.proxy_h2build import (
    Conversation,
    data_frames,
    grpc_message,
    headers_frames,
    request_headers,
    rst_stream,
)
from tests.proxy.proxy_harness import RelayThread, grpc_backend, unary
from tests.proxy.test_proxy_serve import ports, serve, wait_listening

INFER = "/inference.GRPCInferenceService/ModelInfer"


def _boundaries(data: bytes) -> set[int]:
    """Offsets in a server byte stream where a frame ends outside a header block."""
    out = {0}
    pos = 0
    in_block = False
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        ftype, flags = data[pos + 3], data[pos + 4]
        pos += 9 + length
        if ftype in (HEADERS, CONTINUATION):
            in_block = not flags & FLAG_END_HEADERS
        if not in_block:
            out.add(pos)
    return out


def test_next_boundary_finds_the_first_boundary_outside_a_header_block() -> None:
    conv = Conversation()
    conv.response(1, b"x" * 300)
    conv.request(3, INFER, b"")
    conv.server += headers_frames(
        conv.server_encoder.encode([(":status", "200"), ("content-type", "application/grpc")]),
        3,
        split=7,  # a header block in several CONTINUATION frames
    )
    conv.response(5, None, status=5)
    data = bytes(conv.server)
    truth = sorted(_boundaries(data))
    for k in range(len(data) + 1):
        tracker = ConnectionTracker(_metrics())
        scanner = tracker.response_scanner
        scanner.observe(data[:k])
        off = scanner.next_boundary(data[k:])
        expected = next((b - k for b in truth if b >= k), None)
        assert off == expected, k
        assert (off == 0) == scanner.at_frame_boundary()


def _metrics():  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    from sidecar.proxy.metrics import ProxyMetrics

    return ProxyMetrics(CollectorRegistry())


def _h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    conn.initiate_connection()
    return conn


def _server_preface() -> bytes:
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    return server.data_to_send()


@pytest.mark.parametrize("response_started", [False, True])
def test_cut_frames_end_the_call_with_unavailable_for_an_h2_client(
    response_started: bool,
) -> None:
    client = _h2_client()
    client.send_headers(1, request_headers(INFER))
    wire = _server_preface()
    if response_started:
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()
        server.receive_data(client.data_to_send())
        server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
        server.send_data(1, grpc_message(b"partial"))
        wire = server.data_to_send()
    events = client.receive_data(wire + cut_frames(1, response_started, 16384))
    headers = [e for e in events if isinstance(e, (h2.events.ResponseReceived,
                                                   h2.events.TrailersReceived))]  # fmt: skip
    fields = dict(headers[-1].headers)
    assert fields[b"grpc-status"] == b"14"
    assert (
        b"grace%20period" in fields[b"grpc-message"] or b"grace period" in fields[b"grpc-message"]
    )
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 1 for e in events)
    assert CUT_MESSAGE.startswith("xsp-sidecar")


def _frames(data: bytes) -> list[tuple[int, int, int]]:
    out = []
    pos = 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        out.append((data[pos + 3], int.from_bytes(data[pos + 5 : pos + 9], "big"), length))
        pos += 9 + length
    return out


def test_refusing_filter_drops_refused_streams_and_resets_trailers_once_out_of_step() -> None:
    resets: list[int] = []
    refusing = RefusingFilter(3, resets.append)
    conv = Conversation()
    head = len(conv.client)
    conv.request(3, INFER, None)  # accepted stream 3: headers only so far
    conv.client += data_frames(grpc_message(b"a"), 3)
    conv.request(5, INFER, b"refused", split=4)  # above the last id: never forwarded
    conv.client += rst_stream(5)
    conv.client += headers_frames(conv.client_encoder.encode([("x-trailer", "1")]), 3)
    conv.client += data_frames(b"", 3, end_stream=True)
    data = bytes(conv.client[head:])
    forwarded = b"".join(refusing.process(data[i : i + 5]) for i in range(0, len(data), 5))
    frames = _frames(forwarded)
    assert all(sid != 5 for _, sid, _ in frames)
    # stream 3's trailers came after a dropped header block: reset on both sides instead
    assert frames[-1][:2] == (RST_STREAM, 3)
    assert [f[0] for f in frames] == [HEADERS, DATA, RST_STREAM]
    assert forwarded.endswith(CANCEL.to_bytes(4, "big"))
    assert resets == [3] and refusing.stale


# -- a real relay, an h2 client -------------------------------------------------------------


class _Backend:
    """A grpcio backend whose handler sleeps as long as the request says and records calls."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

        def handler(req: bytes, ctx: grpc.ServicerContext) -> bytes:
            self.calls.append(req)
            time.sleep(float(req.decode() or 0))
            return b"done:" + req

        self.server, self.port = grpc_backend({"ModelInfer": unary(handler)}, workers=32)


@pytest.fixture
def backend() -> Iterator[_Backend]:
    side = _Backend()
    yield side
    side.server.stop(0)


def _send_request(sock: socket.socket, conn: h2.connection.H2Connection, sid: int,
                  body: bytes) -> None:  # fmt: skip
    conn.send_headers(sid, request_headers(INFER))
    conn.send_data(sid, grpc_message(body), end_stream=True)
    sock.sendall(conn.data_to_send())


@pytest.fixture(params=["c data_received", "python data_received"])
def data_received(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The relay's C `data_received` (`_pump.c`, where built), or its Python fallback alone."""
    if request.param.startswith("python"):
        monkeypatch.setattr(relay_module, "native_pump", None)
    elif relay_module.native_pump is None:
        pytest.skip("the relay's C data_received is not built here")
    return str(request.param)


def test_shutdown_two_step_goaway_forwards_racing_streams_and_refuses_later_ones(
    backend: _Backend, data_received: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    states: list[tuple[relay_module.ConnState, bool | None]] = []  # and the C pump armed
    enter = relay_module._ClientProtocol.to

    def recording(self: relay_module._ClientProtocol, state: relay_module.ConnState) -> None:
        enter(self, state)
        pump = self.request_pump
        routed = pump is not None and self.tracker.request_scanner.pump is not None
        states.append((state, pump.armed if routed and pump is not None else None))

    monkeypatch.setattr(relay_module._ClientProtocol, "to", recording)
    relay = RelayThread(Endpoint("127.0.0.1", backend.port))
    try:
        sock = socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=20)
        conn = _h2_client()
        _send_request(sock, conn, 1, b"0.8")
        deadline = time.monotonic() + 10
        while len(backend.calls) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        shutdown = asyncio.run_coroutine_threadsafe(relay.relay.shutdown(20.0), relay.loop)
        events: list[h2.events.Event] = []
        goaways: list[tuple[int, int]] = []
        pings: list[bytes] = []
        raced = refused_sent = False
        buffer = b""
        while chunk := sock.recv(65536):
            buffer += chunk
            # h2 closes its state machine at the first GOAWAY, so GOAWAY and PING are read
            # here and everything else goes to h2.
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                end = 9 + int.from_bytes(buffer[:3], "big")
                frame, buffer = buffer[:end], buffer[end:]
                if frame[3] == GOAWAY:
                    goaways.append((int.from_bytes(frame[9:13], "big"),
                                    int.from_bytes(frame[13:17], "big")))  # fmt: skip
                    if not raced:
                        # A stream the client opened before it read the first GOAWAY.
                        _send_request(sock, conn, 3, b"0")
                        raced = True
                elif frame[3] == PING and not frame[4] & FLAG_ACK:
                    pings.append(frame[9:17])
                    sock.sendall(ping_frame(frame[9:17], ack=True))
                else:
                    events += conn.receive_data(frame)
                    sock.sendall(conn.data_to_send())
            if len(goaways) == 2 and not refused_sent:
                # A client that ignores GOAWAY: its stream 5 must be refused, not forwarded.
                # Encoded with the connection's own HPACK encoder (it adds table entries).
                _send_request(sock, conn, 5, b"0")
                refused_sent = True
        shutdown.result(30)
        assert goaways == [(MAX_STREAM_ID, 0), (3, 0)]
        assert pings.count(DRAIN_PING) == 1  # (the backend may send its own PINGs too)
        ended = {e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)}
        assert ended == {1, 3}  # both accepted streams completed
        trailers = {
            e.stream_id: dict(e.headers)[b"grpc-status"]
            for e in events
            if isinstance(e, h2.events.TrailersReceived)
        }
        assert trailers == {1: b"0", 3: b"0"}
        resets = [(e.stream_id, e.error_code) for e in events
                  if isinstance(e, h2.events.StreamReset)]  # fmt: skip
        assert resets == [(5, REFUSED_STREAM)]
        assert sorted(backend.calls) == [b"0", b"0.8"]  # stream 5 never reached the backend
        registry = relay.registry
        assert registry.get_sample_value("xsp_refused_streams_total") == 1
        failures = [s for m in registry.collect() for s in m.samples
                    if s.name == "xsp_observation_failures_total"]  # fmt: skip
        assert all(s.value == 0 for s in failures)
        ok = registry.get_sample_value(
            "xsp_requests_total",
            {"method": "ModelInfer", "model": "_unknown", "grpc_code": "OK", "protocol": "grpc"},
        )
        assert ok == 2
        sock.close()
    finally:
        relay.stop()
    # the connection's states in order; the C pump (where it runs) takes client chunks only
    # while relaying, before the PING came back
    c = data_received.startswith("c")
    s = relay_module.ConnState
    assert states == [
        (s.RELAYING, True if c else None), (s.ANNOUNCED, True if c else None),
        (s.FINAL_DUE, False if c else None), (s.REFUSING, False if c else None),
        (s.CLOSING, False if c else None), (s.CLOSED, False if c else None),
    ]  # fmt: skip


def test_a_call_longer_than_the_grace_period_is_cut_with_unavailable(
    backend: _Backend, data_received: str
) -> None:
    relay = RelayThread(Endpoint("127.0.0.1", backend.port))
    try:
        with grpc.insecure_channel(relay.address) as channel:
            call = channel.unary_unary(INFER, None, None)
            assert call(b"0", timeout=10) == b"done:0"
            short = call.future(b"0.5", timeout=20)
            long = call.future(b"6", timeout=20)
            deadline = time.monotonic() + 10
            while len(backend.calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            started = time.monotonic()
            relay.run(relay.relay.shutdown(1.5))
            assert time.monotonic() - started < 4
            assert short.result() == b"done:0.5"  # finished within the grace period
            with pytest.raises(grpc.RpcError) as info:
                long.result()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "grace period" in (info.value.details() or "")
    finally:
        relay.stop()


# -- the whole sidecar, restarted on the same port under load -------------------------------

# A client that rides out a restart the way gRPC clients are meant to: every call is
# `wait_for_ready` (it waits for a connection while the port is briefly closed instead of
# failing), and grpcio's transparent retry (on by default) re-sends calls the server reported
# as not processed (streams above a GOAWAY's last-stream-id, RST_STREAM REFUSED_STREAM).
# The reconnect backoff is shortened so the test does not wait seconds for a reconnect.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def test_restart_on_the_same_port_under_continuous_load_fails_no_call(backend: _Backend) -> None:
    listen = free_port()
    args = ["--backend", f"127.0.0.1:{backend.port}", "--listen", f"127.0.0.1:{listen}",
            "--grace-period", "10"]  # fmt: skip
    first = serve(*args, *ports())
    second = None
    stop = threading.Event()
    failures: list[grpc.RpcError] = []
    done: list[float] = []
    lock = threading.Lock()

    def client(channel: grpc.Channel, seconds: str) -> None:
        call = channel.unary_unary(INFER, None, None)
        while not stop.is_set():
            try:
                reply = call(seconds.encode(), timeout=30, wait_for_ready=True)
                assert reply == b"done:" + seconds.encode()
                with lock:
                    done.append(time.monotonic())
            except grpc.RpcError as exc:
                with lock:
                    failures.append(exc)

    try:
        wait_listening(listen, first)
        shared = grpc.insecure_channel(f"127.0.0.1:{listen}", options=CLIENT_OPTIONS)
        own = [
            grpc.insecure_channel(f"127.0.0.1:{listen}",
                                  options=[*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
            for _ in range(3)
        ]  # fmt: skip
        channels = [shared, *own]
        # Eight threads share one connection, so it always has calls in flight (never idle);
        # three more have a connection each, idle between their calls.
        # (Calls of different lengths, so they overlap rather than run in step.)
        threads = [
            threading.Thread(target=client, args=(c, f"{0.03 + 0.007 * i:.3f}"))
            for i, c in enumerate([shared] * 8 + own)
        ]
        for t in threads:
            t.start()
        long_result: dict[str, object] = {}

        def long_call() -> None:
            try:
                long_result["reply"] = shared.unary_unary(INFER, None, None)(
                    b"1.5", timeout=30, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                long_result["error"] = exc

        time.sleep(1.0)
        long_thread = threading.Thread(target=long_call)
        long_thread.start()
        while len(backend.calls) == 0 or b"1.5" not in backend.calls:
            time.sleep(0.01)
        before = len(done)
        first.send_signal(15)  # SIGTERM
        # The old relay stops listening at once; start the new one on the same port.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=0.2).close()
                time.sleep(0.01)
            except OSError:
                break
        second = serve(*args, *ports())
        wait_listening(listen, second)
        restarted = time.monotonic()
        assert first.wait(15) == 0
        while time.monotonic() - restarted < 1.5:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(40)
        long_thread.join(40)
        assert failures == [], [(f.code(), f.details()) for f in failures]
        assert long_result.get("reply") == b"done:1.5", long_result
        assert before > 0 and any(t > restarted for t in done)  # both relays served calls
        for channel in channels:
            channel.close()
    finally:
        stop.set()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
