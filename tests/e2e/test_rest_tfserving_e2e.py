"""TF-Serving REST calls through the sidecar's HTTP plane, end to end with real TensorFlow.

The real `xsp-sidecar serve --backend-protocol tfserving` with `--http-listen` /
`--http-backend` stands in front of the stand-in for `tensorflow_model_server` (the session
fixture `tfserving`: TF-Serving's REST API on `rest_address`, its ProfilerService on its own
port), and a TF-Serving REST client (`requests`) calls it: `:predict` in row (`instances`) and
columnar (`inputs`) format, model status, metadata and a `:classify` the Keras models have no
signature for. Every call is counted under its model on a real scrape of `/metrics`
(`protocol="http"`); the answers through the sidecar are the stand-in's own, with the numbers
its gRPC Predict gives. One Predict per model is sampled at the rate, then forced ones
(`x-xsp-profile: 1`) until a capture caught one: each becomes proxy span ▸ server op spans (the
ProfilerService capture) ▸ replay M ▸ L with the Keras layer names, and the live breakdown
splits the client's latency at the server's ops as for gRPC
(tests/e2e/test_tfserving_sampling.py). A malformed Predict is relayed untouched and its replay
fails with the reason stored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from analysis.trace_analysis import TraceAnalysis
from sidecar.backends.tfserving import TF_SERVING
from sidecar.live.tf_profiler import SPAN_KIND
from sidecar.trace import schema
from sidecar.trace.spans import Level, Source, Span
from sidecar.trace.store import TraceStore, count_traces
from tests.e2e.helpers import wait_until
from tests.harness.metrics_text import sample_sum, sums_by
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.tfserving.models import CNN, CNN_LAYERS, TRANSFORMER, TRANSFORMER_LAYERS
from tests.harness.tfserving.process import TfServingServer

pytestmark = [pytest.mark.tfserving, pytest.mark.slow]

BATCH = 16  # long enough a Predict for the capture, which starts as the request arrives
EXAMPLE = {CNN: ("image", (32, 32, 3)), TRANSFORMER: ("features", (16, 32))}
LAYERS = {CNN: CNN_LAYERS, TRANSFORMER: TRANSFORMER_LAYERS}
SCOPE = {CNN: "conv1", TRANSFORMER: "attention"}  # a layer the server's op names show too
BUDGET = 6  # profiles per model per minute: 1 sampled + up to 3 forced + 1 malformed
FORCE = {"x-xsp-profile": "1"}
HTTP = {"protocol": "http"}
PHASES = ["client_total", "backend_response", "tf_ops", "outside_tf_ops", "server_after_response"]


def batch(model: str, seed: int) -> np.ndarray:
    _, shape = EXAMPLE[model]
    return np.random.default_rng(seed).standard_normal((BATCH, *shape)).astype(np.float32)


def row(model: str, seed: int) -> dict[str, Any]:
    return {"instances": batch(model, seed).tolist()}


def columnar(model: str, seed: int) -> dict[str, Any]:
    return {"inputs": {EXAMPLE[model][0]: batch(model, seed).tolist()}}


def post(base: str, path: str, body: Any, forced: bool = False) -> requests.Response:
    headers = {"Content-Type": "application/json", **(FORCE if forced else {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(base + path, data=data, headers=headers, timeout=60)


def grpc_predict(tfserving: TfServingServer, model: str, seed: int) -> np.ndarray:
    """The stand-in's gRPC Predict of the same batch, asked directly."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs[EXAMPLE[model][0]].CopyFrom(tf.make_tensor_proto(batch(model, seed)))
    with grpc.insecure_channel(tfserving.grpc_address) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(request, timeout=60)
    return np.asarray(tf.make_ndarray(response.outputs["output_0"]))


@dataclass
class Run:
    """What the module's REST traffic left behind."""

    db: Path
    proc: SidecarProcess
    metrics: str = ""
    predicts: dict[str, int] = field(default_factory=dict)  # model -> REST Predicts sent
    forced: dict[str, int] = field(default_factory=dict)  # model -> forced Predicts sent
    answers: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict)  # relayed, direct, gRPC


def captures(proc: SidecarProcess) -> dict[str, float]:
    return sums_by(proc.metrics(), "xsp_backend_captures_total", "outcome")


def settled_after(proc: SidecarProcess, before: dict[str, float]) -> dict[str, float]:
    """The captures once the one the last sampled Predict started is done."""
    assert wait_until(lambda: sum(captures(proc).values()) == sum(before.values()) + 1, 30)
    return captures(proc)


