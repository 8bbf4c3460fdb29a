"""Shared fixtures: a real Triton server (from `nvidia-pytriton`) with the sample models, plain
or in OpenTelemetry trace mode; the stand-in for `tensorflow_model_server` with the Keras sample
models."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from tests.harness.process import free_port
from tests.harness.tfserving.models import build_model_base
from tests.harness.tfserving.process import TfServingServer
from tests.harness.triton.model_repo import build_model_repository
from tests.harness.triton.server import TritonServer
from tests.harness.triton.tracing import traced_server

# Hypothesis: `ci` (the default) draws the same examples in every run, so a test that passes
# passes again and a mutant one run catches every run catches (scripts/mutate_c.py relies on
# it); `long` draws ten times as many, fresh each run, for a search by hand or a script:
# `HYPOTHESIS_PROFILE=long pytest tests/proxy/test_messagewalk.py`; `mutate`, a fifth, for
# mutate_c.py's first pass. Tests that size their own max_examples scale it with
# tests/proxy/wire_strategies.examples().
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("long", max_examples=4000, derandomize=False, print_blob=True)
# scripts/mutate_c.py: a quick first pass, then all the examples; neither shrinks a failure
_no_shrink = [Phase.explicit, Phase.reuse, Phase.generate]
settings.register_profile(
    "mutate", derandomize=True, max_examples=20, phases=_no_shrink, database=None
)
settings.register_profile("mutate-all", derandomize=True, phases=_no_shrink, database=None)
# scripts/sanitize.sh --ci: the property tests under ASan/UBSan with 40 % of the examples
settings.register_profile("sanitize", derandomize=True, max_examples=40, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A running `tritonserver` serving `add_sub`, `simple_cnn` and `sleep` on free ports."""
    root = tmp_path_factory.mktemp("triton")
    repo = build_model_repository(root / "models")
    server = TritonServer(model_repository=repo, log_path=root / "tritonserver.log")
    with server:
        yield server


@pytest.fixture(scope="module")
def otlp_port() -> int:
    """The port a module's sidecars listen on for `traced_triton`'s spans (OTLP/HTTP)."""
    return free_port()


@pytest.fixture(scope="module")
def traced_triton(
    tmp_path_factory: pytest.TempPathFactory, otlp_port: int
) -> Iterator[TritonServer]:
    """A running `tritonserver` with the sample models that exports the spans of requests
    carrying a `traceparent` to `http://127.0.0.1:<otlp_port>/v1/traces` every 100 ms."""
    root = tmp_path_factory.mktemp("traced-triton")
    repo = build_model_repository(root / "models")
    otlp_url = f"http://127.0.0.1:{otlp_port}/v1/traces"
    with traced_server(repo, root / "tritonserver.log", otlp_url, 100) as server:
        yield server


@pytest.fixture(scope="session")
def tfserving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TfServingServer]:
    """The stand-in for `tensorflow_model_server` (real TensorFlow) serving `keras_cnn` and
    `keras_transformer` from a model base path, TF-Serving's REST API on `rest_url` and
    TensorFlow's profiler server on `profiler_address`."""
    root = tmp_path_factory.mktemp("tfserving")
    base = build_model_base(root / "models")
    with TfServingServer(base, root / "tfserving.log", profiler=True) as server:
        yield server


@pytest.fixture(scope="session")
def tf_model_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TF-Serving model base path with the Keras sample models, built once for the replay and
    backend tests: `<base>/keras_cnn/1/saved_model.pb`, `<base>/keras_transformer/1/...`."""
    return build_model_base(tmp_path_factory.mktemp("tfserving-base") / "models")
