"""The Python-backend runner on the harness's own `model.py` files: real ONNX Runtime for the
BLS callee, the real leveled experiment and replay job, a real SQLite store."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sidecar.backends.model_repository import find_model
from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.python_backend.loader import MODULE, PythonModel
from sidecar.profiling.runners.python_model import PythonModelRunner
from sidecar.profiling.runners.select import runner_for
from sidecar.profiling.vocabulary import Runner
from sidecar.replay.context import ReplayContext
from sidecar.replay.job_records import ProfileJob
from sidecar.replay.options import ReplayOptions
from sidecar.replay.replay_job import replay_job
from sidecar.trace.spans import Level, new_span_id, new_trace_id
from sidecar.trace.store import TraceStore
from tests.harness.triton.model_repo import (
    PY_CNN_CONFIG,
    add_async_bls,
    add_bls_cnn,
    add_py_cnn,
    add_token_stream,
    build_model_repository,
    write_model,
)

BLS_MISSING = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        call = pb_utils.InferenceRequest(
            model_name="no_such_model", requested_output_names=["Y"],
            inputs=[pb_utils.get_input_tensor_by_name(requests[0], "X")],
        )
        answer = call.exec()
        return [pb_utils.InferenceResponse(error=answer.error())]
"""
CONFIG_X = 'name: "NAME"\nbackend: "python"\nmax_batch_size: 0\n' + (
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
)
ARGS_ECHO = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        self.dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "Y")["data_type"]
        )

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x * 2).astype(self.dtype))])]
"""

# Writes `finalized` beside its model.py when Triton (or the replay) finalizes it.
FINALIZER = """\
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.mark = os.path.join(args["model_repository"], args["model_version"], "finalized")

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)])]

    def finalize(self):
        with open(self.mark, "a") as f:
            f.write("finalized\\n")
"""

# PyTorch inside a model.py: a small MLP built in initialize, run in execute.
TORCH_MLP = """\
import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
        ).eval()

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        with torch.no_grad():
            y = self.net(torch.from_numpy(x.reshape(-1, 4))).numpy().reshape(x.shape)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.astype(np.float32))])]
"""

# An ONNX Runtime session whose model file is gone once it is made: no twin can be made of it.
ORT_FILE_GONE = """\
import os
import shutil
import tempfile

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        source = os.path.join(args["model_repository"], "..", "py_cnn", "1", "cnn.onnx")
        folder = tempfile.mkdtemp()
        path = shutil.copy(source, os.path.join(folder, "gone.onnx"))
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        shutil.rmtree(folder)

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "input").as_numpy()
        (y,) = self.session.run(["output"], {"input": x})
        return [pb_utils.InferenceResponse([pb_utils.Tensor("output", y)])]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = add_bls_cnn(add_token_stream(build_model_repository(tmp_path_factory.mktemp("r") / "m")))
    add_py_cnn(add_async_bls(root))
    write_model(root, "finalizer", CONFIG_X.replace("NAME", "finalizer"), FINALIZER)
    write_model(root, "torch_mlp", CONFIG_X.replace("NAME", "torch_mlp"), TORCH_MLP)
    gone = PY_CNN_CONFIG.replace('name: "py_cnn"', 'name: "ort_gone"')
    write_model(root, "ort_gone", gone, ORT_FILE_GONE)
    write_model(root, "bls_missing", CONFIG_X.replace("NAME", "bls_missing"), BLS_MISSING)
    write_model(root, "args_echo", CONFIG_X.replace("NAME", "args_echo"), ARGS_ECHO)
    return root


