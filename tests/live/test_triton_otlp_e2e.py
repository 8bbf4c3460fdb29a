"""End to end with the real Triton 2.51 in OpenTelemetry mode exporting to our OTLP receiver.

Triton runs with `rate=0` (trace only requests that carry a `traceparent`) and a 100 ms batch
delay, exactly as docs/triton-tracing.md tells operators to run it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from sidecar.live.otlp_receiver import OtlpReceiver
from sidecar.live.triton_spans import TritonSpanCollector, TritonTrace
from tests.harness.triton.model_repo import build_model_repository
from tests.harness.triton.server import TritonServer
from tests.live.test_triton_spans import check_tree

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def triton_otlp_args(url: str) -> list[str]:
    return [
        "--trace-config", "mode=opentelemetry",
        "--trace-config", f"opentelemetry,url={url}",
        "--trace-config", "rate=0",
        "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "count=-1",
        "--trace-config", "opentelemetry,bsp_schedule_delay=100",
        "--trace-config", "opentelemetry,bsp_max_export_batch_size=1",
    ]  # fmt: skip


@dataclass
class Setup:
    triton: TritonServer
    receiver: OtlpReceiver
    traces: dict[str, TritonTrace]
    arrived: threading.Condition

    def wait_for(self, trace_id: str, timeout: float = 20.0) -> TritonTrace:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while trace_id not in self.traces:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no spans of trace {trace_id} after {timeout} s; receiver "
                        f"{self.receiver.stats()}; Triton log:\n{self.triton.log_tail()}"
                    )
                self.arrived.wait(left)
            return self.traces[trace_id]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("triton-otel")
    traces: dict[str, TritonTrace] = {}
    arrived = threading.Condition()

    def on_trace(trace: TritonTrace) -> None:
        with arrived:
            traces[trace.trace_id] = trace
            arrived.notify_all()

    collector = TritonSpanCollector(on_trace)
    with OtlpReceiver(collector.add, port=0) as receiver:
        server = TritonServer(
            model_repository=build_model_repository(root / "models"),
            log_path=root / "tritonserver.log",
            extra_args=triton_otlp_args(receiver.url),
        )
        with server:
            yield Setup(server, receiver, traces, arrived)


def infer_simple_cnn(triton: TritonServer, headers: dict[str, str] | None) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_address)
    try:
        data = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
        tensor = grpcclient.InferInput("input", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("simple_cnn", [tensor], headers=headers)
        assert result.as_numpy("output").shape == (2, 10)
    finally:
        client.close()


def traced_request(setup: Setup, attempts: int = 3) -> tuple[str, str, int, TritonTrace]:
    """Send a request with a `traceparent` and wait for Triton's spans of it.

    Triton 2.51 now and then never exports a trace (about 1 run in 6 here, with nothing
    reaching the receiver); a fresh request is then sent, up to `attempts` times.
    """
    error: AssertionError | None = None
    for _ in range(attempts):
        trace_id, proxy_span = os.urandom(16).hex(), os.urandom(8).hex()
        started = time.time_ns()
        infer_simple_cnn(setup.triton, {"traceparent": f"00-{trace_id}-{proxy_span}-01"})
        try:
            return trace_id, proxy_span, started, setup.wait_for(trace_id, timeout=10.0)
        except AssertionError as exc:
            error = exc
    assert error is not None
    raise error


def test_traceparent_request_spans_attach_under_the_callers_span(setup: Setup) -> None:
    untraced_before = set(setup.traces)
    infer_simple_cnn(setup.triton, None)  # rate=0: this one must not be traced
    trace_id, proxy_span, started, trace = traced_request(setup)

    check_tree(trace, proxy_span)
    assert (trace.model, trace.model_version) == ("simple_cnn", "1")
    request = next(s for s in trace.spans if s.kind == "request")
    assert request.name == "InferRequest"
    assert started <= request.start_ns <= request.end_ns <= time.time_ns()
    # the untraced request was never exported (traces of lost attempts may arrive late)
    assert trace_id in set(setup.traces) - untraced_before
    assert all(t.parent_span_id is not None for t in setup.traces.values())
    stats = setup.receiver.stats()
    assert stats.rejected == 0 and stats.callback_errors == 0
    assert stats.spans >= 3 and stats.accepted >= 3  # one span per export (batch size 1)
