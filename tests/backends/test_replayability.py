"""Which models a replay can run, read from a real model repository on disk (the sample
repository's own models and configurations, real `config.pbtxt` parsing)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from sidecar.backends import backend_named
from sidecar.backends.model_repository import python_models
from sidecar.backends.replayability import ReplayabilityCache, replayability
from tests.harness.triton.model_repo import build_model_repository, simple_cnn, write_model

ENSEMBLE = """\
name: "pipeline"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_sub" model_version: -1
  input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
"""
UNKNOWN = 'name: "odd"\nbackend: "my_custom_backend"\nmax_batch_size: 0\n'
BROKEN = 'name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: [ nonsense\n'


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = build_model_repository(tmp_path_factory.mktemp("repo") / "models")
    write_model(root, "pipeline", ENSEMBLE)
    (write_model(root, "odd", UNKNOWN) / "model.bin").write_bytes(b"\0")
    write_model(root, "broken", BROKEN)
    return root


FIND = backend_named("triton").repository.find


@pytest.mark.parametrize(
    ("model", "replayable", "why"),
    [
        ("simple_cnn", True, ""),  # a Python backend that keeps its model.onnx beside model.py
        ("add_sub", True, ""),  # its model.py only: the worker runs it (runners.python_model)
        ("sleep", True, ""),
        ("pipeline", True, ""),  # an ensemble: its steps replayed as a graph (runners.ensemble)
        ("odd", False, "backend my_custom_backend"),
        ("broken", True, ""),  # a config that does not parse is a failed profile, not a kind
    ],
)
def test_a_model_is_replayable_when_its_lookup_resolves_a_runners_file(
    repo: Path, model: str, replayable: bool, why: str
) -> None:
    answer = replayability(FIND, repo, model)
    assert answer.replayable is replayable
    assert why in answer.reason and bool(answer.reason) is not replayable
    if not replayable:
        assert answer.attribute == f"not_replayable: {answer.reason}"


def test_python_models_are_live_only_when_their_replay_is_off(repo: Path) -> None:
    answer = replayability(python_models(FIND, False), repo, "add_sub")
    assert not answer.replayable
    assert answer.reason == (
        "model 'add_sub' is a Python-backend model (its model.py): --replay-python-models is off"
    )
    assert replayability(python_models(FIND, False), repo, "simple_cnn").replayable


def test_an_ensemble_with_a_python_step_is_live_only_when_python_replay_is_off(
    repo: Path,
) -> None:
    answer = replayability(python_models(FIND, False), repo, "pipeline")
    assert not answer.replayable
    assert answer.reason.startswith("ensemble 'pipeline' step 'add_sub': ")
    assert "--replay-python-models is off" in answer.reason


def test_answers_are_kept_per_model_for_their_time_to_live(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_model(root, "late", 'name: "late"\nbackend: "python"\nmax_batch_size: 0\n')
    now = [0.0]
    cache = ReplayabilityCache(FIND, root, ttl_s=10.0, clock=lambda: now[0])
    assert not cache.of("late").replayable
    onnx.save(simple_cnn(), str(root / "late" / "1" / "model.onnx"))  # now it has a model file
    now[0] = 9.9
    assert not cache.of("late").replayable
    now[0] = 10.0
    assert cache.of("late").replayable


def test_warm_asks_for_every_model_folder_beforehand(repo: Path) -> None:
    asked: list[str] = []

    def find(root: Path, model: str, version: str | int | None) -> object:
        asked.append(model)
        return FIND(root, model, version)

    cache = ReplayabilityCache(find, repo)
    cache.warm()
    assert sorted(asked) == sorted(p.name for p in repo.iterdir())
    assert not cache.of("odd").replayable and len(asked) == len(list(repo.iterdir()))