def test_add_sub_answers_through_its_own_model_py(repo: Path) -> None:
    runner = runner_for(repo / "add_sub" / "1" / "model.py", find=find_model)
    assert isinstance(runner, Runner) and isinstance(runner, PythonModelRunner)
    a, b = np.arange(8, dtype=np.float32), np.full(8, 3, dtype=np.float32)
    (response,) = runner.respond({"INPUT0": a, "INPUT1": b}).with_data()
    np.testing.assert_array_equal(response.outputs()["OUTPUT0"], a + b)
    np.testing.assert_array_equal(response.outputs()["OUTPUT1"], a - b)
    (bad,) = runner.respond({"INPUT0": a, "INPUT1": b[:3]}).with_data()
    assert bad.error is not None and "INPUT0 shape (8,) != INPUT1 shape (3,)" in bad.error
    assert MODULE not in sys.modules  # the stand-in is installed only while model code runs


def test_initialize_gets_triton_args_with_the_config_as_json(repo: Path) -> None:
    runner = runner_for(repo / "args_echo" / "1" / "model.py", find=find_model)
    assert isinstance(runner, PythonModelRunner)
    args = runner.model.instance.args
    assert args["model_name"] == "args_echo" and args["model_version"] == "1"
    assert args["model_repository"] == str(repo / "args_echo")
    assert args["model_instance_kind"] == "CPU"
    (response,) = runner.respond({"X": np.ones(3, dtype=np.float32)}).with_data()
    assert response.outputs()["Y"].dtype == np.float32


CNN_OPS = {"Conv", "MaxPool", "Gemm"}  # among `simple_cnn`'s nodes as ORT runs it (fused)


def test_levels_m_and_l_the_models_functions_and_bls_to_onnx(repo: Path) -> None:
    runner = runner_for(repo / "bls_cnn" / "1" / "model.py", find=find_model)
    image = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32) * 255
    (response,) = runner.respond({"IMAGE": image}).with_data()
    np.testing.assert_allclose(response.outputs()["PROBS"].sum(axis=1), 1.0, rtol=1e-5)
    profile = run_experiment(
        runner, {"IMAGE": image}, model="bls_cnn", levels=(Level.LAYER,), iterations=5, warmup=1
    )
    assert [s.level for s in profile.level_stats] == [Level.MODEL, Level.LAYER]
    assert profile.stats(Level.LAYER).overhead_ratio >= 1.0
    (model,) = profile.spans_at(Level.MODEL)
    layers = {s.name: s for s in profile.spans_at(Level.LAYER)}
    assert {"_scale", "_softmax", "bls:simple_cnn"} <= set(layers)
    bls = layers["bls:simple_cnn"]
    assert bls.kind == "bls" and bls.attributes["bls_format"] == "onnx"
    assert layers["_scale"].kind == "python_function"
    assert all(s.parent_id == model.span_id for s in layers.values())
    assert profile.trace.attributes["kernel_level"] == "not requested"


def test_k_of_a_bls_call_is_the_onnx_nodes_of_the_called_model(repo: Path) -> None:
    runner = runner_for(repo / "bls_cnn" / "1" / "model.py", find=find_model)
    image = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32) * 255
    profile = run_experiment(runner, {"IMAGE": image}, model="bls_cnn", iterations=4, warmup=1)
    assert [s.level for s in profile.level_stats] == [Level.MODEL, Level.LAYER, Level.KERNEL]
    (bls,) = [s for s in profile.spans_at(Level.LAYER) if s.name == "bls:simple_cnn"]
    nodes = profile.spans_at(Level.KERNEL)
    assert {n.attributes["op_type"] for n in nodes} >= CNN_OPS
    assert all(n.parent_id == bls.span_id and n.kind == "cpu_op" for n in nodes)
    assert profile.trace.attributes["kernel_level"] == "captured"