@pytest.fixture(scope="module")
def run(tfserving: TfServingServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Per model: a sampled row-format Predict, forced columnar ones until a capture caught
    one, then status, metadata, a :classify and a malformed forced Predict, all over REST."""
    root = tmp_path_factory.mktemp("rest-tfserving")
    db = root / "traces.db"
    args = [
        "--backend-protocol", "tfserving", "--model-repository", str(tfserving.model_base),
        "--db", str(db), "--otlp-port", "0", "--sample-rate", "1",
        "--sample-budget", str(BUDGET), "--duty-cycle", "1", "--iterations", "3",
        "--warmup", "1", "--tf-profiler-address", tfserving.profiler_address,
        "--tf-profiler-dir", str(root / "captures"), "--tf-profiler-capture-ms", "600",
    ]  # fmt: skip
    proc = SidecarProcess(
        tfserving.grpc_address, root / "sidecar.log", args=args,
        http_backend=tfserving.rest_address,
    )  # fmt: skip
    with proc:
        result = Run(db, proc)
        base = proc.http_url
        for model in (CNN, TRANSFORMER):
            path = f"/v1/models/{model}:predict"
            before = captures(proc)
            relayed = post(base, path, row(model, 0))
            direct = post(tfserving.rest_url, path, row(model, 0))
            result.answers[model] = (relayed, direct, grpc_predict(tfserving, model, 0))
            settled_after(proc, before)
            result.predicts[model] = 1
            for attempt in range(1, 4):
                before = captures(proc)
                reply = post(base, f"/v1/models/{model}/versions/1:predict",
                             columnar(model, attempt), forced=True)  # fmt: skip
                assert reply.status_code == 200, reply.text
                result.forced[model] = attempt
                if settled_after(proc, before)["ok"] == before.get("ok", 0) + 1:
                    break
            result.predicts[model] += result.forced[model]
            for get in (f"/v1/models/{model}", f"/v1/models/{model}/metadata"):
                assert requests.get(base + get, timeout=30).status_code == 200
        classify = {"examples": [{"x": [1.0, 2.0]}]}
        result.answers["classify"] = (
            post(base, f"/v1/models/{CNN}:classify", classify),
            post(tfserving.rest_url, f"/v1/models/{CNN}:classify", classify), None,
        )  # fmt: skip
        malformed = {"instances": [{"pixels": [0.0]}]}
        result.answers["malformed"] = (
            post(base, f"/v1/models/{CNN}:predict", malformed, forced=True),
            post(tfserving.rest_url, f"/v1/models/{CNN}:predict", malformed), None,
        )  # fmt: skip
        result.predicts[CNN] += 1
        sampled = sum(result.forced.values()) + 3  # + the two sampled + the malformed
        assert wait_until(lambda: sample_sum(proc.metrics(), "xsp_profiles_total") >= sampled, 120)
        assert wait_until(lambda: count_traces(db) >= sampled, 30), proc.log()
        result.metrics = proc.metrics()
        assert proc.alive() and "Traceback" not in proc.log(1_000_000), proc.log()
    return result


def test_every_rest_call_is_counted_under_its_model_and_method(run: Run) -> None:
    text = run.metrics
    for model, sent in run.predicts.items():
        labels = {"model": model, "method": "Predict", **HTTP}
        assert sample_sum(text, "xsp_requests_total", **labels) == sent, (model, text)
        assert sample_sum(text, "xsp_request_duration_seconds_count", **labels) == sent
        assert sample_sum(text, "xsp_request_bytes_total", **labels) > 0
        assert sample_sum(text, "xsp_response_bytes_total", **labels) > 0
        for method in ("GetModelStatus", "GetModelMetadata"):
            assert sample_sum(text, "xsp_requests_total", model=model, method=method, **HTTP) == 1
        assert sample_sum(text, "xsp_requests_total", model=model, protocol="grpc") == 0
    classify = {"model": CNN, "method": "Classify", **HTTP}
    assert sample_sum(text, "xsp_requests_total", grpc_code="INVALID_ARGUMENT", **classify) == 1
    refused = {"model": CNN, "method": "Predict", "grpc_code": "INVALID_ARGUMENT", **HTTP}
    assert sample_sum(text, "xsp_requests_total", **refused) == 1  # the malformed one


def test_answers_through_the_sidecar_are_the_stand_ins_with_grpcs_numbers(run: Run) -> None:
    for model in (CNN, TRANSFORMER):
        relayed, direct, numbers = run.answers[model]
        assert relayed.status_code == direct.status_code == 200
        assert relayed.content == direct.content  # the bytes went unchanged
        predictions = np.asarray(relayed.json()["predictions"], dtype=np.float32)
        np.testing.assert_array_equal(predictions, numbers)
    for name in ("classify", "malformed"):
        relayed, direct, _ = run.answers[name]
        assert relayed.status_code == direct.status_code == 400, name
        assert relayed.content == direct.content, name
    assert run.answers["classify"][0].json()["error"].startswith("No classification inputs")
    assert "does not have named input: pixels" in run.answers["malformed"][0].json()["error"]


def traces_of(db: Path, model: str, reason: str, status: str = "ok") -> list[list[Span]]:
    store = TraceStore(db)
    try:
        found = [
            t for t in store.list_traces(model=model)
            if t.sample_reason == reason and t.status == status
        ]  # fmt: skip
        return [store.spans(t.trace_id) for t in found]
    finally:
        store.close()


@pytest.mark.parametrize("model", [CNN, TRANSFORMER])
def test_sampled_and_forced_rest_predicts_give_proxy_server_model_and_keras_layer_spans(
    run: Run, model: str
) -> None:
    sampled, forced = traces_of(run.db, model, "rate"), traces_of(run.db, model, "forced")
    assert len(sampled) == 1 and len(forced) == run.forced[model], run.proc.log()
    store = TraceStore(run.db)
    try:
        traces = [store.get_trace(spans[0].trace_id) for spans in [*sampled, *forced]]
    finally:
        store.close()
    for trace in traces:
        assert trace is not None and trace.batch_size == BATCH
        assert trace.attributes["method"] == TF_SERVING.http_replayable["Predict"]  # its job's
        assert trace.attributes["signature_name"] == "serving_default"
    with_server = []
    for spans in [*sampled, *forced]:
        (request,) = [s for s in spans if s.level is Level.REQUEST]
        assert (request.source, request.kind, request.parent_id) == (Source.PROXY, "Predict", None)
        assert request.attributes[schema.PROTOCOL] == "http"  # the relay that saw it
        (replay,) = [s for s in spans if s.level is Level.MODEL]
        assert (replay.source, replay.parent_id) == (Source.REPLAY, request.span_id)
        layers = {s.name for s in spans if s.level is Level.LAYER}
        assert set(LAYERS[model]) <= layers, sorted(layers)
        server = [s for s in spans if s.level is Level.SERVER]
        assert {(s.source, s.kind, s.parent_id) for s in server} <= {
            (Source.BACKEND, SPAN_KIND, request.span_id)
        }
        if server:
            with_server.append(server)
    assert with_server, f"no {model} trace has server spans: {run.metrics}"
    assert any(f"/{SCOPE[model]}" in s.name for s in with_server[-1])


def test_the_malformed_rest_predicts_replay_fails_with_its_reason(run: Run) -> None:
    (spans,) = traces_of(run.db, CNN, "forced", status="error")
    store = TraceStore(run.db)
    try:
        trace = store.get_trace(spans[0].trace_id)
    finally:
        store.close()
    assert trace is not None and "pixels" in trace.error, trace
    outcomes = sums_by(run.metrics, "xsp_profiles_total", "outcome")
    assert outcomes["error"] == 1
    assert outcomes["ok"] == sum(run.forced.values()) + 2
    assert sample_sum(run.metrics, "xsp_profiler_worker_restarts_total") == 0


def test_the_live_breakdown_splits_rest_latency_at_the_servers_op_events(run: Run) -> None:
    """As for gRPC: the op events' envelope, clipped to the request's window at the relay,
    splits the client's latency (docs/contracts.md)."""
    expected: dict[str, dict[str, list[float]]] = {}
    store = TraceStore(run.db)
    try:
        for trace in store.list_traces():
            if trace.status != "ok":
                continue
            spans = store.spans(trace.trace_id)
            (request,) = [s for s in spans if s.level is Level.REQUEST]
            ops = [s for s in spans if s.kind == SPAN_KIND]
            marks = request.attributes
            client = request.end_ns - request.start_ns
            cut = marks["relay_response_start_ns"] - request.start_ns
            phases = expected.setdefault(trace.model, {"client_total": []})
            phases["client_total"].append(client / 1e6)
            phases.setdefault("backend_response", []).append(
                (marks["relay_response_start_ns"] - marks["relay_request_end_ns"]) / 1e6
            )
            if ops:
                first = min(s.start_ns for s in ops) - request.start_ns
                last = max(s.end_ns for s in ops) - request.start_ns
                tf_ops = max(min(last, cut) - max(first, 0), 0)
                phases.setdefault("tf_ops", []).append(tf_ops / 1e6)
                phases.setdefault("outside_tf_ops", []).append((client - tf_ops) / 1e6)
                phases.setdefault("server_after_response", []).append(max(last - cut, 0) / 1e6)
    finally:
        store.close()
    res = TraceAnalysis.from_paths([run.db]).result("live_breakdown")
    assert res.ok, res.reason
    table = res.table
    assert set(table["model"]) == {CNN, TRANSFORMER}
    assert (table["mean_ms"] >= 0).all()
    for line in table.itertuples():
        values = expected[line.model][line.phase]
        assert line.requests == len(values)
        assert line.mean_ms == pytest.approx(float(np.mean(values)), abs=1e-6)
    for model in (CNN, TRANSFORMER):
        assert list(table[table["model"] == model]["phase"]) == PHASES
