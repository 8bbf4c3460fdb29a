"""The relay in front of a plain grpcio backend (a real gRPC server standing in for Triton where
Triton cannot be stopped and restarted on demand): passthrough, errors, backend down/up,
health, /metrics over HTTP, header injection, Unix sockets, TLS, streaming."""

from __future__ import annotations

import random
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import start_http_server
from tritonclient.grpc import service_pb2

from sidecar.endpoint import Endpoint
from sidecar.health import BackendChecker
from sidecar.proxy.streams import ConnectionInfo, HeaderDecision, RequestStart, StreamEnd
from sidecar.serve import tls_context
from tests.harness.metrics_text import sample_value, samples, scrape, scrape_registry
from tests.harness.process import free_port
from tests.harness.tls import self_signed
from tests.proxy.proxy_harness import (
    RelayThread,
    SidecarThread,
    grpc_backend,
    server_ready_handler,
    unary,
)

INFER = "/inference.GRPCInferenceService/ModelInfer"
OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def infer_bytes(model: str) -> bytes:
    return service_pb2.ModelInferRequest(model_name=model, id="x").SerializeToString()


def echo(req: bytes, ctx: grpc.ServicerContext) -> bytes:
    parsed = service_pb2.ModelInferRequest.FromString(req)
    if parsed.model_name == "missing":
        ctx.abort(grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'missing' is not found")
    return service_pb2.ModelInferResponse(
        model_name=parsed.model_name, id=parsed.id
    ).SerializeToString()


@pytest.fixture
def backend() -> Iterator[tuple[grpc.Server, int]]:
    server, port = grpc_backend({"ModelInfer": unary(echo), **server_ready_handler()})
    yield server, port
    server.stop(0)


def test_unary_errors_and_metrics_scraped_over_http(backend: tuple[grpc.Server, int]) -> None:
    _, port = backend
    side = SidecarThread(f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(side.address) as channel:
            call = channel.unary_unary(INFER, None, None)
            for _ in range(3):
                reply = service_pb2.ModelInferResponse.FromString(call(infer_bytes("add_sub")))
                assert reply.model_name == "add_sub" and reply.id == "x"
            with pytest.raises(grpc.RpcError) as info:
                call(infer_bytes("missing"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert info.value.details() == "Request for unknown model: 'missing' is not found"
            call(b"")  # no model name at all
        text = scrape(side.metrics_url)
        calls = {"method": "ModelInfer"}
        requests = "xsp_requests_total"
        assert sample_value(text, requests, grpc_code="OK", model="add_sub", **calls) == 3
        assert sample_value(text, requests, grpc_code="NOT_FOUND", model="missing", **calls) == 1
        assert sample_value(text, requests, grpc_code="OK", model="_unknown", **calls) == 1
        assert sample_value(text, "xsp_requests_in_flight") == 0
        assert (sample_value(text, "xsp_connections_total") or 0) >= 1
        count = "xsp_request_duration_seconds_count"
        assert sample_value(text, count, model="add_sub", **calls) == 3
        req_bytes = sample_value(text, "xsp_request_bytes_total", model="add_sub", **calls)
        assert req_bytes == 3 * (5 + len(infer_bytes("add_sub")))
    finally:
        side.close()


def test_backend_down_gives_unavailable_fast_and_relay_recovers() -> None:
    port = free_port()
    relay = RelayThread(Endpoint("127.0.0.1", port))
    server = None
    try:
        with grpc.insecure_channel(relay.address) as channel:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(INFER, None, None)(infer_bytes("add_sub"), timeout=5)
            assert time.monotonic() - start < 1.0
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "backend" in (info.value.details() or "")
        failures = relay.registry.get_sample_value("xsp_backend_connect_failures_total")
        assert failures is not None and failures >= 1
        labels = {
            "method": "ModelInfer",
            "model": "_unknown",
            "grpc_code": "UNAVAILABLE",
            "protocol": "grpc",
        }
        assert relay.registry.get_sample_value("xsp_requests_total", labels) == 1
        server, _ = grpc_backend({"ModelInfer": unary(echo)}, f"127.0.0.1:{port}")
        with grpc.insecure_channel(relay.address) as channel:
            reply = channel.unary_unary(INFER, None, None)(infer_bytes("add_sub"), timeout=5)
            assert service_pb2.ModelInferResponse.FromString(reply).model_name == "add_sub"
    finally:
        if server is not None:
            server.stop(0)
        relay.close()


def test_health_follows_backend_and_reflection_lists_services() -> None:
    port = free_port()
    server, _ = grpc_backend(server_ready_handler(), f"127.0.0.1:{port}")
    side = SidecarThread(f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(side.grpc_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def wait_for(status: int) -> None:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    if stub.Check(health_pb2.HealthCheckRequest()).status == status:
                        return
                    time.sleep(0.05)
                raise AssertionError(f"health never became {status}")

            wait_for(health_pb2.HealthCheckResponse.SERVING)
            up = [x.value for x in samples(scrape(side.metrics_url)) if x.name == "xsp_backend_up"]
            assert up == [1.0]
            server.stop(0)
            wait_for(health_pb2.HealthCheckResponse.NOT_SERVING)
            assert sample_value(scrape(side.metrics_url), "xsp_backend_up") == 0
            server, _ = grpc_backend(server_ready_handler(), f"127.0.0.1:{port}")
            wait_for(health_pb2.HealthCheckResponse.SERVING)

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert "grpc.health.v1.Health" in names
    finally:
        server.stop(0)
        side.close()


def test_health_not_serving_when_backend_not_ready() -> None:
    server, port = grpc_backend({"ServerReady": unary(lambda req, ctx: b"")})  # ready=false
    side = SidecarThread(f"127.0.0.1:{port}")
    try:
        assert side.sidecar.health is not None
        assert side.sidecar.health.check_now() is False
    finally:
        server.stop(0)
        side.close()


class Tracing:
    def __init__(self) -> None:
        self.ends: list[StreamEnd] = []
        self.bodies: list[bytes] = []

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        return HeaderDecision(
            extra_headers=[("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")],
            capture_body=True,
        )

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.bodies.append(body)

    def on_stream_end(self, end: StreamEnd) -> None:
        self.ends.append(end)


def test_observer_injects_traceparent_that_backend_sees() -> None:
    seen: list[str] = []

    def handler(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        md = dict(ctx.invocation_metadata())
        seen.append(str(md.get("traceparent")))
        return req

    server, port = grpc_backend({"ModelInfer": unary(handler)})
    observers: list[Tracing] = []

    def factory(info: ConnectionInfo) -> Tracing:
        observers.append(Tracing())
        return observers[-1]

    relay = RelayThread(Endpoint("127.0.0.1", port), observer_factory=factory)
    try:
        with grpc.insecure_channel(relay.address) as channel:
            call = channel.unary_unary(INFER, None, None)
            for _ in range(3):
                assert call(infer_bytes("m"), metadata=(("x-k", "v"),)) == infer_bytes("m")
        assert seen == ["00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"] * 3
        ends = observers[0].ends
        assert [(e.grpc_code, e.model, e.sampled) for e in ends] == [("OK", "m", True)] * 3
        assert observers[0].bodies[0][5:] == infer_bytes("m")
    finally:
        server.stop(0)
        relay.close()


class FailingObserver(Tracing):
    """Every hook raises; the first header decision asks for a header that cannot be sent."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        self.calls += 1
        if self.calls == 1:
            return HeaderDecision(extra_headers=[("Not-Lowercase", "x")], capture_body=True)
        raise RuntimeError("observer broken at the headers")

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        raise RuntimeError("observer broken at the body")

    def on_stream_end(self, end: StreamEnd) -> None:
        raise RuntimeError("observer broken at the end")


def test_observer_failures_are_counted_and_calls_still_relayed(
    backend: tuple[grpc.Server, int],
) -> None:
    _, port = backend
    relay = RelayThread(Endpoint("127.0.0.1", port), observer_factory=lambda _: FailingObserver())
    server, thread = start_http_server(0, addr="127.0.0.1", registry=relay.registry)
    try:
        with grpc.insecure_channel(relay.address) as channel:
            call = channel.unary_unary(INFER, None, None)
            for _ in range(3):
                reply = service_pb2.ModelInferResponse.FromString(call(infer_bytes("m")))
                assert reply.model_name == "m"
        text = scrape(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        relay.close()
    errors = {
        s.labels["hook"]: s.value for s in samples(text) if s.name == "xsp_observer_errors_total"
    }
    # 1 invalid header field + 2 raising header hooks; only the first call captured its body
    assert errors == {
        "connection": 0, "request_headers": 3, "request_body": 1, "stream_end": 3,
        "stream_message": 0,
    }  # fmt: skip
    ok = {"grpc_code": "OK", "method": "ModelInfer", "model": "m", "protocol": "grpc"}
    assert sample_value(text, "xsp_requests_total", **ok) == 3


def test_a_failing_observer_factory_is_counted_and_the_connection_relayed(
    backend: tuple[grpc.Server, int],
) -> None:
    _, port = backend

    def broken_factory(info: ConnectionInfo) -> Tracing:
        raise RuntimeError("no observer today")

    relay = RelayThread(Endpoint("127.0.0.1", port), observer_factory=broken_factory)
    try:
        with grpc.insecure_channel(relay.address) as channel:
            call = channel.unary_unary(INFER, None, None)
            reply = service_pb2.ModelInferResponse.FromString(call(infer_bytes("m")))
            assert reply.model_name == "m"
        text = scrape_registry(relay.registry)
    finally:
        relay.close()
    assert sample_value(text, "xsp_observer_errors_total", hook="connection") == 1
    assert sample_value(text, "xsp_observer_errors_total", hook="request_headers") == 0
    ok = {"grpc_code": "OK", "method": "ModelInfer", "model": "m", "protocol": "grpc"}
    assert sample_value(text, "xsp_requests_total", **ok) == 1


def test_unix_socket_backend_and_streaming() -> None:
    def echo_stream(requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        for req in requests:  # one response per request, as Triton's stream answers
            parsed = service_pb2.ModelInferRequest.FromString(req)
            reply = service_pb2.ModelStreamInferResponse()
            reply.infer_response.model_name = parsed.model_name
            reply.infer_response.id = parsed.id
            yield reply.SerializeToString()

    sock = Path(tempfile.mkdtemp()) / "backend.sock"
    server, _ = grpc_backend(
        {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(echo_stream)}, f"unix:{sock}"
    )
    relay = RelayThread(Endpoint(unix_path=str(sock)))
    try:
        with grpc.insecure_channel(relay.address) as channel:
            call = channel.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer", None, None
            )
            msgs = [infer_bytes(f"m{i % 2}") for i in range(50)]
            replies = [service_pb2.ModelStreamInferResponse.FromString(r) for r in call(iter(msgs))]
            assert [r.infer_response.model_name for r in replies] == [
                f"m{i % 2}" for i in range(50)
            ]
        # each request message is one inference, under its own model
        labels = {
            "method": "ModelStreamInfer",
            "model": "m0",
            "grpc_code": "OK",
            "protocol": "grpc",
        }
        assert relay.registry.get_sample_value("xsp_requests_total", labels) == 25
        streams = {"method": "ModelStreamInfer", "grpc_code": "OK"}
        assert relay.registry.get_sample_value("xsp_streams_total", streams) == 1
    finally:
        server.stop(0)
        relay.close()


def test_tls_termination(tmp_path: Path, backend: tuple[grpc.Server, int]) -> None:
    _, port = backend
    cert, key = self_signed(tmp_path)
    context = tls_context(str(cert), str(key))
    assert isinstance(context, ssl.SSLContext)
    relay = RelayThread(Endpoint("127.0.0.1", port), ssl_context=context)
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        target = f"localhost:{relay.endpoint.port}"
        with grpc.secure_channel(target, creds) as channel:
            reply = channel.unary_unary(INFER, None, None)(infer_bytes("tls_model"), timeout=5)
        assert service_pb2.ModelInferResponse.FromString(reply).model_name == "tls_model"
    finally:
        relay.close()


def test_large_messages_both_ways_with_back_pressure() -> None:
    big = b"\x0a\x01m" + b"\x12" + (24 << 20).to_bytes(4, "little")  # any bytes will do

    def handler(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        return req + req  # response twice the size of the request

    server, port = grpc_backend({"ModelInfer": unary(handler)})
    relay = RelayThread(Endpoint("127.0.0.1", port))
    try:
        payload = big + bytes(range(256)) * (48 << 12)  # ~12 MB
        with grpc.insecure_channel(relay.address, options=OPTIONS) as channel:
            reply = channel.unary_unary(INFER, None, None)(payload, timeout=30)
        assert reply == payload + payload
    finally:
        server.stop(0)
        relay.close()


def test_tfserving_readiness_is_an_http2_connection() -> None:
    """TF-Serving has no model-free readiness RPC: a working HTTP/2 (gRPC) connection counts.
    A plain grpcio server stands in for tensorflow_model_server, which cannot be installed here.
    """
    server, port = grpc_backend({})
    try:
        assert BackendChecker(Endpoint("127.0.0.1", port), "tfserving").check() is True
    finally:
        server.stop(0)
    assert BackendChecker(Endpoint("127.0.0.1", port), "tfserving").check() is False
    assert BackendChecker(Endpoint("127.0.0.1", port), "triton").check() is False


def _echo_server() -> tuple[socket.socket, int]:
    """A raw TCP echo server (not HTTP/2 at all)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize("hold", [False, True])
def test_unparseable_bytes_still_flow_both_ways(hold: bool) -> None:
    listener, port = _echo_server()
    factory = (lambda info: Tracing()) if hold else None
    relay = RelayThread(Endpoint("127.0.0.1", port), observer_factory=factory)
    try:
        rng = random.Random(7)
        payload = b"GET / HTTP/1.1\r\n\r\n" + bytes(rng.getrandbits(8) for _ in range(200_000))
        with socket.create_connection(("127.0.0.1", relay.endpoint.port), timeout=10) as sock:
            sock.sendall(payload)
            received = b""
            while len(received) < len(payload):
                chunk = sock.recv(65536)
                assert chunk, "relay closed the connection"
                received += chunk
        assert received == payload
        failures = relay.registry.get_sample_value(
            "xsp_observation_failures_total", {"reason": "preface"}
        )
        assert failures == 1
    finally:
        listener.close()
        relay.close()
