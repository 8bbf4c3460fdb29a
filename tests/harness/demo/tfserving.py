"""The demo on TF-Serving: the stand-in for `tensorflow_model_server` with the Keras sample
models, the sidecar in front (sampling, the server's side captured by TensorFlow's
ProfilerService), Predict traffic over gRPC and over TF-Serving's REST API (through the
sidecar's HTTP plane), forced samples, the console summary and the report.

The stand-in is real TensorFlow behind TF-Serving's gRPC and REST APIs
(`tests.harness.tfserving`): the binary cannot be installed here. Everything runs on this
machine on free ports and ends by itself; the results stay in the output folder. This process
loads TensorFlow (it builds the Keras models and encodes the Predict requests); the sidecar
itself does not.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import requests
from tqdm import tqdm

from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.harness.demo.failures import tensorflow_missing
from tests.harness.demo.rest import RestTraffic, json_client, post_json
from tests.harness.demo.triton import (
    BUDGET_PER_MINUTE,
    DUTY_CYCLE,
    DemoOptions,
    await_sampled,
    fresh_database,
    record_and_account,
    report_and_sweep,
    say,
    send_forced,
)
from tests.harness.metrics_text import sums_by
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.tfserving.models import CNN, TRANSFORMER, build_model_base
from tests.harness.tfserving.process import TfServingServer

FORCEABLE = (CNN, TRANSFORMER)
MODEL_FOLDER = "tfserving-models"  # in the output folder; the Triton demo has its own
PREDICT = "/tensorflow.serving.PredictionService/Predict"
CAPTURES = "xsp_backend_captures_total"
CAPTURE_MS = 500  # long enough for a Predict to run inside the capture that its arrival starts
FORCED_BATCH = 32  # a forced Predict long enough to outlast the start of its capture
# model -> (input alias, shape of one example)
EXAMPLES = {CNN: ("image", (32, 32, 3)), TRANSFORMER: ("features", (16, 32))}


def predict_request(model: str, batch: int, rng: np.random.Generator) -> bytes:
    """A serialized `PredictRequest` for `model` with a random batch (TensorFlow's encoding)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    alias, shape = EXAMPLES[model]
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    value = rng.standard_normal((batch, *shape)).astype(np.float32)
    request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    data: bytes = request.SerializeToString()
    return data


class PredictClient:
    """Raw Predict calls through the relay (the reply is not decoded)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.predict: Any = self.channel.unary_unary(PREDICT, None, None)

    def __call__(self, request: bytes, forced: bool = False) -> None:
        metadata = (("x-xsp-profile", "1"),) if forced else ()
        self.predict(request, metadata=metadata, timeout=60)

    def close(self) -> None:
        self.channel.close()


def send_traffic(client: PredictClient, options: DemoOptions) -> dict[str, int]:
    """keras_cnn (batch 1-4) and keras_transformer Predicts through the sidecar."""
    rng = np.random.default_rng(0)
    counts = {"ok": 0, "error": 0}
    for i in tqdm(range(options.requests), desc="Predicts through the sidecar", unit="req"):
        model = TRANSFORMER if i % 3 == 2 else CNN
        try:
            client(predict_request(model, 1 + i % 4, rng))
            counts["ok"] += 1
        except grpc.RpcError:
            counts["error"] += 1
    return counts


def rest_body(model: str, i: int, rng: np.random.Generator) -> dict[str, Any]:
    """A REST Predict body: keras_cnn in row format (`instances`, batch 1-4), keras_transformer
    in columnar format (`inputs`, named)."""
    alias, shape = EXAMPLES[model]
    value = rng.standard_normal((1 + i % 4, *shape)).astype(np.float32).tolist()
    return {"instances": value} if model == CNN else {"inputs": {alias: value}}


def send_rest_traffic(url: str, options: DemoOptions) -> RestTraffic:
    """REST Predicts through the sidecar's HTTP plane at `url`, as TF-Serving REST clients
    send them: `requests` with row (`instances`) or columnar (`inputs`) JSON, and every fifth
    with curl (`post_json`)."""
    rng = np.random.default_rng(2)
    rest = RestTraffic()
    rows, columns = "requests (instances)", "requests (inputs)"
    plain = f"{json_client()} (JSON)"
    with requests.Session() as session:  # one kept-alive connection, as a client keeps it
        for i in tqdm(range(options.rest_requests), desc="REST Predicts through the sidecar",
                      unit="req"):  # fmt: skip
            model = TRANSFORMER if i % 3 == 2 else CNN
            path = f"{url}/v1/models/{model}:predict"
            body = rest_body(model, i, rng)
            if i % 5 == 4:
                status, _ = post_json(path, body)
                rest.add(plain, ok=status == 200)
                continue
            try:
                ok = session.post(path, json=body, timeout=60).status_code == 200
            except requests.RequestException:
                ok = False
            rest.add(rows if model == CNN else columns, ok=ok)
    return rest


def capture_lines(metrics_text: str) -> list[str]:
    """The server's side of the sampled Predicts: the ProfilerService captures by outcome."""
    outcomes = {o: round(n) for o, n in sums_by(metrics_text, CAPTURES, "outcome").items() if n}
    total = sum(outcomes.values())
    terms = " + ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
    line = f"server-side captures (ProfilerService, {CAPTURES}): {total}"
    lines = [line + (f" = {terms}" if terms else "")]
    if outcomes.get("no_ops"):
        lines.append(
            f"  no_ops {outcomes['no_ops']}: the Predict ran before the backend's profiler "
            "started (a capture starts as the request arrives): those traces have no server spans"
        )
    if outcomes.get("busy"):
        lines.append(f"  busy {outcomes['busy']}: another capture was still being written")
    return lines


def trace_lines(db: Path) -> list[str]:
    """One line per forced trace: proxy span > server op spans > replay M > L layers."""
    store = TraceStore(db)
    try:
        lines = []
        for trace in store.list_traces():
            if trace.sample_reason != "forced" or trace.status != "ok":
                continue
            spans = store.spans(trace.trace_id)
            server = sum(1 for s in spans if s.level is Level.SERVER)
            layers = [s for s in spans if s.level is Level.LAYER]
            keras = [s for s in layers if not s.attributes.get("outside_layers")]
            names = ", ".join(s.name for s in sorted(keras, key=lambda s: s.index))
            lines.append(
                f"{trace.model} (batch {trace.batch_size}): proxy span > {server} server op "
                f"spans > replay M > L: {names} (+{len(layers) - len(keras)} ops outside layers)"
            )
        return lines
    finally:
        store.close()


def run_tfserving_demo(options: DemoOptions) -> int:
    missing = tensorflow_missing()
    if missing:
        raise missing
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    db = fresh_database(out / "traces.db")
    base = out / MODEL_FOLDER
    shutil.rmtree(base, ignore_errors=True)
    say(f"building the Keras sample models ({CNN}, {TRANSFORMER}) in a TF-Serving model base, "
        f"{base}")  # fmt: skip
    build_model_base(base)
    say("starting the stand-in for tensorflow_model_server (real TensorFlow, TF-Serving's gRPC "
        "and REST APIs; its ProfilerService on a third port)")  # fmt: skip
    with TfServingServer(base, out / "tfserving.log", profiler=True) as server:
        say(f"stand-in ready on {server.grpc_address}; starting the sidecar in front of it")
        args = [
            "--backend-protocol", "tfserving", "--model-repository", str(base),
            "--db", str(db), "--otlp-port", "0", "--sample-rate", str(options.sample_rate),
            "--sample-budget", str(BUDGET_PER_MINUTE), "--duty-cycle", str(DUTY_CYCLE),
            "--levels", "M,L", "--tf-profiler-address", server.profiler_address,
            "--tf-profiler-dir", str(out / "tf-captures"),
            "--tf-profiler-capture-ms", str(CAPTURE_MS),
        ]  # fmt: skip
        log_path = out / "sidecar.log"
        sidecar = SidecarProcess(
            server.grpc_address, log_path, args, http_backend=server.rest_address,
            keep_xsp_env=True,
        )  # fmt: skip
        with sidecar:
            client = PredictClient(sidecar.address)
            say(f"sidecar relaying gRPC on {sidecar.address} and REST on {sidecar.http_address}; "
                f"metrics on :{sidecar.metrics_port}/metrics")  # fmt: skip
            counts = send_traffic(client, options)
            say(f"sent {options.requests} Predicts: {counts['ok']} ok, {counts['error']} errors")
            rest = None
            if options.rest_requests:
                rest = send_rest_traffic(sidecar.http_url, options)
                say(f"sent {rest.total} REST Predicts ("
                    + ", ".join(f"{n} {client}" for client, n in rest.sent.items())
                    + f"): {rest.total - rest.errors} ok, {rest.errors} errors")  # fmt: skip
            await_sampled(sidecar, options)
            models = ", ".join(options.forced_models)
            say(f"sending {options.forced} Predict(s) with x-xsp-profile: 1 to {models}")
            rng = np.random.default_rng(1)

            def predict_forced(model: str, k: int) -> None:
                client(predict_request(model, FORCED_BATCH, rng), forced=True)
                time.sleep(CAPTURE_MS / 1000)  # one capture per forced Predict

            forced = send_forced(predict_forced, sidecar.metrics_url, db, options)
            client.close()
            time.sleep(1.5)  # let the last capture and the writer catch up
            stored, metrics_text, lines = record_and_account(
                sidecar, out, options, counts, forced, db, "Predict", rest
            )
            for line in [*lines, *capture_lines(metrics_text)]:
                print(f"    {line}")
    say(f"{stored} trace(s) of sampled Predicts stored in {db} (failed profiles included); "
        "the forced ones:")  # fmt: skip
    for line in trace_lines(db):
        print(f"    {line}")
    sweep = report_and_sweep(out, db, base / CNN, CNN, options)
    say("done. Results:")
    print(f"    sampled traces : {db}  (HTML report in {out / 'report'})")
    print(f"    batch sweep    : {sweep}  (HTML report in {out / 'sweep-report'})")
    print(f"    metrics scrape : {out / 'metrics.txt'}")
    print(f"    logs           : {out / 'sidecar.log'}, {out / 'tfserving.log'}")
    print(f"    try            : python analysis/report.py {db} --format markdown")
    return 0
