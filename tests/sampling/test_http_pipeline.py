"""The HTTP plane through the whole `SamplingPipeline`: a KServe v2 HTTP request built by
`tritonclient.http` (binary tensors), handed to the pipeline's HTTP hook as the HTTP relay
hands it over (I3), replayed by the real profiling worker process on Triton's test model
`simple_cnn` into a real SQLite store; and TF-Serving's profiler capture fired by a sampled REST
Predict as by a gRPC one."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client import CollectorRegistry

from sidecar.backends.tfserving import PREDICT_PATH
from sidecar.proxy.streams import ConnectionInfo, HeaderDecision, RequestStart, StreamEnd
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.pipeline import SamplingPipeline, TfProfilerSettings
from sidecar.sampling.settings import SamplingSettings
from sidecar.trace import schema
from sidecar.trace.spans import Level, Source, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.triton.model_repo import build_model_repository
from tests.sampling.test_pipeline import sampling_config

TARGET = "/v2/models/simple_cnn/infer"


def wait_for(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_sampled_http_inference_is_replayed_into_the_store(tmp_path: Path) -> None:
    repository = build_model_repository(tmp_path / "models")
    db = tmp_path / "traces.db"
    config = replace(
        sampling_config(repository, db),
        settings=SamplingSettings(rate=1.0, duty_cycle=1.0),
        profile_timeout_s=120.0,
    )
    pipeline = SamplingPipeline(config, CollectorRegistry(), lambda model: model or "_unknown")
    pipeline.start()
    try:
        data = np.random.default_rng(0).random((2, 3, 32, 32), np.float32)
        tensor = httpclient.InferInput("input", [2, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(data, binary_data=True)
        body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor])
        assert json_size is not None
        headers = [(b":method", b"POST"), (b":path", TARGET.encode()),
                   (b"content-type", b"application/octet-stream"),
                   (b"inference-header-content-length", str(json_size).encode())]  # fmt: skip
        observer = pipeline.http_observer_factory(ConnectionInfo(1, "127.0.0.1:5"))
        assert observer is not None
        decision = observer.on_request_headers(RequestStart(1, 1, TARGET, "ModelInfer", headers))
        assert isinstance(decision, HeaderDecision) and decision.capture_body
        ((_, traceparent),) = decision.extra_headers
        trace_id, span_id = traceparent.split("-")[1:3]
        observer.on_request_body(1, "simple_cnn", bytes(body))
        end = StreamEnd(1, 1, TARGET, "ModelInfer", "simple_cnn", "OK", "", time.time_ns(),
                        0.003, len(body), 120, True, 0.0005, 0.002)  # fmt: skip
        observer.on_stream_end(end)
        store = TraceStore(db)
        try:

            def replayed() -> bool:
                trace = store.get_trace(trace_id)
                return trace is not None and any(
                    s.level is Level.MODEL for s in store.spans(trace_id)
                )

            assert wait_for(replayed, 120)
            trace = store.get_trace(trace_id)
            spans = store.spans(trace_id)
        finally:
            store.close()
    finally:
        pipeline.stop()
    assert trace is not None and trace.status == "ok", trace and trace.error
    assert trace.batch_size == 2 and trace.sample_reason == "rate"
    assert trace.attributes[schema.METHOD] == "HttpModelInfer"
    assert trace.attributes[schema.INPUT_SOURCE] == "request"
    ((shape_input),) = trace.attributes[schema.INPUTS]
    assert shape_input["shape"] == [2, 3, 32, 32]
    (request,) = [s for s in spans if s.level is Level.REQUEST]
    assert (request.span_id, request.source, request.kind) == (span_id, Source.PROXY, "ModelInfer")
    assert request.name == request.attributes[schema.PATH] == TARGET
    assert request.attributes[schema.PROTOCOL] == "http"
    (model,) = [s for s in spans if s.level is Level.MODEL]
    assert model.parent_id == span_id


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_sampled_rest_predict_gets_a_profiler_capture(tmp_path: Path) -> None:
    """TF-Serving's capture fires on the method label: a REST Predict as a gRPC one, no other
    call of either protocol; the job of either waits for the capture's spans."""
    repository = tmp_path / "models"
    (repository / "half" / "1").mkdir(parents=True)
    config = replace(
        sampling_config(repository, tmp_path / "traces.db"),
        backend_protocol="tfserving",
        tf_profiler=TfProfilerSettings(f"127.0.0.1:{_closed_port()}", 100, tmp_path / "caps"),
    )
    pipeline = SamplingPipeline(config, CollectorRegistry(), lambda model: model or "_unknown")
    capture = pipeline.tf_capture
    assert capture is not None
    try:
        for start in (
            RequestStart(1, 1, "/v1/models/half", "GetModelStatus", []),
            RequestStart(1, 2, "/v1/models/half:classify", "Classify", []),
            RequestStart(1, 3, "/tensorflow.serving.PredictionService/Classify", "Classify", []),
        ):
            pipeline.on_sampled(start, new_trace_id(), new_span_id())
        assert capture.wait_idle(5) and sum(capture.counts().values()) == 0
        pipeline.on_sampled(
            RequestStart(1, 4, "/v1/models/half:predict", "Predict", []),
            new_trace_id(), new_span_id(),
        )  # fmt: skip
        assert capture.wait_idle(20) and capture.counts()["unavailable"] == 1
        pipeline.on_sampled(
            RequestStart(1, 5, PREDICT_PATH, "Predict", []), new_trace_id(), new_span_id()
        )
        assert capture.wait_idle(20) and capture.counts()["unavailable"] == 2
        for method in ("Predict", "HttpPredict"):
            job = ProfileJob("ab" * 16, "cd" * 8, "half", method, b"", "rate", 0)
            assert pipeline._no_backend_spans(job) is None
    finally:
        pipeline.stop()
