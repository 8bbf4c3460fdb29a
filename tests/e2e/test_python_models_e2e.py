"""Python-backend models profiled by running their own `model.py`, end to end: the real
`xsp-sidecar serve` (its profiling worker) in front of the real Triton 2.51 in OpenTelemetry
mode; forced profiles (`x-xsp-profile: 1`) of `add_sub`, of the BLS model `bls_cnn` (which
calls the ONNX `simple_cnn`) and of the decoupled `token_stream` each become a stored profile
with levels M, L and K (the ONNX Runtime nodes below a call, where the model's code ran a
session), and no profile is counted as an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import wait_until
from tests.harness.process import free_port
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import add_bls_cnn, add_token_stream, build_model_repository
from tests.harness.triton.server import TritonServer
from tests.harness.triton.tracing import traced_server

pytestmark = [pytest.mark.triton, pytest.mark.slow]
FORCE = (("x-xsp-profile", "1"),)


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory, port: int) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("triton-python-models")
    repo = add_bls_cnn(add_token_stream(build_model_repository(root / "models")))
    url = f"http://127.0.0.1:{port}/v1/traces"
    with traced_server(repo, root / "tritonserver.log", url, 100) as server:
        yield server


def unary(client: grpcclient.InferenceServerClient, model: str, **inputs: np.ndarray) -> None:
    tensors = []
    for name, x in inputs.items():
        tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        tensors.append(tensor)
    client.infer(model, tensors, headers=dict(FORCE))


def token_stream(address: str) -> int:
    request = service_pb2.ModelInferRequest(model_name="token_stream", id="t")
    for name, value in (("COUNT", 3), ("FIRST_MS", 10), ("SLEEP_MS", 5)):
        request.inputs.add(name=name, datatype="INT32", shape=[1])
        request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return len(list(stub.ModelStreamInfer(iter([request]), metadata=FORCE)))


def test_forced_profiles_of_python_models_have_levels_and_no_error(
    triton: TritonServer, tmp_path: Path, port: int
) -> None:
    db = tmp_path / "traces.db"
    proc = SidecarProcess(
        backend=triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(triton.model_repository), "--db", str(db),
              "--otlp-port", str(port), "--sample-rate", "0", "--duty-cycle", "1",
              "--iterations", "3", "--warmup", "1", "--levels", "M,L,K"],
    )  # fmt: skip
    with proc:
        client = grpcclient.InferenceServerClient(proc.address)
        x = np.arange(16, dtype=np.float32)
        unary(client, "add_sub", INPUT0=x, INPUT1=x)
        image = np.random.default_rng(0).random((2, 3, 32, 32), np.float32) * 255
        unary(client, "bls_cnn", IMAGE=image)
        assert token_stream(proc.address) == 3
        assert wait_until(lambda: proc.metric("xsp_profiles_total") >= 3, 180), proc.log()
        assert proc.metric("xsp_profiles_total", outcome="ok") == 3, proc.log()
        assert proc.metric("xsp_profiles_total", outcome="error") == 0
    store = TraceStore(db)
    try:
        traces = {t.model: t for t in store.list_traces()}
        assert set(traces) == {"add_sub", "bls_cnn", "token_stream"}
        for model, trace in traces.items():
            assert trace.status == "ok", (model, trace.error)
            assert trace.attributes["model_format"] == "python"
            assert trace.attributes["levels"] == ["model", "layer", "kernel"]
            stats = {s.level for s in store.level_stats(trace.trace_id)}
            assert stats == {Level.MODEL, Level.LAYER, Level.KERNEL}, model
        bls = store.spans(traces["bls_cnn"].trace_id, Level.LAYER)
        assert {"_scale", "_softmax", "bls:simple_cnn"} <= {s.name for s in bls}
        (call,) = [s for s in bls if s.name == "bls:simple_cnn"]
        nodes = store.spans(traces["bls_cnn"].trace_id, Level.KERNEL)
        assert nodes and all(n.parent_id == call.span_id for n in nodes)  # simple_cnn's ORT nodes
        assert "Conv" in {n.attributes["op_type"] for n in nodes}
        assert traces["add_sub"].attributes["kernel_level"].startswith("not captured")
        stream = traces["token_stream"].attributes
        assert stream["decoupled"] is True and stream["decoupled_responses"] == 3
    finally:
        store.close()
