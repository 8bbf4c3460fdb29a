"""The ensemble runner on real repositories: real `config.pbtxt` parsing, the steps' own
`model.py` files and ONNX Runtime, the real leveled experiment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.backends.model_repository import find_model
from sidecar.profiling.ensemble.graph import EnsembleGraphError, in_order, steps_of
from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.runners.ensemble import EnsembleRunner, StepNotReplayableError
from sidecar.profiling.runners.select import runner_for
from sidecar.profiling.vocabulary import Runner
from sidecar.trace.spans import Level
from tests.harness.triton.ensemble_models import ENSEMBLE, add_ensemble
from tests.harness.triton.model_repo import build_model_repository, write_model

STEP_CONFIG = (
    'name: "NAME"\nbackend: "python"\nmax_batch_size: 0\n'
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
)
STEP_PY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x OP).astype(np.float32))])]
"""
# listed out of order: `times3` reads `a`, which `plus1` writes; `times3` writes OUT
CHAIN = """\
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "times3" model_version: -1
    input_map { key: "X" value: "a" } output_map { key: "Y" value: "OUT" } },
  { model_name: "plus1" model_version: -1
    input_map { key: "X" value: "IN" } output_map { key: "Y" value: "a" } }
] }
"""
TRT_STEP = 'name: "engine"\nplatform: "tensorrt_plan"\nmax_batch_size: 0\n'


def _step_runner(loc: Any) -> Runner:
    return runner_for(loc.path, loc.format, name=loc.name, find=find_model)


def _chain(repo: Path, second: str = "times3") -> Path:
    write_model(repo, "plus1", STEP_CONFIG.replace("NAME", "plus1"), STEP_PY.replace("OP", "+ 1"))
    write_model(repo, "times3", STEP_CONFIG.replace("NAME", "times3"), STEP_PY.replace("OP", "* 3"))
    write_model(repo, "chain", CHAIN.replace('"times3"', f'"{second}"'))
    return repo


def test_steps_run_in_dependency_order_not_config_order(tmp_path: Path) -> None:
    location = find_model(_chain(tmp_path / "models"), "chain")
    steps = steps_of(location.config)
    assert [s.model for s in steps] == ["times3", "plus1"]
    assert [s.model for s in in_order(steps, ["IN"])] == ["plus1", "times3"]
    with pytest.raises(EnsembleGraphError, match=r"step 'times3' can never run: .* a"):
        in_order(steps[:1], ["IN"])


def test_tensors_go_through_input_and_output_maps(tmp_path: Path) -> None:
    location = find_model(_chain(tmp_path / "models"), "chain")
    ens = EnsembleRunner(location, _step_runner, find_model)
    x = np.array([1, 2, 3, 4], np.float32)
    fed = ens.flow({"IN": x})
    np.testing.assert_array_equal(fed[0]["X"], x)  # plus1 reads IN as X
    np.testing.assert_array_equal(fed[1]["X"], x + 1)  # times3 reads plus1's Y (a) as X


def test_a_first_step_that_cannot_be_replayed_stops_the_replay_naming_it(tmp_path: Path) -> None:
    repo = _chain(tmp_path / "models")
    write_model(repo, "chain", CHAIN.replace('"plus1"', '"engine"'))  # engine reads IN: first
    (write_model(repo, "engine", TRT_STEP) / "model.plan").write_bytes(b"\0")
    with pytest.raises(StepNotReplayableError) as caught:
        runner_for(
            repo / "chain" / "config.pbtxt", find_model(repo, "chain").format, find=find_model
        )
    message = str(caught.value)
    assert "ensemble 'chain' step 1 ('engine') cannot be replayed" in message
    assert "stopped at that step" in message and "TensorRT plans" in message


