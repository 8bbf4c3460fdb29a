"""The HTTP/1.1 relay in front of the REAL Triton server's HTTP port (and, for exact bytes and a
broken backend, a plain recording server): bytes unchanged, calls counted per model, method
and status, the observer told what issue 42's I3 says."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sidecar.proxy.streams import (
    ConnectionInfo,
    HeaderDecision,
    QuietEnd,
    RequestStart,
    StreamEnd,
)
from tests.harness.metrics_text import sample_value, scrape_registry
from tests.harness.process import free_port
from tests.proxy.http_harness import (
    HttpRelayThread,
    RecordingBackend,
    connect,
    exchange,
    read_responses,
    read_until_close,
)

pytestmark = pytest.mark.triton


class Recorder:
    """An observer (one for every connection) that keeps what it is told."""

    def __init__(self, decide: Any = None) -> None:
        self.decide = decide or (lambda start: None)
        self.connections: list[ConnectionInfo] = []
        self.starts: list[RequestStart] = []
        self.bodies: list[tuple[int, str | None, bytes]] = []
        self.ends: list[StreamEnd] = []

    def __call__(self, info: ConnectionInfo) -> Recorder:
        self.connections.append(info)
        return self

    def on_request_headers(self, start: RequestStart) -> Any:
        self.starts.append(start)
        return self.decide(start)

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.bodies.append((stream_id, model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.ends.append(end)


@pytest.fixture(scope="module")
def relay(triton: Any) -> Iterator[HttpRelayThread]:
    side = HttpRelayThread(triton.http_address)
    yield side
    side.close()


def metric(relay: HttpRelayThread, name: str, **labels: str) -> float:
    return sample_value(scrape_registry(relay.registry), name, **labels) or 0.0


def json_infer(model: str = "add_sub", n: int = 4) -> bytes:
    data = [float(i) for i in range(n)]
    return json.dumps({
        "inputs": [
            {"name": "INPUT0", "shape": [n], "datatype": "FP32", "data": data},
            {"name": "INPUT1", "shape": [n], "datatype": "FP32", "data": data},
        ]
    }).encode()  # fmt: skip


def post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def get(path: str, extra: str = "", verb: str = "GET") -> bytes:
    return f"{verb} {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


def test_binary_tensors_through_tritonclient(triton: Any, relay: HttpRelayThread) -> None:
    import tritonclient.http as httpclient

    before = metric(relay, "xsp_requests_total", method="ModelInfer", model="add_sub",
                    grpc_code="OK", protocol="http")  # fmt: skip
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1 << 20).astype(np.float32)  # 4 MiB a tensor: a large body
    b = rng.standard_normal(1 << 20).astype(np.float32)
    results = {}
    for where, address in (("direct", triton.http_address), ("relay", relay.address)):
        client = httpclient.InferenceServerClient(address, network_timeout=30)
        inputs = [httpclient.InferInput("INPUT0", [a.size], "FP32"),
                  httpclient.InferInput("INPUT1", [b.size], "FP32")]  # fmt: skip
        inputs[0].set_data_from_numpy(a, binary_data=True)
        inputs[1].set_data_from_numpy(b, binary_data=True)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=True)
                   for n in ("OUTPUT0", "OUTPUT1")]  # fmt: skip
        reply = client.infer("add_sub", inputs, outputs=outputs)
        results[where] = (reply.as_numpy("OUTPUT0"), reply.as_numpy("OUTPUT1"))
        assert client.is_model_ready("add_sub")
        client.close()
    np.testing.assert_array_equal(results["relay"][0], a + b)
    np.testing.assert_array_equal(results["relay"][1], results["direct"][1])
    after = metric(relay, "xsp_requests_total", method="ModelInfer", model="add_sub",
                   grpc_code="OK", protocol="http")  # fmt: skip
    assert after == before + 1
    assert metric(relay, "xsp_request_bytes_total", method="ModelInfer", model="add_sub",
                  protocol="http") >= 8 << 20  # fmt: skip
    assert metric(relay, "xsp_requests_total", method="ModelReady", model="add_sub",
                  grpc_code="OK", protocol="http") >= 1  # fmt: skip


def test_json_response_bytes_unchanged(triton: Any, relay: HttpRelayThread) -> None:
    request = post("/v2/models/add_sub/infer", json_infer())
    direct = exchange(triton.http_address, request)
    relayed = exchange(relay.address, request)
    assert relayed == direct
    assert relayed[0].status == 200
    assert json.loads(relayed[0].body)["outputs"][0]["data"] == [0.0, 2.0, 4.0, 6.0]


def test_pipelined_keep_alive_answers_in_order(relay: HttpRelayThread) -> None:
    slow = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]},
        {"name": "DELAY_MS", "shape": [1], "datatype": "INT32", "data": [150]},
    ]}).encode()  # fmt: skip
    # (Triton's evhtp answers pipelined POSTs in order; of pipelined GETs only the first)
    burst = (
        post("/v2/models/sleep/infer", slow)
        + post("/v2/models/add_sub/infer", json_infer(n=2))
        + post("/v2/models/add_sub/infer", json_infer(n=3))
    )
    with connect(relay.address) as sock:
        sock.sendall(burst)
        responses, _ = read_responses(sock, 3)
        assert [r.status for r in responses] == [200, 200, 200]
        outputs = [json.loads(r.body)["outputs"][0] for r in responses]
        assert [o["shape"] for o in outputs] == [[1], [2], [3]]  # in the order asked
        for _ in range(20):  # keep-alive: more calls on the same connection
            sock.sendall(get("/v2/health/live"))
            assert read_responses(sock, 1)[0][0].status == 200
    assert metric(relay, "xsp_requests_total", method="ServerLive", model="_unknown",
                  grpc_code="OK", protocol="http") >= 20  # fmt: skip


def test_chunked_request_and_observer(triton: Any) -> None:
    recorder = Recorder(lambda start: HeaderDecision(
        extra_headers=[("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")],
        capture_body=True,
    ))  # fmt: skip
    side = HttpRelayThread(triton.http_address, observer_factory=recorder)
    try:
        body = json_infer()
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 50]), body[i : i + 50])
            for i in range(0, len(body), 50)
        )
        request = (
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
        )
        with connect(side.address) as sock:
            for i in range(0, len(request), 37):  # cut anywhere, header block included
                sock.sendall(request[i : i + 37])
                time.sleep(0.001)
            sock.sendall(get("/v2/models/no_such_model/ready"))
            responses, _ = read_responses(sock, 2)
        assert next(r.status for r in responses) == 200
        assert responses[1].status >= 400
        deadline = time.monotonic() + 5
        while len(recorder.ends) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        side.close()
    first, second = recorder.starts
    assert (first.stream_id, second.stream_id) == (1, 2)
    assert first.method == "ModelInfer" and first.path == "/v2/models/add_sub/infer"
    assert first.raw_headers[:2] == [(b":method", b"POST"), (b":path", first.path.encode())]
    assert (b"transfer-encoding", b"chunked") in first.raw_headers
    # de-chunked and whole; a request without a body delivers b""
    assert recorder.bodies == [(1, "add_sub", body), (2, "no_such_model", b"")]
    ends = {end.stream_id: end for end in recorder.ends}
    assert ends[1].grpc_code == "OK" and ends[1].sampled and ends[1].model == "add_sub"
    assert ends[1].request_bytes == len(body) and ends[1].response_bytes > 0
    assert ends[1].request_end_s is not None and ends[1].response_start_s is not None
    assert ends[2].grpc_code in ("NOT_FOUND", "UNAVAILABLE") and ends[2].grpc_message


def test_expect_continue_and_head(triton: Any, relay: HttpRelayThread) -> None:
    body = json_infer()
    head = post("/v2/models/add_sub/infer", b"", "Expect: 100-continue\r\n")
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body))
    with connect(relay.address) as sock:
        sock.sendall(head)
        sock.settimeout(2)
        interim = sock.recv(1 << 16)  # Triton (evhtp) answers 100 Continue
        sock.sendall(body)
        responses, _ = read_responses(sock, 1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert responses[-1].status == 200
    # HEAD: Triton answers 405 with a body (evhtp serves no HEAD); relayed as it is, counted
    heads = []
    for address in (triton.http_address, relay.address):
        with connect(address) as sock:
            sock.sendall(get("/v2/health/ready", verb="HEAD"))
            time.sleep(0.3)
            heads.append(sock.recv(1 << 16))
    assert heads[1] == heads[0]
    assert heads[0].startswith(b"HTTP/1.1 405")
    assert metric(relay, "xsp_requests_total", method="_unknown", model="_unknown",
                  grpc_code="UNIMPLEMENTED", protocol="http") == 1  # fmt: skip
    assert metric(relay, "xsp_observation_failures_total", reason="http_response") == 0


def test_error_statuses_map_to_grpc_codes(relay: HttpRelayThread) -> None:
    unknown = exchange(relay.address, post("/v2/models/no_such_model/infer", json_infer()))
    assert unknown[0].status in (400, 404)
    assert "error" in json.loads(unknown[0].body)
    bad = json.loads(json_infer())
    bad["inputs"][1]["name"] = "WRONG"
    invalid = exchange(relay.address, post("/v2/models/add_sub/infer", json.dumps(bad).encode()))
    assert invalid[0].status == 400
    assert metric(relay, "xsp_requests_total", method="ModelInfer", model="no_such_model",
                  grpc_code="NOT_FOUND", protocol="http") == 1  # fmt: skip
    assert metric(relay, "xsp_requests_total", method="ModelInfer", model="add_sub",
                  grpc_code="INVALID_ARGUMENT", protocol="http") >= 1  # fmt: skip


def test_connection_close_and_quiet_end(triton: Any) -> None:
    ended = [0, 0]
    per_model: dict[str, int] = {}
    recorder = Recorder(lambda start: QuietEnd(ended, 1, per_model))
    side = HttpRelayThread(triton.http_address, observer_factory=recorder)
    try:
        with connect(side.address) as sock:
            sock.sendall(get("/v2/models/add_sub/ready", "Connection: close\r\n"))
            raw = read_until_close(sock, 5)
        assert raw.startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 5
        while not ended[1] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        side.close()
    assert ended == [0, 1] and per_model == {"add_sub": 1}
    assert recorder.ends == []


class BrokenQuick(Recorder):
    """An observer whose `quick` raises: a bug in the hook."""

    @property
    def quick(self) -> Any:
        raise RuntimeError("a bug in the hook")


@pytest.mark.parametrize("pump", ["c", "python"])
def test_a_hook_that_raises_stops_observation_not_forwarding(
    triton: Any, pump: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sidecar.proxy.http import relay as http_relay

    if pump == "python":
        monkeypatch.setattr(http_relay, "native_http_pump", None)
    elif http_relay.native_http_pump is None:
        pytest.skip("the C HTTP pump is not built here")
    side = HttpRelayThread(triton.http_address, observer_factory=BrokenQuick())
    try:
        request = post("/v2/models/add_sub/infer", json_infer())
        direct = exchange(triton.http_address, request)
        with connect(side.address) as sock:
            for _ in range(3):  # the first meets the fault; all are answered
                sock.sendall(request)
                [reply], _ = read_responses(sock, 1)
                assert (reply.status, reply.body) == (direct[0].status, direct[0].body)
        failures = metric(side, "xsp_observation_failures_total", reason="http_internal")
    finally:
        side.close()
    assert failures == 1
    assert "observing its requests failed" in caplog.text
    assert "a bug in the hook" in caplog.text


def test_bytes_unchanged_but_for_extra_headers() -> None:
    backend = RecordingBackend()
    recorder = Recorder(lambda start: HeaderDecision(extra_headers=[("x-added", "1")])
                        if start.stream_id == 2 else None)  # fmt: skip
    side = HttpRelayThread(backend.address, observer_factory=recorder)
    try:
        first = post("/v2/models/m/infer", bytes(range(256)) * 40)
        second = get("/v2/models/m", "X-Mixed-Case: AbC\r\n")
        exchange(side.address, first + second, 2)
    finally:
        side.close()
        backend.close()
    added = second[:-2] + b"x-added: 1\r\n\r\n"
    assert bytes(backend.received) == first + added


def test_broken_backend_response_is_forwarded_and_counted() -> None:
    garbage = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE NOT HTTP\r\n\r\n"
    backend = RecordingBackend(lambda n: garbage)
    side = HttpRelayThread(backend.address)
    try:
        with connect(side.address) as sock:
            sock.sendall(get("/v2/health/ready"))
            time.sleep(0.3)
            got = sock.recv(1 << 16)
            assert got == garbage
            sock.sendall(get("/v2/health/ready"))  # relayed unobserved from now on
            time.sleep(0.3)
            assert sock.recv(1 << 16) == garbage
        text = scrape_registry(side.registry)
        assert sample_value(text, "xsp_observation_failures_total", reason="http_response") == 1
        assert sample_value(text, "xsp_requests_total", method="ServerReady",
                            model="_unknown", grpc_code="OK", protocol="http") == 1  # fmt: skip
    finally:
        side.close()
        backend.close()


def test_backend_down_is_503() -> None:
    side = HttpRelayThread(f"127.0.0.1:{free_port()}")
    try:
        responses = exchange(side.address, post("/v2/models/add_sub/infer", json_infer()))
        assert responses[0].status == 503
        assert "unavailable" in json.loads(responses[0].body)["error"]
        text = scrape_registry(side.registry)
        assert sample_value(text, "xsp_http_refused_total", reason="backend_unavailable") == 1
        assert sample_value(text, "xsp_requests_total", method="ModelInfer", model="add_sub",
                            grpc_code="UNAVAILABLE", protocol="http") == 1  # fmt: skip
    finally:
        side.close()


def test_in_flight_and_shutdown(triton: Any) -> None:
    side = HttpRelayThread(triton.http_address)
    sock = connect(side.address)
    sock.sendall(get("/v2/health/ready"))
    assert read_responses(sock, 1)[0][0].status == 200
    assert side.in_loop(side.relay.in_flight) == 0
    side.close(grace=2.0)  # an idle keep-alive connection is closed at once
    sock.settimeout(2)
    assert sock.recv(10) == b""
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", side.endpoint.port), timeout=1).close()


def test_idle_timeout_and_shutdown_finishes_a_call_in_flight(triton: Any) -> None:
    from sidecar.proxy.http import HttpLimits

    side = HttpRelayThread(triton.http_address, limits=HttpLimits(idle_timeout_s=0.4))
    try:
        with connect(side.address) as idle:
            idle.sendall(get("/v2/health/ready"))
            assert read_responses(idle, 1)[0][0].status == 200
            started = time.monotonic()
            assert read_until_close(idle, 5) == b""  # closed by the relay once idle
            assert time.monotonic() - started < 2.5
        slow = json.dumps({"inputs": [
            {"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]},
            {"name": "DELAY_MS", "shape": [1], "datatype": "INT32", "data": [300]},
        ]}).encode()  # fmt: skip
        busy = connect(side.address)
        busy.sendall(post("/v2/models/sleep/infer", slow))
        time.sleep(0.1)
        assert side.in_loop(side.relay.in_flight) == 1
    finally:
        side.close(grace=3.0)  # waits for the call in flight, then closes
    responses, _ = read_responses(busy, 1)
    assert responses[0].status == 200
    assert read_until_close(busy, 2) == b""
    busy.close()


@pytest.mark.parametrize("pump", ["c", "python"])
def test_an_unobserved_connection_is_closed_once_quiet(
    pump: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that went unobserved with a request part-way read (a response not
    understood, its reader frozen there) shows only bytes: the idle timeout and shutdown close
    it once none flowed for a while, as they close an idle one, not never (idle timeout) or at
    the grace period's end (shutdown)."""
    from sidecar.proxy.http import HttpLimits
    from sidecar.proxy.http import relay as http_relay

    if pump == "python":
        monkeypatch.setattr(http_relay, "native_http_pump", None)
    elif http_relay.native_http_pump is None:
        pytest.skip("the C HTTP pump is not built here")
    garbage = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE NOT HTTP\r\n\r\n"
    backend = RecordingBackend(lambda n: garbage)
    part = b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"
    try:
        for idle_timeout in (0.4, None):
            limits = HttpLimits(idle_timeout_s=idle_timeout)
            side = HttpRelayThread(backend.address, limits=limits)
            try:
                with connect(side.address) as sock:
                    sock.sendall(get("/v2/health/ready") + part)
                    assert read_until_close(sock, 0.5) == garbage  # (0.5 s: still open)
                    failures = metric(side, "xsp_observation_failures_total",
                                      reason="http_response")  # fmt: skip
                    assert failures == 1
                    started = time.monotonic()
                    if idle_timeout is None:  # shutdown
                        side.close(grace=10.0)
                    assert read_until_close(sock, 5) == b""
                    assert time.monotonic() - started < 2.5
            finally:
                if idle_timeout is not None:
                    side.close()
    finally:
        backend.close()