def test_k_is_the_onnx_runtime_nodes_below_the_python_call_that_ran_them(repo: Path) -> None:
    runner = runner_for(repo / "py_cnn" / "1" / "model.py", find=find_model)
    assert isinstance(runner, PythonModelRunner)
    x = np.random.default_rng(3).random((2, 3, 32, 32), dtype=np.float32)
    profile = run_experiment(runner, {"input": x}, model="py_cnn", iterations=5, warmup=1)
    assert [s.level for s in profile.level_stats] == [Level.MODEL, Level.LAYER, Level.KERNEL]
    (run_call,) = [s for s in profile.spans_at(Level.LAYER) if s.name.endswith("Session.run")]
    nodes = profile.spans_at(Level.KERNEL)
    assert {n.attributes["op_type"] for n in nodes} >= CNN_OPS
    assert all(n.parent_id == run_call.span_id for n in nodes), [n.attributes for n in nodes]
    conv = next(n for n in nodes if n.attributes["op_type"] == "Conv")
    assert conv.attributes["input_shapes"][0] == [2, 3, 32, 32] and conv.duration_ns > 0
    assert profile.trace.attributes["kernel_level"] == "captured"
    assert profile.trace.attributes["python_kernel_sessions"] == 1
    # the model's own session is back as it made it: unprofiled for the next M run
    (made,) = runner.model.sessions.live()
    session = made.session()
    assert session is runner.model.instance.session
    assert session.get_session_options().enable_profiling is False
    assert session.end_profiling() == ""
    (response,) = runner.respond({"input": x}).with_data()
    assert response.outputs()["output"].shape == (2, 10)


def test_k_of_a_model_py_running_pytorch_is_its_aten_ops_below_the_call(repo: Path) -> None:
    runner = runner_for(repo / "torch_mlp" / "1" / "model.py", find=find_model)
    x = np.arange(8, dtype=np.float32)
    profile = run_experiment(runner, {"X": x}, model="torch_mlp", iterations=4, warmup=1)
    assert profile.trace.attributes["kernel_level"] == "captured"
    assert profile.trace.attributes["python_kernel_torch"] is True
    layers = {s.span_id: s for s in profile.spans_at(Level.LAYER)}
    ops = profile.spans_at(Level.KERNEL)
    assert "aten::linear" in {k.name for k in ops}
    linear = [k for k in ops if k.name == "aten::linear"]
    assert len(linear) == 2 and all(k.kind == "cpu_op" for k in linear)
    parents = {layers[k.parent_id].name for k in linear if k.parent_id in layers}
    assert len(parents) == 1 and parents.pop().startswith("torch.nn.modules.module.")
    assert linear[0].attributes["input_shapes"][0] == [2, 4]


def test_a_session_no_twin_can_be_made_of_runs_unprofiled_and_says_why(repo: Path) -> None:
    runner = runner_for(repo / "ort_gone" / "1" / "model.py", find=find_model)
    x = np.random.default_rng(4).random((1, 3, 32, 32), dtype=np.float32)
    profile = run_experiment(runner, {"input": x}, model="ort_gone", iterations=2, warmup=0)
    assert profile.trace.status == "ok" and profile.spans_at(Level.KERNEL) == []
    assert profile.trace.attributes["kernel_level"].startswith("not captured: no profiling twin")
    (why,) = profile.trace.attributes["python_kernel_sessions_failed"]
    assert "gone.onnx" in why


def test_k_of_a_model_that_runs_no_onnx_runtime_says_so(repo: Path) -> None:
    runner = runner_for(repo / "add_sub" / "1" / "model.py", find=find_model)
    a = np.arange(4, dtype=np.float32)
    profile = run_experiment(runner, {"INPUT0": a, "INPUT1": a}, model="add_sub", iterations=2)
    assert profile.spans_at(Level.KERNEL) == []
    assert profile.trace.attributes["kernel_level"].startswith("not captured: the model's code")


def test_a_bls_call_to_a_model_no_replay_finds_answers_with_an_error(repo: Path) -> None:
    runner = runner_for(repo / "bls_missing" / "1" / "model.py", find=find_model)
    (response,) = runner.respond({"X": np.ones(2, dtype=np.float32)}).with_data()
    assert response.error is not None
    assert "BLS call to 'no_such_model' cannot be replayed" in response.error
    assert "not in the model repository" in response.error


