"""A sidecar knows only the backend it was started for (`--backend-protocol`): another backend's
call is relayed unchanged and counted, but never sampled or replayed, even forced at rate 1.

Real sidecar processes in front of a real Triton (a TF-Serving `Predict` sent to it) and in
front of the stand-in for `tensorflow_model_server` (a KServe `ModelInfer` sent to it). Each
backend answers the other's call UNIMPLEMENTED; the client gets exactly what the backend says
when called directly. A forced call of the backend's own method then shows sampling was on.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tensorflow_serving.apis import predict_pb2
from tritonclient.grpc import service_pb2

from sidecar.trace.store import count_traces
from tests.e2e.helpers import wait_until
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.tfserving.models import CNN
from tests.harness.tfserving.process import TfServingServer
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.slow]

PREDICT = "/tensorflow.serving.PredictionService/Predict"
INFER = "/inference.GRPCInferenceService/ModelInfer"
FORCE = (("x-xsp-profile", "1"),)
SAMPLING = ["--sample-rate", "1", "--duty-cycle", "1", "--iterations", "2", "--warmup", "0"]


def predict(model: str, shape: tuple[int, ...], alias: str) -> bytes:
    """A TF-Serving `PredictRequest` for `model` (one float input)."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    value = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return request.SerializeToString()


def model_infer(model: str, shape: list[int], name: str) -> bytes:
    """A KServe `ModelInferRequest` for `model` (one FP32 input, raw contents)."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype="FP32", shape=shape)
    value = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    request.raw_input_contents.append(value.tobytes())
    return request.SerializeToString()


def outcome(address: str, path: str, request: bytes) -> tuple[object, str, bytes | None]:
    """(status code, details, reply) of one forced unary call in raw bytes."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = channel.unary_unary(path, None, None)(request, metadata=FORCE, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), None
        return grpc.StatusCode.OK, "", reply


def check_foreign_call_relayed_only(
    proc: SidecarProcess,
    backend_address: str,
    foreign: tuple[str, bytes],
    own: tuple[str, bytes, str],
    db: Path,
) -> None:
    """`foreign` (path, request) reaches the backend as sent and is answered as the backend
    answers it directly; it is counted, never sampled or replayed. `own` (path, request,
    model) is then sampled and replayed: the only profile and trace."""
    path, request = foreign
    short = path.rsplit("/", 1)[-1]
    direct = outcome(backend_address, path, request)
    assert direct[0] is grpc.StatusCode.UNIMPLEMENTED, direct
    assert outcome(proc.address, path, request) == direct
    metric = proc.metric
    requests = {"method": short, "model": "_unknown", "grpc_code": "UNIMPLEMENTED"}
    assert metric("xsp_requests_total", **requests) == 1
    assert proc.metric("xsp_sampling_decisions_total") == 0

    own_path, own_request, model = own
    assert outcome(proc.address, own_path, own_request)[0] is grpc.StatusCode.OK
    assert metric("xsp_sampling_decisions_total", model=model, decision="sampled") == 1
    assert wait_until(lambda: metric("xsp_profiles_total") == 1, 120), proc.log_tail()
    assert metric("xsp_profiles_total", model=model, outcome="ok") == 1, proc.log_tail()
    assert proc.metric("xsp_sampling_decisions_total") == 1
    assert metric("xsp_samples_dropped_total") == 0
    assert count_traces(db) == 1


@pytest.mark.triton
def test_a_triton_sidecar_relays_a_predict_but_never_samples_it(
    triton: TritonServer, tmp_path: Path
) -> None:
    db = tmp_path / "traces.db"
    args = ["--model-repository", str(triton.model_repository), "--db", str(db),
            "--otlp-port", "0", *SAMPLING]  # fmt: skip
    with SidecarProcess(triton.grpc_address, tmp_path / "sidecar.log", args=args) as proc:
        # simple_cnn is in Triton's repository: a Predict for it would be replayable as
        # TF-Serving's method, but this sidecar fronts Triton
        foreign = (PREDICT, predict("simple_cnn", (1, 3, 32, 32), "input"))
        own = (INFER, model_infer("simple_cnn", [1, 3, 32, 32], "input"), "simple_cnn")
        check_foreign_call_relayed_only(proc, triton.grpc_address, foreign, own, db)


@pytest.mark.tfserving
def test_a_tfserving_sidecar_relays_a_model_infer_but_never_samples_it(
    tfserving: TfServingServer, tmp_path: Path
) -> None:
    db = tmp_path / "traces.db"
    args = ["--backend-protocol", "tfserving", "--model-repository", str(tfserving.model_base),
            "--db", str(db), "--otlp-port", "0", *SAMPLING]  # fmt: skip
    with SidecarProcess(tfserving.grpc_address, tmp_path / "sidecar.log", args=args) as proc:
        # keras_cnn is in the stand-in's model base: a ModelInfer for it would be replayable
        # as Triton's method, but this sidecar fronts TF-Serving
        foreign = (INFER, model_infer(CNN, [1, 32, 32, 3], "image"))
        own = (PREDICT, predict(CNN, (1, 32, 32, 3), "image"), CNN)
        check_foreign_call_relayed_only(proc, tfserving.grpc_address, foreign, own, db)
