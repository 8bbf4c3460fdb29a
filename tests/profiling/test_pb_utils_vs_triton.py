"""The stand-in `triton_python_backend_utils` against the REAL Triton 2.51 Python backend: the
same `model.py` files give the same outputs through Triton (tritonclient) and through the
replay (`runners.python_model`), and `initialize` gets the same `args`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sidecar.backends.model_repository import find_model
from sidecar.profiling.runners.python_model import PythonModelRunner
from sidecar.profiling.runners.select import runner_for
from tests.harness.triton.model_repo import (
    add_async_bls,
    add_bls_cnn,
    add_token_stream,
    build_model_repository,
    write_model,
)
from tests.harness.triton.server import TritonServer

pytestmark = pytest.mark.triton

ARGS_JSON_CONFIG = """\
name: "args_json"
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "greeting" value: { string_value: "hello" } }
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
# Answers with the `args` its `initialize` got (the config parsed), and the BYTES and config
# helpers of `pb_utils` on the way.
ARGS_JSON = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)
        self.args["model_config"] = json.loads(args["model_config"])
        config = self.args["model_config"]
        self.out_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "ARGS")["data_type"]
        )
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            text = json.dumps({"args": self.args, "rows": int(x.shape[0]),
                               "decoupled": self.decoupled}, sort_keys=True)
            out = np.array([[text.encode()]] * x.shape[0], dtype=self.out_dtype)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ARGS", out)]))
        return responses
"""


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("triton-pb-utils")
    repo = add_async_bls(add_bls_cnn(add_token_stream(build_model_repository(root / "models"))))
    write_model(repo, "args_json", ARGS_JSON_CONFIG, ARGS_JSON)
    with TritonServer(model_repository=repo, log_path=root / "tritonserver.log") as server:
        yield server


@pytest.fixture(scope="module")
def client(triton: TritonServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(triton.grpc_address) as c:
        yield c


def replay(triton: TritonServer, model: str) -> PythonModelRunner:
    runner = runner_for(triton.model_repository / model / "1" / "model.py", find=find_model)
    assert isinstance(runner, PythonModelRunner)
    return runner


def through_triton(
    client: grpcclient.InferenceServerClient, model: str, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    tensors = []
    for name, x in inputs.items():
        tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        tensors.append(tensor)
    result = client.infer(model, tensors)
    outputs = result.get_response().outputs
    return {o.name: result.as_numpy(o.name) for o in outputs}


def through_replay(triton: TritonServer, model: str, inputs: dict[str, np.ndarray]) -> Any:
    (response,) = replay(triton, model).respond(inputs).with_data()
    assert response.error is None, response.error
    return response.outputs()


@pytest.mark.parametrize(
    ("model", "inputs"),
    [
        (
            "add_sub",
            {
                "INPUT0": np.linspace(-3, 3, 7, dtype=np.float32),
                "INPUT1": np.arange(7, dtype=np.float32),
            },
        ),
        ("simple_cnn", {"input": np.random.default_rng(1).random((2, 3, 32, 32), np.float32)}),
        (
            "bls_cnn",  # BLS: Triton calls its simple_cnn; the replay runs model.onnx in ORT
            {"IMAGE": np.random.default_rng(2).random((3, 3, 32, 32), np.float32) * 255},
        ),
        (
            "async_bls",  # async def execute: two `await request.async_exec()` BLS calls
            {
                "INPUT0": np.linspace(-2, 2, 5, dtype=np.float32),
                "INPUT1": np.arange(5, dtype=np.float32),
            },
        ),
    ],
)
def test_the_same_model_py_gives_the_same_outputs(
    triton: TritonServer,
    client: grpcclient.InferenceServerClient,
    model: str,
    inputs: dict[str, np.ndarray],
) -> None:
    live = through_triton(client, model, inputs)
    replayed = through_replay(triton, model, inputs)
    assert set(live) == set(replayed)
    for name in live:
        assert replayed[name].dtype == live[name].dtype and replayed[name].shape == live[name].shape
        np.testing.assert_allclose(replayed[name], live[name], rtol=1e-5, atol=1e-6)


def test_an_error_response_is_the_same(
    triton: TritonServer, client: grpcclient.InferenceServerClient
) -> None:
    inputs = {"INPUT0": np.ones(4, np.float32), "INPUT1": np.ones(3, np.float32)}
    with pytest.raises(Exception) as live:
        through_triton(client, "add_sub", inputs)
    (replayed,) = replay(triton, "add_sub").respond(inputs).with_data()
    assert replayed.error is not None and replayed.error in str(live.value)


def test_initialize_gets_the_args_triton_gives(
    triton: TritonServer, client: grpcclient.InferenceServerClient
) -> None:
    x = np.ones((2, 2), np.float32)
    live = json.loads(through_triton(client, "args_json", {"X": x})["ARGS"][0][0])
    replayed = json.loads(through_replay(triton, "args_json", {"X": x})["ARGS"][0][0])
    assert replayed["rows"] == live["rows"] == 2
    assert replayed["decoupled"] is live["decoupled"] is False
    for key in ("model_name", "model_version", "model_repository", "model_instance_kind"):
        assert replayed["args"][key] == live["args"][key], key
    assert set(replayed["args"]) <= set(live["args"])
    ours, theirs = replayed["args"]["model_config"], live["args"]["model_config"]
    assert ours == theirs


def _stream_tokens(address: str, count: int, first_ms: int, sleep_ms: int) -> list[int]:
    request = service_pb2.ModelInferRequest(model_name="token_stream")
    for name, value in (("COUNT", count), ("FIRST_MS", first_ms), ("SLEEP_MS", sleep_ms)):
        request.inputs.add(name=name, datatype="INT32", shape=[1])
        request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter([request])))
    out = []
    for answer in answers:
        assert not answer.error_message, answer.error_message
        for raw in answer.infer_response.raw_output_contents:
            out += np.frombuffer(raw, np.int32).tolist()
    return out


def test_a_decoupled_model_streams_the_same_responses(triton: TritonServer) -> None:
    live = _stream_tokens(triton.grpc_address, 4, 5, 2)
    inputs = {
        "COUNT": np.array([4], np.int32),
        "FIRST_MS": np.array([5], np.int32),
        "SLEEP_MS": np.array([2], np.int32),
    }
    execution = replay(triton, "token_stream").respond(inputs)
    replayed = [int(r.outputs()["TOKEN"][0]) for r in execution.with_data()]
    assert replayed == live == [0, 1, 2, 3]