def test_a_decoupled_model_records_every_response_and_their_gaps(repo: Path) -> None:
    runner = runner_for(repo / "token_stream" / "1" / "model.py", find=find_model)
    inputs = {
        "COUNT": np.array([3], np.int32),
        "FIRST_MS": np.array([20], np.int32),
        "SLEEP_MS": np.array([10], np.int32),
    }
    execution = runner.respond(inputs)
    tokens = [int(r.outputs()["TOKEN"][0]) for r in execution.with_data()]
    assert tokens == [0, 1, 2]
    profile = run_experiment(runner, inputs, model="token_stream", iterations=2, warmup=0)
    attrs = profile.trace.attributes
    assert attrs["decoupled"] is True and attrs["decoupled_responses"] == 3
    assert 20e6 <= attrs["decoupled_time_to_first_response_ns"] < 60e6
    assert 10e6 <= attrs["decoupled_response_gap_ns"] < 40e6
    (model,) = profile.spans_at(Level.MODEL)
    assert model.attributes["responses"] == 3 and len(model.attributes["response_gaps_ns"]) == 2


def test_exec_without_a_replay_handler_answers_with_an_error() -> None:
    answer = pb_utils.InferenceRequest(model_name="m", inputs=[]).exec()
    assert answer.has_error() and "no replay handles BLS calls" in answer.error().message()


def test_a_model_py_that_fails_to_import_says_so(tmp_path: Path) -> None:
    write_model(tmp_path, "broken", CONFIG_X.replace("NAME", "broken"), "import no_such_module\n")
    with pytest.raises(Exception, match=r"broken: importing model\.py failed: ModuleNotFound"):
        runner_for(tmp_path / "broken" / "1" / "model.py", find=find_model)
    assert "PythonModel" in PythonModel.__name__


def _infer_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, x in inputs.items():
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, "FP32"
        tensor.shape.extend(x.shape)
        request.raw_input_contents.append(x.astype(np.float32).tobytes())
    return bytes(request.SerializeToString())


@pytest.mark.parametrize(("python_models", "outcome"), [(True, "ok"), (False, "error")])
def test_the_replay_job_profiles_a_python_model_unless_turned_off(
    repo: Path, tmp_path: Path, python_models: bool, outcome: str
) -> None:
    x = np.arange(4, dtype=np.float32)
    job = ProfileJob(
        trace_id=new_trace_id(),
        parent_span_id=new_span_id(),
        model="add_sub",
        model_version="",
        method="ModelInfer",
        reason="forced",
        received_ns=0,
        request_message=_infer_request("add_sub", {"INPUT0": x, "INPUT1": x}),
    )
    options = ReplayOptions(
        model_repository=repo,
        db_path=tmp_path / "t.db",
        levels=(Level.MODEL, Level.LAYER),
        iterations=3,
        warmup=1,
        store_raw_inputs=False,
        device="auto",
        python_models=python_models,
    )
    result = replay_job(job, ReplayContext(options))
    assert result.outcome == outcome, result.error
    trace = TraceStore(tmp_path / "t.db").get_trace(job.trace_id)
    assert trace is not None
    if outcome == "ok":
        assert trace.attributes["model_format"] == "python"
        assert trace.attributes["levels"] == ["model", "layer"]
    else:
        assert "--replay-python-models is off" in (trace.error or "")


def test_a_python_models_parameters_are_recorded_as_given_to_it(tmp_path: Path) -> None:
    from sidecar.profiling.formats import ModelFormat
    from sidecar.profiling.server_config import read_config, replay_settings

    text = CONFIG_X.replace("NAME", "p") + (
        'parameters { key: "greeting" value: { string_value: "hello" } }\n'
    )
    path = tmp_path / "config.pbtxt"
    path.write_text(text)
    (record,) = replay_settings(read_config(path), ModelFormat.PYTHON).records
    assert (record.setting, record.value, record.applied) == ("parameters.greeting", "hello", True)
    assert "model.py" in record.reason