def test_a_later_step_that_cannot_be_loaded_gives_a_partial_profile(tmp_path: Path) -> None:
    repo = _chain(tmp_path / "models", second="engine")
    (write_model(repo, "engine", TRT_STEP) / "model.plan").write_bytes(b"\0")
    runner = runner_for(
        repo / "chain" / "config.pbtxt", find_model(repo, "chain").format, find=find_model
    )
    x = np.zeros(4, np.float32)
    profile = run_experiment(runner, {"IN": x}, model="chain", iterations=3, warmup=1)
    assert profile.trace.status == "error"
    assert "ensemble 'chain' step 2 ('engine') cannot be replayed" in profile.trace.error
    assert "TensorRT plans" in profile.trace.error
    failed = profile.trace.attributes["ensemble_failed_step"]
    assert (failed["step"], failed["index"], failed["model"]) == ("chain/engine", 1, "engine")
    names = {s.name for s in profile.spans_at(Level.MODEL)}
    assert names == {"chain", "plus1"}  # the step before the failure keeps its spans
    assert profile.spans_at(Level.LAYER)  # and its levels below


def test_ens_cnn_profiles_as_ensemble_then_steps_then_their_levels(tmp_path: Path) -> None:
    repo = add_ensemble(build_model_repository(tmp_path / "models"))
    location = find_model(repo, ENSEMBLE)
    runner = runner_for(location.path, location.format, find=find_model)
    raw = np.random.default_rng(0).uniform(0, 255, (2, 3, 32, 32)).astype(np.float32)
    profile = run_experiment(runner, {"RAW": raw}, model=ENSEMBLE, iterations=5, warmup=1)

    models = profile.spans_at(Level.MODEL)
    top = [s for s in models if s.parent_id is None]
    assert [s.name for s in top] == [ENSEMBLE]
    steps = sorted((s for s in models if s.parent_id == top[0].span_id), key=lambda s: s.start_ns)
    assert [s.name for s in steps] == ["pre", "simple_cnn"]
    assert [s.attributes["ensemble_step"] for s in steps] == ["ens_cnn/pre", "ens_cnn/simple_cnn"]
    assert steps[0].end_ns <= steps[1].start_ns
    # each step's duration is its own M statistic; the ensemble's is the M run's (level_stats)
    m = profile.stats(Level.MODEL)
    assert top[0].duration_ns == m.trimmed_mean_ns
    assert all(0 < (s.duration_ns or 0) < m.trimmed_mean_ns for s in steps)
    layers = profile.spans_at(Level.LAYER)
    by_id = {s.span_id: s.name for s in steps}
    owners = {by_id.get(layer.parent_id or "") for layer in layers}
    assert owners == {"pre", "simple_cnn"}  # each step's layers hang under that step
    assert profile.stats(Level.LAYER).trimmed_mean_ns > 0  # L timed in its own run
    assert "ens_cnn/simple_cnn" in profile.trace.attributes["ensemble_steps_layer"]


def test_a_replay_job_of_an_ensemble_with_a_step_it_cannot_run_stores_the_step_and_why(
    tmp_path: Path,
) -> None:
    from sidecar.replay.context import ReplayContext
    from sidecar.replay.job_records import ProfileJob
    from sidecar.replay.options import ReplayOptions
    from sidecar.replay.replay_job import replay_job
    from sidecar.trace.spans import new_span_id, new_trace_id
    from sidecar.trace.store import TraceStore

    repo = _chain(tmp_path / "models", second="engine")
    (write_model(repo, "engine", TRT_STEP) / "model.plan").write_bytes(b"\0")
    db = tmp_path / "t.db"
    options = ReplayOptions(
        model_repository=repo, db_path=db, levels=(Level.MODEL,), iterations=3, warmup=1,
        store_raw_inputs=False, device="cpu",
    )  # fmt: skip
    job = ProfileJob(new_trace_id(), new_span_id(), "chain", "ModelInfer", b"", "forced", 0)
    result = replay_job(job, ReplayContext(options))
    assert result.outcome == "error"
    assert "ensemble 'chain' step 2 ('engine')" in result.error
    store = TraceStore(db)
    trace = store.get_trace(job.trace_id)
    assert trace is not None and trace.status == "error"
    assert trace.error.startswith("ensemble 'chain' step 2 ('engine') cannot be replayed")
    assert trace.attributes["ensemble_failed_step"]["step"] == "chain/engine"
    spans = store.spans(job.trace_id, Level.MODEL)
    assert {s.name for s in spans} == {"chain", "plus1"}
    (top,) = [s for s in spans if s.name == "chain"]
    assert top.parent_id == job.parent_span_id  # hung under the request, as a full replay
    assert [s.level for s in store.level_stats(job.trace_id)] == [Level.MODEL]


