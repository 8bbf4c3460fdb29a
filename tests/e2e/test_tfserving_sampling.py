"""Sampled TF-Serving Predicts turned into traces and a report, end to end with real TensorFlow.

The real sidecar (`xsp-sidecar serve --backend-protocol tfserving`) stands in front of the
stand-in for `tensorflow_model_server` (the session fixture `tfserving`, with TensorFlow's
profiler server on its own port); its model repository is the stand-in's model base path and
its ProfilerService capture shares a folder with the stand-in. Forced Predicts for the Keras
CNN and the Keras transformer block give proxy span ▸ server spans (the capture's op events)
▸ replay M ▸ L with the Keras layer names; malformed Predicts are relayed untouched and their
replay fails with the reason stored. `analysis/report.py` then reads the database.
(Outputs through the relay identical to direct: tests/e2e/test_tfserving_relay.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from analysis.trace_analysis import TraceAnalysis
from sidecar.live.tf_profiler import CAPTURE_OUTCOMES, SPAN_KIND
from sidecar.trace.spans import Level, Source, Span
from sidecar.trace.store import TraceStore, count_traces
from tests.e2e.helpers import wait_until
from tests.harness.metrics_text import sample_sum, sums_by
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.tfserving.models import CNN, CNN_LAYERS, TRANSFORMER, TRANSFORMER_LAYERS
from tests.harness.tfserving.process import TfServingServer

pytestmark = [pytest.mark.tfserving, pytest.mark.slow]

REPO = Path(__file__).parents[2]
PREDICT = "/tensorflow.serving.PredictionService/Predict"
FORCE = (("x-xsp-profile", "1"),)
BATCH = 16  # long enough a Predict for the capture, which starts as the request arrives
INPUTS = {CNN: ("image", (BATCH, 32, 32, 3)), TRANSFORMER: ("features", (BATCH, 16, 32))}
LAYERS = {CNN: CNN_LAYERS, TRANSFORMER: TRANSFORMER_LAYERS}
LAYER_TYPES = {CNN: {"conv1": "Conv2D", "pool1": "MaxPooling2D", "fc": "Dense"},
               TRANSFORMER: {"attention": "MultiHeadAttention", "norm1": "LayerNormalization",
                             "ffn_up": "Dense"}}  # fmt: skip
SCOPE = {CNN: "conv1", TRANSFORMER: "attention"}  # a layer the server's op names show too


def predict_request(model: str, seed: int = 0) -> predict_pb2.PredictRequest:
    alias, shape = INPUTS[model]
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    value = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return request


def call(address: str, request: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    with grpc.insecure_channel(address) as channel:
        reply: bytes = channel.unary_unary(PREDICT, None, None)(
            request, metadata=metadata, timeout=60
        )
        return reply


def failure(address: str, request: bytes, forced: bool = False) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(address, request, FORCE if forced else ())
    return info.value.code(), info.value.details()


@dataclass
class Run:
    """What the module's traffic left behind."""

    db: Path
    proc: SidecarProcess
    metrics: str = ""
    forced: dict[str, int] = field(default_factory=dict)  # model -> forced Predicts sent
    malformed: dict[str, tuple[object, object]] = field(default_factory=dict)  # (direct, relay)


def captures(proc: SidecarProcess) -> dict[str, float]:
    return sums_by(proc.metrics(), "xsp_backend_captures_total", "outcome")


def forced_until_captured(proc: SidecarProcess, model: str, tries: int = 3) -> int:
    """Forced Predicts for `model`, one capture at a time, until the capture caught one
    (a capture starts as the request arrives, and on a loaded machine the profiler may start
    after a short Predict is done: it is then counted `no_ops`, and a fresh one is sent)."""
    for attempt in range(1, tries + 1):
        before = captures(proc)
        call(proc.address, predict_request(model, attempt).SerializeToString(), FORCE)
        settled = sum(before.values()) + 1
        assert wait_until(lambda n=settled: sum(captures(proc).values()) == n, 30)
        if captures(proc)["ok"] == before["ok"] + 1:
            return attempt
    return tries


