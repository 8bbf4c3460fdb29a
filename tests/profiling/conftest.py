from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.harness import models


@pytest.fixture(scope="session")
def cnn_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save_onnx(
        models.small_cnn_onnx(), tmp_path_factory.mktemp("models") / "small_cnn.onnx"
    )


@pytest.fixture(scope="session")
def cnn_torchscript(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.small_cnn_torchscript(tmp_path_factory.mktemp("models") / "small_cnn.pt")


@pytest.fixture()
def cnn_inputs() -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)}
