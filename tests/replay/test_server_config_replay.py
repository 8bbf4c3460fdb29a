"""The replay configured from the model's config.pbtxt, end to end: a sampled request replayed
against a repository whose model asks for ONNX Runtime settings, an accelerator and dynamic
batching (real ONNX Runtime, real SQLite); a config.pbtxt that does not parse fails that
model's profile, stored and counted, while a real sidecar in front of the real Triton keeps
forwarding."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner
from sidecar.replay.replay_job import replay_job
from sidecar.trace.store import TraceStore, failed_traces
from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.models import save_onnx, small_cnn_onnx
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import build_model_repository, write_config, write_model
from tests.harness.triton.server import TritonServer
from tests.replay.test_replay_job import context, infer_request, job

CNN_ORT_CONFIG = """\
name: "cnn_ort"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 10 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
dynamic_batching { preferred_batch_size: [ 4 ] }
optimization {
  graph: { level: -1 }
  execution_accelerators { cpu_execution_accelerator: [ { name: "openvino" } ] }
}
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
parameters { key: "execution_mode" value: { string_value: "1" } }
parameters { key: "enable_mem_pattern" value: { string_value: "0" } }
parameters { key: "not_a_knob" value: { string_value: "1" } }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = build_model_repository(tmp_path_factory.mktemp("repo") / "models")
    version = write_model(repo, "cnn_ort", CNN_ORT_CONFIG)
    save_onnx(small_cnn_onnx(softmax=False, output="output"), version / "model.onnx")
    return repo


def test_a_replay_runs_and_records_the_servers_settings(repo: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    the_job = job("cnn_ort", infer_request("cnn_ort", x))
    ctx = context(repo, tmp_path / "t.db")
    result = replay_job(the_job, ctx)
    assert result.outcome == "ok", result.error

    (runner,) = ctx.runners.values()  # the session the replay built and ran
    assert isinstance(runner, OnnxRuntimeRunner)
    so = runner.session.get_session_options()
    assert so.intra_op_num_threads == 2
    assert so.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert so.enable_mem_pattern is False

    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "ok"
    stored = {r["setting"]: r for r in trace.attributes["replay_settings"]}
    assert stored["parameters.intra_op_thread_count"] == {
        "setting": "parameters.intra_op_thread_count",
        "value": "2",
        "applied": True,
        "reason": "config.pbtxt wins over the worker's 1 thread(s)",
    }
    assert stored["optimization.graph.level"]["reason"] == "basic"
    assert stored["parameters.not_a_knob"]["reason"] == "unknown parameter"
    openvino = stored["cpu_execution_accelerator.openvino"]
    assert openvino["applied"] is False and "OpenVINOExecutionProvider" in openvino["reason"]
    assert "max_batch_size" not in stored  # the request's own batch of 2 ran
    assert trace.attributes["server_config"] == {
        "backend": "onnxruntime",
        "platform": "",
        "instance_kind": "KIND_CPU",
        "instance_count": 2,
        "gpus": [],
        "accelerators": ["openvino"],
        "max_batch_size": 8,
        "dynamic_batching": True,
        "preferred_batch_sizes": [4],
    }


def test_a_config_that_does_not_parse_is_a_stored_error(repo: Path, tmp_path: Path) -> None:
    broken = tmp_path / "models"
    shutil.copytree(repo, broken)
    write_config(broken, "cnn_ort", 'name: "cnn_ort"\nmax_batch_size: "eight"\n')
    the_job = job("cnn_ort", b"", reason="admin")
    result = replay_job(the_job, context(broken, tmp_path / "t.db"))
    assert result.outcome == "error"
    assert "ModelConfigError" in (result.error or "")
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "error"
    assert "config.pbtxt is not a valid Triton model config" in (trace.error or "")


def test_a_failed_replay_of_a_parsed_config_still_records_it(repo: Path, tmp_path: Path) -> None:
    broken = tmp_path / "models"
    shutil.copytree(repo, broken)
    (broken / "cnn_ort" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    the_job = job("cnn_ort", b"", reason="admin")
    assert replay_job(the_job, context(broken, tmp_path / "t.db")).outcome == "error"
    trace = TraceStore(tmp_path / "t.db").get_trace(the_job.trace_id)
    assert trace is not None and trace.status == "error"
    assert trace.attributes["server_config"]["accelerators"] == ["openvino"]
    stored = {r["setting"]: r["applied"] for r in trace.attributes["replay_settings"]}
    assert stored["parameters.execution_mode"] is True


@pytest.mark.triton
def test_an_unparseable_config_fails_the_profile_not_the_request(
    triton: TritonServer, tmp_path: Path
) -> None:
    """The sidecar reads a copy of Triton's repository whose simple_cnn config.pbtxt is
    broken (as after an edit Triton has not reloaded): forwarding goes on, the profile fails
    and is counted."""
    copy = tmp_path / "models"
    shutil.copytree(triton.model_repository, copy)
    write_config(copy, "simple_cnn", "instance_group [ { kind: KIND_TPU } ]\n")
    with SidecarProcess(
        backend=triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(copy), "--db", str(tmp_path / "traces.db"),
              "--otlp-port", "0", "--iterations", "1", "--warmup", "0", "--sample-rate", "0",
              "--duty-cycle", "1"],
    ) as proc:  # fmt: skip
        client = grpcclient.InferenceServerClient(proc.address)
        for _ in range(3):
            assert cnn_infer(client, headers={"x-xsp-profile": "1"}).shape == (1, 10)
        errors = lambda: proc.metric("xsp_profiles_total", model="simple_cnn", outcome="error")  # noqa: E731
        assert wait_until(lambda: errors() == 3, 90), proc.log()
        assert proc.metric("xsp_requests_total", model="simple_cnn", grpc_code="OK") == 3
        assert proc.metric("xsp_profiles_total", outcome="ok") == 0
    failed = failed_traces(tmp_path / "traces.db")
    assert len(failed) == 3
    assert all("not a valid Triton model config" in error for _, error in failed)