def _failing(repo: Path, name: str) -> None:
    failing = STEP_PY.replace(
        'return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x OP).astype(np.float32))])]',
        'return [pb_utils.InferenceResponse(error=pb_utils.TritonError("bad input"))]',
    )
    write_model(repo, name, STEP_CONFIG.replace("NAME", name), failing)


def test_a_step_that_fails_while_running_keeps_the_steps_before_it(tmp_path: Path) -> None:
    repo = _chain(tmp_path / "models")
    _failing(repo, "times3")
    location = find_model(repo, "chain")
    ens = EnsembleRunner(location, _step_runner, find_model)
    run = ens.run({"IN": np.zeros(4, np.float32)}, Level.MODEL, 3, 1)
    assert run.attributes["partial_replay"].startswith("ensemble 'chain' step 2 ('times3') failed")
    assert "bad input" in run.attributes["partial_replay"]
    assert [s.name for s in run.iterations[0].spans] == ["chain", "plus1"]


def test_a_first_step_that_fails_while_running_stops_the_replay(tmp_path: Path) -> None:
    repo = _chain(tmp_path / "models")
    write_model(repo, "chain", CHAIN.replace('"plus1"', '"bad"'))  # bad reads IN: first
    _failing(repo, "bad")
    location = find_model(repo, "chain")
    ens = EnsembleRunner(location, _step_runner, find_model)
    with pytest.raises(StepNotReplayableError, match=r"step 1 \('bad'\) failed.*bad input"):
        ens.run({"IN": np.zeros(4, np.float32)}, Level.MODEL, 3, 1)


TS_CONFIG = """\
name: "double_ts"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
TF_CONFIG = """\
name: "add10_tf"
platform: "tensorflow_savedmodel"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "output_0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
# plus1 (Python) -> double_ts (TorchScript) -> add10_tf (SavedModel): OUT = (IN + 1) * 2 + 10
FORMATS_CHAIN = """\
name: "formats"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "plus1" model_version: -1
    input_map { key: "X" value: "IN" } output_map { key: "Y" value: "a" } },
  { model_name: "double_ts" model_version: -1
    input_map { key: "INPUT__0" value: "a" } output_map { key: "OUTPUT__0" value: "b" } },
  { model_name: "add10_tf" model_version: -1
    input_map { key: "x" value: "b" } output_map { key: "output_0" value: "OUT" } }
] }
"""


