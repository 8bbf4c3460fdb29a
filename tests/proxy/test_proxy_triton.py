"""Acceptance: the relay in front of the REAL Triton server (session fixture `triton`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sidecar.endpoint import Endpoint
from sidecar.proxy import HeaderDecision, RequestStart, StreamEnd
from tests.harness.metrics_text import sample_value, scrape
from tests.proxy.proxy_harness import RelayThread, SidecarThread

pytestmark = pytest.mark.triton
BIG = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@pytest.fixture(scope="module")
def sidecar(triton: Any) -> Iterator[SidecarThread]:
    side = SidecarThread(triton.grpc_address)
    yield side
    side.close()


@pytest.fixture(scope="module")
def stubs(triton: Any, sidecar: SidecarThread) -> Iterator[dict[str, Any]]:
    direct = grpc.insecure_channel(triton.grpc_address, options=BIG)
    relayed = grpc.insecure_channel(sidecar.address, options=BIG)
    yield {
        "direct": service_pb2_grpc.GRPCInferenceServiceStub(direct),
        "relay": service_pb2_grpc.GRPCInferenceServiceStub(relayed),
    }
    direct.close()
    relayed.close()


def tensor_request(model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> Any:
    req = service_pb2.ModelInferRequest(model_name=model, id="req-1")
    for name, array in inputs.items():
        dtype = {np.dtype("float32"): "FP32", np.dtype("int32"): "INT32"}[array.dtype]
        req.inputs.add(name=name, datatype=dtype, shape=list(array.shape))
        req.raw_input_contents.append(array.tobytes())
    for name in outputs:
        req.outputs.add(name=name)
    return req


def add_sub_request(n: int = 16, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return tensor_request("add_sub", {"INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])


def sleep_request(delay_ms: int) -> Any:
    inputs = {"INPUT0": np.ones(4, np.float32), "DELAY_MS": np.array([delay_ms], np.int32)}
    return tensor_request("sleep", inputs, ["OUTPUT0"])


def output(reply: Any, index: int) -> np.ndarray:
    return np.frombuffer(reply.raw_output_contents[index], dtype=np.float32)


def test_model_infer_identical(stubs: dict[str, Any]) -> None:
    req = add_sub_request()
    direct = stubs["direct"].ModelInfer(req)
    relayed = stubs["relay"].ModelInfer(req)
    assert relayed.SerializeToString() == direct.SerializeToString()
    a = np.frombuffer(req.raw_input_contents[0], np.float32)
    b = np.frombuffer(req.raw_input_contents[1], np.float32)
    np.testing.assert_array_equal(output(relayed, 0), a + b)
    np.testing.assert_array_equal(output(relayed, 1), a - b)
    image = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    cnn = tensor_request("simple_cnn", {"input": image}, ["output"])
    assert stubs["relay"].ModelInfer(cnn).SerializeToString() == (
        stubs["direct"].ModelInfer(cnn).SerializeToString()
    )


def test_metadata_and_statistics_identical(stubs: dict[str, Any]) -> None:
    for model in ("add_sub", "simple_cnn", "sleep"):
        req = service_pb2.ModelMetadataRequest(name=model)
        assert stubs["relay"].ModelMetadata(req) == stubs["direct"].ModelMetadata(req)
    stats = service_pb2.ModelStatisticsRequest(name="simple_cnn")
    assert stubs["relay"].ModelStatistics(stats) == stubs["direct"].ModelStatistics(stats)
    assert stubs["relay"].ServerReady(service_pb2.ServerReadyRequest()).ready


def test_stream_infer(stubs: dict[str, Any]) -> None:
    requests = [add_sub_request(8, seed) for seed in range(5)]
    replies = list(stubs["relay"].ModelStreamInfer(iter(requests), timeout=60))
    assert len(replies) == 5
    for req, reply in zip(requests, replies, strict=True):
        assert not reply.error_message
        a = np.frombuffer(req.raw_input_contents[0], np.float32)
        b = np.frombuffer(req.raw_input_contents[1], np.float32)
        np.testing.assert_array_equal(output(reply.infer_response, 0), a + b)


@pytest.mark.parametrize("case", ["unknown_model", "bad_input"])
def test_triton_errors_pass_through(stubs: dict[str, Any], case: str) -> None:
    req = add_sub_request()
    if case == "unknown_model":
        req.model_name = "no_such_model"
    else:
        req.inputs[1].name = "WRONG"
    errors = []
    for path in ("direct", "relay"):
        with pytest.raises(grpc.RpcError) as info:
            stubs[path].ModelInfer(req)
        errors.append((info.value.code(), info.value.details()))
    assert errors[0] == errors[1]
    assert errors[0][0] in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


def test_deadline_exceeded(stubs: dict[str, Any]) -> None:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stubs["relay"].ModelInfer(sleep_request(2000), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 1.5


def test_client_cancel_reaches_backend(triton: Any, stubs: dict[str, Any]) -> None:
    log = triton.model_repository / "sleep" / "cancelled.log"
    before = log.read_text().count("\n") if log.exists() else 0
    future = stubs["relay"].ModelInfer.future(sleep_request(5000))
    time.sleep(0.7)  # let the request reach the model
    future.cancel()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count("\n") > before:
            break
        time.sleep(0.05)
    assert log.exists() and log.read_text().count("\n") > before, "the cancel never reached Triton"


@pytest.mark.slow
def test_64mb_request(stubs: dict[str, Any]) -> None:
    n = 8 * 1024 * 1024  # 8M floats per input: 64 MiB of request tensors
    a = np.arange(n, dtype=np.float32)
    b = np.full(n, 2.0, np.float32)
    req = tensor_request("add_sub", {"INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
    assert req.ByteSize() > 64 * 1024 * 1024
    reply = stubs["relay"].ModelInfer(req, timeout=120)
    np.testing.assert_array_equal(output(reply, 0), a + b)
    np.testing.assert_array_equal(output(reply, 1), a - b)


def test_metrics_scraped_over_http(sidecar: SidecarThread, stubs: dict[str, Any]) -> None:
    def grew(name: str, **labels: str) -> float:
        return (sample_value(after, name, **labels) or 0) - (
            sample_value(before, name, **labels) or 0
        )

    before = scrape(sidecar.metrics_url)
    for seed in range(4):
        stubs["relay"].ModelInfer(add_sub_request(4, seed))
    stubs["relay"].ModelMetadata(service_pb2.ModelMetadataRequest(name="simple_cnn"))
    bad = add_sub_request()
    bad.model_name = "nope"
    with pytest.raises(grpc.RpcError):
        stubs["relay"].ModelInfer(bad)
    after = scrape(sidecar.metrics_url)
    requests = "xsp_requests_total"
    assert grew(requests, grpc_code="OK", method="ModelInfer", model="add_sub") == 4
    assert grew(requests, grpc_code="NOT_FOUND", method="ModelInfer", model="nope") == 1
    assert grew(requests, grpc_code="OK", method="ModelMetadata", model="simple_cnn") == 1
    assert sample_value(after, "xsp_requests_in_flight") == 0
    count = "xsp_request_duration_seconds_count"
    assert grew(count, method="ModelInfer", model="add_sub") == 4
    assert sample_value(after, "xsp_backend_up") == 1


class _Traceparent:
    """Observer that samples every call: appends a traceparent and captures the body."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str | None, bytes]] = []
        self.codes: list[str] = []

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        return HeaderDecision(extra_headers=[("traceparent", tp)], capture_body=True)

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.bodies.append((model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.codes.append(end.grpc_code)


def test_injected_traceparent_is_accepted_by_triton(triton: Any, stubs: dict[str, Any]) -> None:
    observer = _Traceparent()
    relay = RelayThread(
        Endpoint("127.0.0.1", triton.grpc_port), observer_factory=lambda _: observer
    )
    try:
        with grpc.insecure_channel(relay.address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            req = add_sub_request()
            for _ in range(3):
                reply = stub.ModelInfer(req)
                assert (
                    reply.SerializeToString() == stubs["direct"].ModelInfer(req).SerializeToString()
                )
        assert observer.codes == ["OK"] * 3
        assert observer.bodies[0] == (
            "add_sub",
            b"\0" + req.ByteSize().to_bytes(4, "big") + req.SerializeToString(),
        )
    finally:
        relay.close()
