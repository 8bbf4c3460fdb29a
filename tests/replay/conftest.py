"""A TF-Serving model base path with the Keras sample models, built once for the replay tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.tfserving.models import build_model_base


@pytest.fixture(scope="session")
def tf_model_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`<base>/keras_cnn/1/saved_model.pb` and `<base>/keras_transformer/1/saved_model.pb`."""
    return build_model_base(tmp_path_factory.mktemp("tfserving") / "models")