def _torchscript_and_savedmodel_steps(repo: Path) -> Path:
    import tensorflow as tf
    import torch

    class Double(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = torch.nn.ReLU()  # a module: a layer of the step

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(x) * 2

    ts_dir = write_model(repo, "double_ts", TS_CONFIG)
    torch.jit.script(Double()).save(str(ts_dir / "model.pt"))

    add10 = tf.keras.Sequential(  # y = x + 10: an identity kernel, a bias of 10
        [
            tf.keras.Input(shape=(4,), name="x"),
            tf.keras.layers.Dense(
                4,
                kernel_initializer="identity",
                bias_initializer=tf.keras.initializers.Constant(10.0),
            ),
        ]
    )
    add10.export(str(write_model(repo, "add10_tf", TF_CONFIG) / "model.savedmodel"), verbose=False)
    write_model(repo, "formats", FORMATS_CHAIN)
    return repo


def test_torchscript_and_savedmodel_steps_run_in_the_ensembles_replay(tmp_path: Path) -> None:
    repo = _torchscript_and_savedmodel_steps(_chain(tmp_path / "models"))
    runner = runner_for(repo / "formats" / "config.pbtxt", find_model(repo, "formats").format,
                        find=find_model)  # fmt: skip
    x = np.array([[1, 2, 3, 4]], np.float32)  # [1, 4]: the Keras model's batch of one
    assert isinstance(runner, EnsembleRunner)
    fed = runner.flow({"IN": x})
    assert runner.failure is None, runner.failure
    np.testing.assert_array_equal(fed[1]["INPUT__0"], x + 1)  # TorchScript reads plus1's Y
    np.testing.assert_array_equal(fed[2]["x"], (x + 1) * 2)  # SavedModel reads TorchScript's
    np.testing.assert_array_equal(
        runner.steps[2].runner.outputs(fed[2])["output_0"], (x + 1) * 2 + 10
    )  # type: ignore[attr-defined]
    profile = run_experiment(runner, {"IN": x}, model="formats", iterations=3, warmup=1)
    assert profile.trace.status == "ok"
    steps = [s for s in profile.spans_at(Level.MODEL) if "ensemble_step" in s.attributes]
    assert [s.name for s in sorted(steps, key=lambda s: s.start_ns)] == [
        "plus1", "double_ts", "add10_tf"
    ]  # fmt: skip
    parent = {s.span_id: s.parent_id for s in profile.spans}
    names = {s.span_id: s.name for s in steps}

    def step_of(span_id: str | None) -> str | None:
        while span_id is not None and span_id not in names:
            span_id = parent.get(span_id)
        return names.get(span_id or "")

    assert "add10_tf" in {step_of(s.parent_id) for s in profile.spans_at(Level.LAYER)}
    (ts,) = [s for s in steps if s.name == "double_ts"]
    inside = [
        k
        for k in profile.spans_at(Level.KERNEL)
        if ts.start_ns <= k.start_ns <= k.end_ns <= ts.end_ns
    ]
    assert inside  # the TorchScript step's own ops, from its own runner's K run


TOKEN_IN = (
    'input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }, '
    '{ name: "FIRST_MS" data_type: TYPE_INT32 dims: [ 1 ] }, '
    '{ name: "SLEEP_MS" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
)
TOKEN_MAPS = (
    'input_map { key: "COUNT" value: "COUNT" } input_map { key: "FIRST_MS" value: "FIRST_MS" } '
    'input_map { key: "SLEEP_MS" value: "SLEEP_MS" } output_map { key: "TOKEN" value: "T" }'
)


def _stream_ensemble(repo: Path, then: str) -> None:
    after = (
        f', {{ model_name: "{then}" model_version: -1 '
        'input_map { key: "X" value: "T" } output_map { key: "Y" value: "OUT" } }'
        if then
        else ""
    )
    write_model(
        repo,
        "streamer",
        'name: "streamer"\nplatform: "ensemble"\nmax_batch_size: 0\n' + TOKEN_IN
        + 'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        + 'ensemble_scheduling { step [ { model_name: "token_stream" model_version: -1 '
        + f"{TOKEN_MAPS} }}{after} ] }}\n",
    )  # fmt: skip


def test_a_decoupled_last_step_is_replayed_one_feeding_others_is_not(tmp_path: Path) -> None:
    from tests.harness.triton.model_repo import add_token_stream

    repo = add_token_stream(_chain(tmp_path / "models"))
    _stream_ensemble(repo, then="")
    runner = runner_for(repo / "streamer", find_model(repo, "streamer").format, find=find_model)
    inputs = {
        n: np.array([v], np.int32) for n, v in (("COUNT", 3), ("FIRST_MS", 1), ("SLEEP_MS", 1))
    }
    profile = run_experiment(runner, inputs, model="streamer", levels=(Level.MODEL,), iterations=2)
    (step,) = [s for s in profile.spans_at(Level.MODEL) if "ensemble_step" in s.attributes]
    assert step.name == "token_stream" and step.attributes["responses"] == 3

    _stream_ensemble(repo, then="plus1")
    with pytest.raises(StepNotReplayableError, match=r"'token_stream' is a decoupled model") as e:
        runner_for(repo / "streamer", find_model(repo, "streamer").format, find=find_model)
    assert "each of its responses on to them as a request of its own" in str(e.value)
