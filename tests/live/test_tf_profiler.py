"""Capturing the server's side of a sampled request from a real TensorFlow profiler server.

The backend is a subprocess (`tests/live/tf_profiler_backend.py`) that serves TensorFlow's
ProfilerService, as TF-Serving does on its gRPC port, and runs a Keras SavedModel on demand.
This process never imports TensorFlow.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from sidecar.backends.tfserving import PREDICT_PATH
from sidecar.live.tf_profiler import (
    CAPTURE_OUTCOMES,
    SPAN_KIND,
    SampledRequest,
    TfCaptureMetricsCollector,
    TfProfilerCapture,
    clock_problem,
)
from sidecar.live.xspace import HostCapture, OpEvent, split_op_name
from sidecar.proxy.streams import ConnectionInfo, RequestStart
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.pipeline import SamplingPipeline, TfProfilerSettings
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings
from sidecar.trace.spans import Level, Source, Span, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.metrics_text import sample_map, scrape_registry
from tests.harness.process import free_port
from tests.sampling.test_observer import InMemoryHandler
from tests.sampling.test_pipeline import sampling_config as pipeline_config

REPO = Path(__file__).parents[2]
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"


class Backend:
    """The profiler server subprocess; `run()` predicts once and returns its wall-clock span."""

    def __init__(self, base: Path) -> None:
        self.port = free_port()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.live.tf_profiler_backend", str(self.port), str(base)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self._expect("ready", timeout_s=90)

    def _expect(self, word: str, timeout_s: float) -> list[str]:
        stdout = self.process.stdout
        assert stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        line = result[0].split() if result else []
        if not line or line[0] != word:
            raise RuntimeError(f"the profiler backend did not say {word!r}: {result}")
        return line

    def run(self) -> tuple[int, int]:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        _, start, end = self._expect("ran", timeout_s=10)
        return int(start), int(end)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    server = Backend(tmp_path_factory.mktemp("tf-models"))
    try:
        yield server
    finally:
        server.stop()


class Stored:
    """What the capture hands to the store, by trace id."""

    def __init__(self) -> None:
        self.spans: dict[str, list[Span]] = {}

    def __call__(self, trace_id: str, spans: list[Span]) -> None:
        self.spans.setdefault(trace_id, []).extend(spans)


def _sampled() -> SampledRequest:
    return SampledRequest(new_trace_id(), new_span_id(), time.time_ns(), model="keras_cnn")


@pytest.mark.slow
def test_a_capture_gives_each_sampled_request_the_op_spans_of_its_own_run(
    backend: Backend, tmp_path: Path
) -> None:
    stored = Stored()
    capture = TfProfilerCapture(
        f"127.0.0.1:{backend.port}", 800, repository_root=tmp_path, on_spans=stored
    )
    first, second = _sampled(), _sampled()
    capture.request(first)
    time.sleep(0.3)  # the profiler session starts on the server
    first_run = backend.run()
    capture.request(second)  # joins the running capture
    time.sleep(0.05)
    second_run = backend.run()
    capture.request_ended(first.trace_id, *first_run)
    capture.request_ended(second.trace_id, *second_run)
    assert capture.wait_idle(20)
    capture.close()

    assert capture.counts()["ok"] == 2, capture.counts()
    for request, (start, end) in ((first, first_run), (second, second_run)):
        spans = stored.spans[request.trace_id]
        assert spans, request
        assert {s.parent_id for s in spans} == {request.span_id}
        assert {(s.level, s.source, s.kind) for s in spans} == {
            (Level.SERVER, Source.BACKEND, SPAN_KIND)
        }
        assert all(s.end_ns >= start and s.start_ns <= end for s in spans)  # the window
        names = [s.name for s in spans]
        assert any("/conv1" in name for name in names), names
        # one run only: conv1's convolution once (besides the reads of its weights)
        [conv1] = [s for s in spans if "conv1" in s.name and "Conv2D" in s.attributes["op_type"]]
        assert "keras_cnn" in conv1.attributes["name_scope"]
        assert conv1.attributes["model"] == "keras_cnn"
        assert sorted(s.index for s in spans) == list(range(len(spans)))
    first_ids = {s.span_id for s in stored.spans[first.trace_id]}
    assert first_ids.isdisjoint(s.span_id for s in stored.spans[second.trace_id])
    assert not list(tmp_path.iterdir())  # the capture's files are removed


@pytest.mark.slow
def test_a_request_outside_the_capture_finds_no_ops(backend: Backend, tmp_path: Path) -> None:
    stored = Stored()
    capture = TfProfilerCapture(
        f"127.0.0.1:{backend.port}", 300, repository_root=tmp_path, on_spans=stored
    )
    request = _sampled()
    capture.request(request)
    time.sleep(0.1)
    backend.run()  # inside the capture, but not the request's run
    capture.request_ended(request.trace_id, request.received_ns, request.received_ns + 1000)
    assert capture.wait_idle(20)
    assert capture.counts()["no_ops"] == 1 and not stored.spans


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_dead_address_is_counted_as_unavailable_on_metrics(tmp_path: Path) -> None:
    stored = Stored()
    capture = TfProfilerCapture(
        f"127.0.0.1:{_closed_port()}", 100, repository_root=tmp_path, on_spans=stored
    )
    registry = CollectorRegistry()
    TfCaptureMetricsCollector(capture, registry)
    capture.request(_sampled())
    assert capture.wait_idle(20)
    samples = sample_map(scrape_registry(registry))
    counts = {
        o: samples[("xsp_backend_captures_total", (("outcome", o),))] for o in CAPTURE_OUTCOMES
    }
    assert counts == {o: float(o == "unavailable") for o in CAPTURE_OUTCOMES}
    assert not stored.spans
    capture.close()


def test_requests_after_the_capture_stopped_recording_are_busy(tmp_path: Path) -> None:
    """A server that never answers holds the capture; a fake clock places the samples."""
    now = [1_000_000_000]
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        capture = TfProfilerCapture(
            f"127.0.0.1:{silent.getsockname()[1]}", 100, repository_root=tmp_path,
            on_spans=Stored(), timeout_s=1.0, clock=lambda: now[0],
        )  # fmt: skip
        capture.request(_sampled())
        now[0] += 50_000_000  # still recording: joins
        capture.request(_sampled())
        now[0] += 100_000_000  # past the capture's stop: busy
        capture.request(_sampled())
        assert capture.wait_idle(10)
    counts = capture.counts()
    assert (counts["busy"], counts["timeout"], counts["unavailable"]) == (1, 2, 0), counts
    capture.close()
    capture.request(_sampled())  # closed: ignored
    assert sum(capture.counts().values()) == 3


def test_op_event_names_are_node_name_and_op_type() -> None:
    node = "StatefulPartitionedCall/keras_cnn_1/conv1_1/Relu"
    assert split_op_name(f"{node}:_MklNativeFusedConv2D") == (node, "_MklNativeFusedConv2D")
    for runtime_event in (
        "ExecutorState::Process",
        "KernelAndDeviceFunc::Run",
        "EagerLocalExecute: __inference_signature_wrapper___call___2114",
        "signature_wrapper___call__",
        ":Relu",
    ):
        assert split_op_name(runtime_event) is None, runtime_event


def test_captures_whose_times_do_not_fit_the_call_are_rejected() -> None:
    op = OpEvent("a/b", "MatMul", 1_100_000_000, 1_101_000_000, "tf_Compute/1")
    good = HostCapture(start_ns=1_050_000_000, stop_ns=1_250_000_000, ops=[op])
    assert clock_problem(good, 1_000_000_000, 1_300_000_000) is None
    early = HostCapture(start_ns=500_000_000, stop_ns=700_000_000, ops=[])
    assert "outside the call" in (clock_problem(early, 1_000_000_000, 1_300_000_000) or "")
    stray = OpEvent("a/c", "MatMul", 2_000_000_000, 2_000_100_000, "tf_Compute/1")
    bad = HostCapture(start_ns=1_050_000_000, stop_ns=1_250_000_000, ops=[op, stray])
    assert "1 of 2 op events" in (clock_problem(bad, 1_000_000_000, 1_300_000_000) or "")


@pytest.mark.slow
def test_the_pipeline_stores_the_capture_of_a_sampled_predict_under_its_proxy_span(
    backend: Backend, tmp_path: Path
) -> None:
    """Header-time sample -> capture -> proxy span gives the window -> spans in SQLite."""
    repository = tmp_path / "models"
    (repository / "keras_cnn" / "1").mkdir(parents=True)
    config = replace(
        pipeline_config(repository, tmp_path / "traces.db"),
        backend_protocol="tfserving",  # the backend with a capture path (Predict's)
        tf_profiler=TfProfilerSettings(f"127.0.0.1:{backend.port}", 600, tmp_path / "captures"),
    )
    registry = CollectorRegistry()
    pipeline = SamplingPipeline(config, registry, lambda model: model or "_other")
    assert pipeline.tf_capture is not None and pipeline.hub.handler is pipeline
    try:
        ignored = RequestStart(1, 1, INFER_PATH, "ModelInfer", [])  # not a Predict
        pipeline.on_sampled(ignored, new_trace_id(), new_span_id())
        assert pipeline.tf_capture.wait_idle(0) and sum(pipeline.tf_capture.counts().values()) == 0
        trace_id, span_id = new_trace_id(), new_span_id()
        start = RequestStart(1, 3, PREDICT_PATH, "Predict", [])
        pipeline.on_sampled(start, trace_id, span_id)
        time.sleep(0.3)
        run_start, run_end = backend.run()
        pipeline.hub.mark_sampled(trace_id)  # queued for replay, as the observer does
        proxy = Span(
            trace_id, span_id, None, Level.REQUEST, PREDICT_PATH, "Predict",
            run_start - 100_000, run_end + 100_000, Source.PROXY,
        )  # fmt: skip
        assert pipeline.store_spans(trace_id, [proxy])
        assert pipeline.tf_capture.wait_idle(20)
        assert pipeline.writer is not None and pipeline.writer.flush(10)
        text = scrape_registry(registry)
    finally:
        pipeline.stop()
    store = TraceStore(tmp_path / "traces.db")
    try:
        server = store.spans(trace_id, Level.SERVER)
    finally:
        store.close()
    assert server and {s.parent_id for s in server} == {span_id}
    assert any("conv1" in s.name for s in server)
    assert {s.kind for s in server} == {SPAN_KIND}
    assert sample_map(text)[("xsp_backend_captures_total", (("outcome", "ok"),))] == 1


def test_the_hub_tells_of_each_request_picked_at_header_time() -> None:
    handler = InMemoryHandler()
    hub = SamplingHub(
        Sampler(SamplingSettings(rate=1.0, budget_per_minute=60)),
        SamplingMetrics(CollectorRegistry()),
        handler,
    )
    observer = hub.observer_factory(ConnectionInfo(1, "127.0.0.1:1"))
    decision = observer.on_request_headers(RequestStart(1, 1, INFER_PATH, "ModelInfer", []))
    assert decision is not None
    [(name, traceparent)] = decision.extra_headers
    [(path, trace_id, span_id)] = handler.picked
    assert (name, path, traceparent) == ("traceparent", INFER_PATH, f"00-{trace_id}-{span_id}-01")


def test_connect_opens_the_channel_before_the_first_capture(tmp_path: Path) -> None:
    """The first capture must not wait for the connection (a short request would run first):
    `connect()` (the pipeline calls it at start) makes the channel READY with no capture."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        connected, idle = (
            TfProfilerCapture(f"127.0.0.1:{port}", 100, repository_root=tmp_path, on_spans=Stored())
            for _ in range(2)
        )
        connected.connect()
        states: dict[str, list[grpc.ChannelConnectivity]] = {"connected": [], "idle": []}
        connected._stub()  # the channel exists in both; only `connect()` connects it
        idle._stub()
        assert connected._channel is not None and idle._channel is not None
        connected._channel.subscribe(states["connected"].append)  # watch, do not connect
        idle._channel.subscribe(states["idle"].append)
        deadline = time.monotonic() + 10
        while grpc.ChannelConnectivity.READY not in states["connected"]:
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        assert grpc.ChannelConnectivity.READY not in states["idle"], states
        assert sum(connected.counts().values()) == 0  # no capture was asked for
        connected.close()
        idle.close()
    finally:
        server.stop(0)
