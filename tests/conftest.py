"""Shared fixtures: a real Triton server (from `nvidia-pytriton`) with the sample models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar.localtriton.model_repo import build_model_repository
from sidecar.localtriton.server import TritonServer


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A running `tritonserver` serving `add_sub`, `simple_cnn` and `sleep` on free ports."""
    root = tmp_path_factory.mktemp("triton")
    repo = build_model_repository(root / "models")
    server = TritonServer(model_repository=repo, log_path=root / "tritonserver.log")
    with server:
        yield server
