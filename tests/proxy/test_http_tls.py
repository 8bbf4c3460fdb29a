"""HTTPS on the HTTP plane: the relay terminates TLS (ALPN `http/1.1`) in front of the REAL
Triton server's plain HTTP port, with the C pump taking client chunks and with Python's
reader alone. The answers are the ones Triton gives over plain HTTP, each call is counted as
a plain one is, and a client that speaks no TLS, or starts no handshake, is closed without
hurting the next one."""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.proxy.http import HttpLimits
from sidecar.proxy.http import relay as http_relay
from sidecar.serve import tls_context
from tests.harness.metrics_text import sample_value, scrape_registry
from tests.harness.tls import self_signed
from tests.proxy.http_harness import (
    HttpRelayThread,
    address_of,
    exchange,
    read_responses,
)

pytestmark = pytest.mark.triton

HANDSHAKE_TIMEOUT_S = 1.0  # the relay's header timeout, which bounds a handshake too
OK = {"method": "ModelInfer", "model": "add_sub", "grpc_code": "OK", "protocol": "http"}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(params=["c", "python"])
def relay(
    request: pytest.FixtureRequest,
    triton: Any,
    cert: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[HttpRelayThread]:
    if request.param == "python":
        monkeypatch.setattr(http_relay, "native_http_pump", None)
    elif http_relay.native_http_pump is None:
        pytest.skip("the C HTTP pump is not built here")
    context = tls_context(str(cert[0]), str(cert[1]), "http/1.1")
    side = HttpRelayThread(
        triton.http_address,
        ssl_context=context,
        limits=HttpLimits(header_timeout_s=HANDSHAKE_TIMEOUT_S),
    )
    yield side
    side.close()


def metric(relay: HttpRelayThread, name: str, **labels: str) -> float:
    return sample_value(scrape_registry(relay.registry), name, **labels) or 0.0


def json_infer(values: list[float]) -> bytes:
    body = json.dumps({
        "inputs": [
            {"name": "INPUT0", "shape": [len(values)], "datatype": "FP32", "data": values},
            {"name": "INPUT1", "shape": [len(values)], "datatype": "FP32", "data": values},
        ]
    }).encode()  # fmt: skip
    head = "POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
    return f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def tls_connect(address: str, cert: Path) -> ssl.SSLSocket:
    """A verified TLS connection to `localhost` at `address`'s port, asking for HTTP/1.1."""
    context = ssl.create_default_context(cafile=str(cert))
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("localhost", address_of(address)[1]), timeout=10)
    return context.wrap_socket(raw, server_hostname="localhost")


def test_pipelined_json_over_https_gets_tritons_plain_answers(
    triton: Any, relay: HttpRelayThread, cert: tuple[Path, Path]
) -> None:
    requests = [json_infer([float(i), 1.0, 2.0]) for i in range(3)]
    direct = [exchange(triton.http_address, r)[0] for r in requests]
    with tls_connect(relay.address, cert[0]) as sock:
        assert sock.selected_alpn_protocol() == "http/1.1"
        sock.sendall(b"".join(requests))  # pipelined, in one write
        relayed, _ = read_responses(sock, len(requests))
    assert [(r.status, r.body) for r in relayed] == [(r.status, r.body) for r in direct]
    assert [json.loads(r.body)["outputs"][0]["data"][0] for r in relayed] == [0.0, 2.0, 4.0]
    assert metric(relay, "xsp_requests_total", **OK) == len(requests)
    bodies = sum(len(r.split(b"\r\n\r\n", 1)[1]) for r in requests)
    bytes_in = {"method": "ModelInfer", "model": "add_sub", "protocol": "http"}
    assert metric(relay, "xsp_request_bytes_total", **bytes_in) == bodies


def test_tritonclient_binary_tensors_over_https(
    relay: HttpRelayThread, cert: tuple[Path, Path]
) -> None:
    import gevent.ssl
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(
        f"localhost:{relay.endpoint.port}", ssl=True, network_timeout=30,
        ssl_options={"ca_certs": str(cert[0])},
        ssl_context_factory=gevent.ssl.create_default_context,  # verifies the certificate
    )  # fmt: skip
    try:
        a = np.random.default_rng(1).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
        inputs = [httpclient.InferInput(n, [a.size], "FP32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a, binary_data=True)
        reply = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(reply.as_numpy("OUTPUT0"), a + a)
        assert client.is_model_ready("add_sub")
    finally:
        client.close()
    assert metric(relay, "xsp_requests_total", **OK) == 1
    assert metric(relay, "xsp_requests_total", method="ModelReady", model="add_sub",
                  grpc_code="OK", protocol="http") == 1  # fmt: skip


def test_plain_http_to_the_tls_port_is_closed_and_the_next_client_served(
    relay: HttpRelayThread, cert: tuple[Path, Path]
) -> None:
    with socket.create_connection(address_of(relay.address), timeout=10) as sock:
        sock.sendall(json_infer([1.0]))
        answer = bytearray()
        try:
            while data := sock.recv(1 << 16):
                answer += data
        except ConnectionResetError:
            pass
    assert not answer.startswith(b"HTTP/")  # no HTTP answer (and no forwarding) without TLS
    assert metric(relay, "xsp_requests_total", **OK) == 0
    with tls_connect(relay.address, cert[0]) as tls:
        tls.sendall(json_infer([1.0]))
        relayed, _ = read_responses(tls, 1)
    assert [r.status for r in relayed] == [200]
    assert metric(relay, "xsp_requests_total", **OK) == 1


def test_a_connection_that_starts_no_handshake_is_closed_at_the_header_timeout(
    relay: HttpRelayThread,
) -> None:
    with socket.create_connection(address_of(relay.address), timeout=10) as sock:
        began = time.monotonic()
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        waited = time.monotonic() - began
    assert closed, "the relay kept a silent connection open for the socket's 10 s timeout"
    assert waited >= HANDSHAKE_TIMEOUT_S * 0.9
    assert relay.in_loop(lambda: len(relay.relay.connections)) == 0
