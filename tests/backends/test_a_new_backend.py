"""A third backend plugged in through one record (`toy`: a made-up scoring service) is picked
up by the relay's model-name lookup and method labels (the real frame scanner and metrics),
the sampling hook's replayable-method check, the replay's decoder and repository lookup (a
real ONNX Runtime replay into real SQLite), and the config's backend choice (real parsing),
each given the record as a sidecar started with `--backend-protocol toy` gives it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client import CollectorRegistry

from sidecar import backends
from sidecar.backends.base import (
    Backend,
    DecodedInputs,
    Readiness,
    Repository,
    SpanSource,
)
from sidecar.backends.model_repository import ModelLocation
from sidecar.config import load_serve_config
from sidecar.config_parsers import ConfigError
from sidecar.endpoint import Endpoint
from sidecar.health import BackendChecker
from sidecar.profiling.formats import ModelFormat
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionInfo, ConnectionTracker, RequestStart
from sidecar.replay.context import ReplayContext
from sidecar.replay.options import ReplayOptions
from sidecar.replay.replay_job import decode_request, replay_job
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings
from sidecar.serve import sampling_config
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.proxy.proxy_h2build import Conversation, grpc_message
from tests.sampling.test_observer import InMemoryHandler

SCORE = "/toy.v1.Scorer/Score"


def score_request(model: str, values: np.ndarray) -> bytes:
    """`ScoreRequest{bytes values = 1; string model = 2}`: the name is not the first field."""
    raw = values.astype("<f4").tobytes()
    name = model.encode()
    return b"\x0a" + bytes([len(raw)]) + raw + b"\x12" + bytes([len(name)]) + name


def decode_score(message: bytes) -> DecodedInputs:
    values = np.frombuffer(message[2 : 2 + message[1]], "<f4").reshape(1, -1)
    return DecodedInputs({"x": values.copy()}, attributes={"toy": True})


def find_toy_model(root: Path, model: str, version: str | int | None = None) -> ModelLocation:
    """The toy's layout: one `<root>/<model>.onnx` per model, no versions."""
    return ModelLocation(
        name=model, version="1", path=root / f"{model}.onnx", format=ModelFormat.ONNX
    )


TOY = Backend(
    name="toy",
    methods={SCORE: (2,), "/toy.v1.Scorer/Ready": None},
    replayable={"Score": "Score"},
    decoders={"Score": decode_score},
    repository=Repository(
        layout="<root>/<model>.onnx",
        contains=lambda root, model: (root / f"{model}.onnx").is_file(),
        find=find_toy_model,
    ),
    readiness=Readiness(rpc="/toy.v1.Scorer/Ready", ready_response=b"\x08\x01"),
    spans=SpanSource.PROFILER_CAPTURE,
    capture_path=SCORE,
)


@pytest.fixture
def toy() -> Iterator[Backend]:
    backends.register(TOY)
    try:
        yield TOY
    finally:
        backends.unregister("toy")
    assert "toy" not in backends.BACKENDS


def test_the_relay_reads_the_model_name_where_the_record_says(toy: Backend) -> None:
    registry = CollectorRegistry()
    tracker = ConnectionTracker(ProxyMetrics(registry, methods=toy.by_path))
    conv = Conversation()
    conv.request(1, SCORE, score_request("ranker", np.arange(4)))
    conv.response(1, b"\x08\x01")
    tracker.request_scanner.observe(bytes(conv.client))
    tracker.response_scanner.observe(bytes(conv.server))
    labels = {"method": "Score", "model": "ranker", "grpc_code": "OK", "protocol": "grpc"}
    assert registry.get_sample_value("xsp_requests_total", labels) == 1


class RepositoryHandler(InMemoryHandler):
    """The in-memory handler, knowing the models the toy backend's repository lookup finds."""

    def __init__(self, backend: Backend, repository: Path) -> None:
        super().__init__()
        self.backend, self.repository = backend, repository

    def known_model(self, model: str) -> bool:
        return self.backend.repository.contains(self.repository, model)


def test_a_replayable_call_is_sampled_decoded_and_replayed(toy: Backend, tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "toy", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
              str(tmp_path / "ranker.onnx"))  # fmt: skip
    handler = RepositoryHandler(toy, tmp_path)
    hub = SamplingHub(
        Sampler(SamplingSettings(rate=1.0, budget_per_minute=60)),
        SamplingMetrics(CollectorRegistry()),
        handler,
        backend=toy,
    )
    observer = hub.observer_factory(ConnectionInfo(1, "127.0.0.1:5"))
    decision = observer.on_request_headers(RequestStart(1, 1, SCORE, "Score", []))
    assert decision is not None and decision.capture_body
    message = score_request("ranker", np.array([-1.0, 2.0, -3.0, 4.0]))
    observer.on_request_body(1, "ranker", grpc_message(message))
    [job] = handler.jobs
    assert job.method == "Score"
    request = decode_request(job, toy)
    assert request is not None and request.inputs["x"].tolist() == [[-1.0, 2.0, -3.0, 4.0]]

    options = ReplayOptions(
        model_repository=tmp_path, db_path=tmp_path / "t.db", levels=(Level.MODEL,),
        iterations=1, warmup=0, store_raw_inputs=False, device="cpu", backend_protocol="toy",
    )  # fmt: skip
    result = replay_job(job, ReplayContext(options=options))
    assert result.outcome == "ok", result.error
    store = TraceStore(tmp_path / "t.db")
    try:
        trace = store.get_trace(job.trace_id)
    finally:
        store.close()
    assert trace is not None and trace.attributes["toy"] is True
    assert trace.attributes["model_path"] == str(tmp_path / "ranker.onnx")


def test_the_config_offers_the_backend_and_follows_its_record(toy: Backend, tmp_path: Path) -> None:
    config = load_serve_config(
        {"backend_protocol": "TOY", "model_repository": str(tmp_path)}, env={}
    )
    assert config.backend_protocol == "toy"
    assert BackendChecker(Endpoint("127.0.0.1", 1), "toy").readiness == toy.readiness
    with_capture = load_serve_config(
        {"backend_protocol": "toy", "model_repository": str(tmp_path),
         "tf_profiler_address": "backend"}, env={},
    )  # fmt: skip
    assert sampling_config(with_capture).tf_profiler is not None  # its spans: a capture
    triton = load_serve_config(
        {"model_repository": str(tmp_path), "tf_profiler_address": "backend"}, env={}
    )
    with pytest.raises(ConfigError, match="needs --backend-protocol tfserving or toy"):
        sampling_config(triton)
    with pytest.raises(ConfigError, match="expected one of triton, tfserving, toy, got 'nope'"):
        load_serve_config({"backend_protocol": "nope"}, env={})


def test_a_record_that_contradicts_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="no decoder"):
        Backend("bad", {SCORE: (2,)}, {"Score": "Score"}, {}, TOY.repository,
                TOY.readiness, SpanSource.OTLP)  # fmt: skip
    with pytest.raises(ValueError, match="a backend named 'triton' is already registered"):
        backends.register(
            Backend("triton", {"/inference.GRPCInferenceService/ModelInfer": (1,)}, {}, {},
                    TOY.repository, TOY.readiness, SpanSource.OTLP)
        )  # fmt: skip


def test_the_relay_loads_no_decoder_or_runtime() -> None:
    """The records are read by the relay's process: their decoders and repository lookups load
    numpy, tritonclient, TensorFlow and the runners only in the worker."""
    code = (
        "import sys, sidecar.proxy.relay, sidecar.backends\n"
        "heavy = ('numpy', 'tritonclient', 'tensorflow', 'onnxruntime', 'sidecar.profiling')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
