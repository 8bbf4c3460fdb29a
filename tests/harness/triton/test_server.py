"""The local Triton used by the demo and the tests serves the sample models for real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.harness.triton.environment import TritonSetupError
from tests.harness.triton.model_repo import SAMPLE_MODELS, build_model_repository, simple_cnn
from tests.harness.triton.server import TritonServer


def _input(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_sample_models_are_ready(triton: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_address)
    assert client.is_server_ready()
    for model in SAMPLE_MODELS:
        assert client.is_model_ready(model), model


def test_add_sub_computes_sum_and_difference(triton: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_address)
    a = np.array([1.5, 2.0, -3.0], dtype=np.float32)
    b = np.array([0.5, 4.0, 1.0], dtype=np.float32)
    result = client.infer("add_sub", [_input("INPUT0", a, "FP32"), _input("INPUT1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_simple_cnn_matches_onnxruntime_run_locally(triton: TritonServer) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(
        simple_cnn().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    expected = session.run(["output"], {"input": x})[0]
    client = grpcclient.InferenceServerClient(triton.grpc_address)
    got = client.infer("simple_cnn", [_input("input", x, "FP32")]).as_numpy("output")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_failed_start_reports_the_server_log(tmp_path: Path) -> None:
    repo = build_model_repository(tmp_path / "models")
    (repo / "add_sub" / "config.pbtxt").write_text("this is not a model config {")
    server = TritonServer(
        model_repository=repo, log_path=tmp_path / "log.txt", extra_args=["--exit-on-error=true"]
    )
    with pytest.raises(TritonSetupError, match="add_sub"):
        server.start(timeout=60)