@pytest.fixture(scope="module")
def run(tfserving: TfServingServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Forced Predicts for both models, then malformed ones, through the sampling sidecar."""
    root = tmp_path_factory.mktemp("tfserving-sampling")
    db = root / "traces.db"
    args = [
        "--backend-protocol", "tfserving", "--model-repository", str(tfserving.model_base),
        "--db", str(db), "--otlp-port", "0", "--sample-rate", "0", "--duty-cycle", "1",
        "--iterations", "3", "--warmup", "1",
        "--tf-profiler-address", tfserving.profiler_address,
        "--tf-profiler-dir", str(root / "captures"), "--tf-profiler-capture-ms", "600",
    ]  # fmt: skip
    proc = SidecarProcess(tfserving.grpc_address, root / "sidecar.log", args=args)
    with proc:
        result = Run(db, proc)
        for model in (CNN, TRANSFORMER):
            result.forced[model] = forced_until_captured(proc, model)
        ill_shaped = predict_request(CNN)
        ill_shaped.inputs["image"].tensor_content = ill_shaped.inputs["image"].tensor_content[:-3]
        extra_input = predict_request(TRANSFORMER)
        extra_input.inputs["mask"].CopyFrom(tf.make_tensor_proto(np.ones((BATCH, 16), np.int32)))
        for name, message in (("ill_shaped", ill_shaped), ("extra_input", extra_input)):
            request = message.SerializeToString()
            direct = failure(tfserving.grpc_address, request)
            result.malformed[name] = (direct, failure(proc.address, request, forced=True))
        garbage = b"\xff\xfe not a PredictRequest \x00\x01"
        result.malformed["garbage"] = (
            failure(tfserving.grpc_address, garbage), failure(proc.address, garbage, forced=True)
        )  # fmt: skip
        sampled = sum(result.forced.values()) + 2  # the garbage has no model: not replayed
        assert wait_until(lambda: sample_sum(proc.metrics(), "xsp_profiles_total") >= sampled, 120)
        assert wait_until(lambda: count_traces(db) >= sampled, 30), proc.log()
        assert wait_until(lambda: sum(captures(proc).values()) == sampled + 1, 30), captures(proc)
        result.metrics = proc.metrics()
        assert proc.alive() and "Traceback" not in proc.log(1_000_000), proc.log()
    return result


def trace_spans(db: Path, model: str) -> list[list[Span]]:
    """The spans of every ok trace of `model` that has server spans."""
    store = TraceStore(db)
    try:
        traces = [t for t in store.list_traces() if t.model == model and t.status == "ok"]
        spans = [store.spans(t.trace_id) for t in traces]
    finally:
        store.close()
    return [s for s in spans if any(span.level is Level.SERVER for span in s)]


@pytest.mark.parametrize("model", [CNN, TRANSFORMER])
def test_a_forced_predict_gives_proxy_server_model_and_keras_layer_spans(
    run: Run, model: str
) -> None:
    with_server = trace_spans(run.db, model)
    assert with_server, f"no trace of {model} with server spans; captures: {run.metrics}"
    spans = with_server[0]
    store = TraceStore(run.db)
    try:
        trace = store.get_trace(spans[0].trace_id)
    finally:
        store.close()
    assert trace is not None
    assert (trace.sample_reason, trace.batch_size) == ("forced", BATCH)
    assert trace.attributes["method"] == "Predict"
    assert trace.attributes["model_format"] == "savedmodel"
    assert trace.attributes["signature_name"] == "serving_default"

    (request,) = [s for s in spans if s.level is Level.REQUEST]
    assert (request.source, request.kind, request.parent_id) == (Source.PROXY, "Predict", None)
    assert request.attributes["grpc_code"] == "OK"

    server = [s for s in spans if s.level is Level.SERVER]
    assert {(s.source, s.kind, s.parent_id) for s in server} == {
        (Source.BACKEND, SPAN_KIND, request.span_id)
    }
    assert all(s.end_ns >= request.start_ns and s.start_ns <= request.end_ns for s in server)
    assert any(f"/{SCOPE[model]}" in s.name for s in server), [s.name for s in server]

    (replay,) = [s for s in spans if s.level is Level.MODEL]
    assert (replay.source, replay.parent_id) == (Source.REPLAY, request.span_id)
    layers = [s for s in spans if s.level is Level.LAYER]
    assert layers and {s.parent_id for s in layers} == {replay.span_id}
    names = {s.name: s for s in layers}
    assert set(LAYERS[model]) <= set(names), sorted(names)
    for name, layer_type in LAYER_TYPES[model].items():
        assert names[name].kind == layer_type, (name, names[name].kind)


def test_every_sampled_predicts_capture_is_counted_on_metrics(run: Run) -> None:
    counts = {o: round(n) for o, n in sums_by(run.metrics, "xsp_backend_captures_total",
                                              "outcome").items()}  # fmt: skip
    assert set(counts) == set(CAPTURE_OUTCOMES)
    forced = sum(run.forced.values())
    assert sum(counts.values()) == forced + 3  # every Predict picked at header time
    assert counts["ok"] >= len(run.forced)  # one capture per model caught its Predict
    # a capture that missed a valid Predict found no ops in its window; nothing else failed
    missed = forced - len(run.forced)
    assert counts["ok"] + counts["no_ops"] >= forced and counts["no_ops"] <= missed + 3
    for outcome in ("unavailable", "unimplemented", "timeout", "unreadable", "error"):
        assert counts[outcome] == 0, counts
    # the garbage Predict's capture found nothing to keep: it was never replayed
    assert counts["dropped"] + counts["no_ops"] >= 1


def test_malformed_predicts_are_relayed_untouched_and_their_replays_fail_with_a_reason(
    run: Run,
) -> None:
    for name, (direct, relayed) in run.malformed.items():
        assert relayed == direct, name
    assert run.malformed["ill_shaped"][0] == (
        grpc.StatusCode.INVALID_ARGUMENT, "tensor parsing error: image"
    )  # fmt: skip
    store = TraceStore(run.db)
    try:
        failed = {t.model: t for t in store.list_traces() if t.status == "error"}
    finally:
        store.close()
    assert set(failed) == {CNN, TRANSFORMER}
    assert failed[CNN].sample_reason == "forced"
    assert failed[CNN].error.startswith("PredictDecodeError: "), failed[CNN].error
    assert "image" in failed[CNN].error
    assert "mask" in failed[TRANSFORMER].error, failed[TRANSFORMER].error
    outcomes = sums_by(run.metrics, "xsp_profiles_total", "outcome")
    assert outcomes["error"] == 2
    assert outcomes["ok"] == sum(run.forced.values())
    assert sample_sum(run.metrics, "xsp_profiler_worker_restarts_total") == 0
    dropped = sums_by(run.metrics, "xsp_samples_dropped_total", "reason")
    assert dropped == {"unreadable_request": 1}  # the garbage: no model to replay


def report_json(db: Path, *only: str) -> dict[str, object]:
    cmd = [sys.executable, str(REPO / "analysis" / "report.py"), str(db), "--format", "json"]
    cmd += ["--only", ",".join(only)] if only else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed: dict[str, object] = json.loads(done.stdout)
    return parsed


def test_the_report_gives_a1_to_a7_with_keras_layer_names(run: Run) -> None:
    ta = TraceAnalysis.from_paths([run.db])
    for key in ("A1", "A2", "A3", "A5", "A6"):
        assert ta.result(key).ok, (key, ta.result(key).reason)
    for key in ("A4", "A7"):  # TensorFlow's host tracer records no allocations per layer
        assert ta.result(key).status == "not_captured", key
    a1 = ta.result("A1").table.set_index("model")
    assert set(a1.index) == {CNN, TRANSFORMER}
    assert (a1["batch_size"] == BATCH).all() and (a1["latency_ms"] > 0).all()
    a2 = ta.result("A2").table
    for model, layers in LAYERS.items():
        rows = a2[a2["model"] == model].set_index("name")
        assert set(layers) <= set(rows.index), sorted(rows.index)
        for name, layer_type in LAYER_TYPES[model].items():
            assert rows.loc[name, "type"] == layer_type
        assert (rows.loc[list(layers), "latency_ms"] > 0).all()
    a3 = ta.result("A3").table
    order = list(a3[a3["model"] == CNN]["name"])
    assert [n for n in order if n in CNN_LAYERS] == list(CNN_LAYERS)  # execution order
    a6 = ta.result("A6").table
    cnn_types = set(a6[a6["model"] == CNN]["type"])
    assert {"Conv2D", "MaxPooling2D", "GlobalAveragePooling2D", "Dense"} <= cnn_types
    # the CLI reports the same, and tells of the failed profiles
    report = report_json(run.db)
    text = json.dumps(report)
    assert all(name in text for name in (*CNN_LAYERS, *TRANSFORMER_LAYERS))
    assert "PredictDecodeError" in text


def test_the_live_breakdown_splits_client_latency_at_the_servers_op_events(run: Run) -> None:
    """The op events' envelope, clipped to the request's window at the relay (its first byte
    to the response's first byte), splits the client's latency; the relay's time to respond
    and the ops after the response are shown apart (docs/contracts.md)."""
    expected: dict[str, dict[str, list[float]]] = {}
    store = TraceStore(run.db)
    try:
        for trace in store.list_traces():
            if trace.status != "ok":
                continue  # failed profiles are left out of every analysis
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
                after = max(last - cut, 0)
                phases.setdefault("server_after_response", []).append(after / 1e6)
    finally:
        store.close()
    res = TraceAnalysis.from_paths([run.db]).result("live_breakdown")
    assert res.ok, res.reason
    table = res.table
    assert set(table["model"]) == {CNN, TRANSFORMER}
    assert (table["mean_ms"] >= 0).all()
    for row in table.itertuples():
        values = expected[row.model][row.phase]  # no Triton phase: KeyError
        assert row.requests == len(values)
        assert row.mean_ms == pytest.approx(float(np.mean(values)), abs=1e-6)
    for model in (CNN, TRANSFORMER):
        order = list(table[table["model"] == model]["phase"])
        assert order == [
            "client_total", "backend_response", "tf_ops", "outside_tf_ops",
            "server_after_response",
        ]  # fmt: skip
    assert any(note.startswith("tf_ops: from the first to the last") for note in res.notes)