def test_xsp_sidecar_profile_runs_a_model_py_with_its_configs_inputs(
    repo: Path, tmp_path: Path
) -> None:
    from sidecar.cli import main

    db = tmp_path / "t.db"
    path = repo / "bls_cnn" / "1" / "model.py"
    rc = main(
        ["profile", str(path), "--iterations", "2", "--warmup", "0", "--no-peak", "--db", str(db)]
    )
    assert rc == 0
    store = TraceStore(db)
    (trace,) = store.list_traces()
    assert trace.model == "bls_cnn" and trace.runtime.startswith("python_backend")
    (image,) = trace.attributes["inputs"]
    assert image["name"] == "IMAGE" and image["shape"] == [1, 3, 32, 32]
    assert "bls:simple_cnn" in {s.name for s in store.spans(trace.trace_id, Level.LAYER)}


def test_async_execute_awaits_bls_calls_in_flight_together(repo: Path) -> None:
    runner = runner_for(repo / "async_bls" / "1" / "model.py", find=find_model)
    a, b = np.arange(5, dtype=np.float32), np.full(5, 2, dtype=np.float32)
    (response,) = runner.respond({"INPUT0": a, "INPUT1": b}).with_data()
    assert response.error is None, response.error
    np.testing.assert_array_equal(response.outputs()["OUTPUT0"], a + b)
    np.testing.assert_array_equal(
        response.outputs()["OUTPUT1"], b - a
    )  # the second call, inputs swapped
    profile = run_experiment(
        runner, {"INPUT0": a, "INPUT1": b}, model="async_bls", levels=(Level.LAYER,), iterations=3
    )
    calls = [s for s in profile.spans_at(Level.LAYER) if s.name == "bls:add_sub"]
    assert len(calls) == 2 and all("bls_error" not in s.attributes for s in calls)


def test_async_exec_is_a_future_of_the_running_loop_as_in_triton() -> None:
    import asyncio

    request = pb_utils.InferenceRequest(model_name="m", inputs=[])
    with pytest.raises(RuntimeError, match="no running event loop"):
        request.async_exec()

    async def call() -> pb_utils.InferenceResponse:
        future = request.async_exec()
        assert isinstance(future, asyncio.Future)
        return await future

    answer = asyncio.run(call())
    assert answer.has_error() and "no replay handles BLS calls" in answer.error().message()


def _finalize_job(model: str, inputs: dict[str, np.ndarray]) -> ProfileJob:
    return ProfileJob(
        trace_id=new_trace_id(),
        parent_span_id=new_span_id(),
        model=model,
        method="ModelInfer",
        reason="forced",
        received_ns=0,
        request_message=_infer_request(model, inputs),
    )


def test_the_worker_finalizes_a_python_model_it_evicts_and_at_its_stop(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sidecar.replay import replay_job as replay_module

    monkeypatch.setattr(replay_module, "RUNNER_CACHE_SIZE", 1)
    mark = repo / "finalizer" / "1" / "finalized"
    mark.unlink(missing_ok=True)
    options = ReplayOptions(
        model_repository=repo, db_path=tmp_path / "t.db", levels=(Level.MODEL,), iterations=2,
        warmup=0, store_raw_inputs=False, device="cpu",
    )  # fmt: skip
    context = ReplayContext(options)
    x = np.ones(3, dtype=np.float32)
    assert replay_job(_finalize_job("finalizer", {"X": x}), context).outcome == "ok"
    assert not mark.exists()  # loaded and kept: not finalized
    assert replay_job(_finalize_job("add_sub", {"INPUT0": x, "INPUT1": x}), context).outcome == "ok"
    assert mark.read_text() == "finalized\n"  # evicted by add_sub: finalized once
    assert replay_job(_finalize_job("finalizer", {"X": x}), context).outcome == "ok"
    context.close()  # the worker stops
    assert mark.read_text() == "finalized\n" * 2
    assert not context.runners
