"""`Sidecar` with an HTTP plane (`--http-listen`, `--http-backend`): it relays REST calls to the
backend's HTTP port beside the gRPC relay, counts them with protocol="http" on the one
/metrics, says so once at start, and drains them with the gRPC relay within the grace period.

The backend is a real HTTP server (the standard library's) on a free port; the sidecar runs
in-process on uvloop (`tests.proxy.proxy_harness.SidecarThread`)."""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sidecar.endpoint import PortInUseError
from tests.harness.metrics_text import sample_sum, scrape
from tests.harness.process import free_port
from tests.harness.tls import self_signed
from tests.proxy.proxy_harness import SidecarThread

INFER = "/v2/models/{}/infer"


class Backend(BaseHTTPRequestHandler):
    """Answers every POST with its body, after `delay` seconds when the path says `slow`."""

    protocol_version = "HTTP/1.1"
    delay = 0.5

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if "slow" in self.path:
            time.sleep(self.delay)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def backend() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def post(address: str, path: str, body: bytes = b'{"inputs": []}') -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_rest_calls_are_relayed_and_counted_beside_grpc(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.serve")
    side = SidecarThread("127.0.0.1:1", http_listen="127.0.0.1:0", http_backend=backend)
    try:
        listen = side.sidecar.http_listen
        assert listen is not None and listen.port != 0
        address = f"127.0.0.1:{listen.port}"
        for model in ("cnn", "cnn", "add_sub"):
            assert post(address, INFER.format(model), b'{"x": 1}') == (200, b'{"x": 1}')
        text = scrape(side.metrics_url)
        http = {"protocol": "http", "method": "ModelInfer"}
        assert sample_sum(text, "xsp_requests_total", model="cnn", **http) == 2
        assert sample_sum(text, "xsp_requests_total", model="add_sub", **http) == 1
        assert sample_sum(text, "xsp_requests_total", protocol="grpc") == 0
    finally:
        side.close()
    lines = [r.getMessage() for r in caplog.records if "REST calls" in r.getMessage()]
    assert lines == [f"relaying REST calls {listen} -> {backend} (HTTP/1.1, triton routes; "
                     "sampling off)"]  # fmt: skip


def test_without_the_http_addresses_there_is_no_http_plane(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.serve")
    side = SidecarThread("127.0.0.1:1")
    try:
        assert side.sidecar.http_relay is None and side.sidecar.http_listen is None
    finally:
        side.close()
    assert "no HTTP plane: give --http-listen and --http-backend" in caplog.text


def test_sigterm_drains_rest_calls_in_flight_within_the_grace_period(backend: str) -> None:
    side = SidecarThread("127.0.0.1:1", http_listen="127.0.0.1:0", http_backend=backend)
    listen = side.sidecar.http_listen
    assert listen is not None
    address = f"127.0.0.1:{listen.port}"
    answers: list[tuple[int, bytes]] = []
    call = threading.Thread(target=lambda: answers.append(post(address, INFER.format("slow"))))
    call.start()
    time.sleep(0.15)  # the call is at the backend, which answers after 0.5 s
    started = time.monotonic()
    side.run(side.sidecar.shutdown(5.0))
    took = time.monotonic() - started
    call.join(5)
    side.stop()
    assert answers == [(200, b'{"inputs": []}')]  # it finished: the grace period let it
    assert took < 2.0  # and shutdown did not wait the whole grace period
    with pytest.raises(OSError):  # no more connections
        post(address, INFER.format("cnn"))


def test_a_taken_http_port_is_a_clear_error(backend: str) -> None:
    taken = backend  # the backend's own port
    with pytest.raises(PortInUseError) as info:
        SidecarThread("127.0.0.1:1", http_listen=taken, http_backend=f"127.0.0.1:{free_port()}")
    assert "--http-listen" in info.value.strerror


def test_tls_cert_terminates_tls_on_the_http_plane_too(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.serve")
    cert, key = self_signed(tmp_path)
    side = SidecarThread(
        "127.0.0.1:1", http_listen="127.0.0.1:0", http_backend=backend,
        tls_cert=cert, tls_key=key,
    )  # fmt: skip
    try:
        listen = side.sidecar.http_listen
        assert listen is not None
        context = ssl.create_default_context(cafile=str(cert))
        context.set_alpn_protocols(["h2", "http/1.1"])  # the gRPC port would pick h2
        conn = http.client.HTTPSConnection("localhost", listen.port, timeout=10, context=context)
        try:
            conn.request("POST", INFER.format("cnn"), b'{"x": 2}')
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, b'{"x": 2}')
            assert conn.sock.selected_alpn_protocol() == "http/1.1"
        finally:
            conn.close()
        # plain HTTP: no answer, the connection closed (RemoteDisconnected) or reset
        with pytest.raises(ConnectionResetError):
            post(f"127.0.0.1:{listen.port}", INFER.format("cnn"))
        text = scrape(side.metrics_url)
        http_calls = {"protocol": "http", "method": "ModelInfer"}
        assert sample_sum(text, "xsp_requests_total", **http_calls) == 1
    finally:
        side.close()
    assert any("(HTTP/1.1 over TLS, triton routes" in r.getMessage() for r in caplog.records)
