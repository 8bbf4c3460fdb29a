"""Input specs from a SavedModel's serving signature: the Keras sample models, saved for real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling.inputs import InputSpec, random_inputs
from sidecar.replay.savedmodel_signature import SignatureError, signature_input_specs


def test_serving_default_inputs_with_unknown_dims_as_one(tf_model_base: Path) -> None:
    cnn = signature_input_specs(tf_model_base / "keras_cnn" / "1")
    assert cnn == [InputSpec("image", (1, 32, 32, 3), "float32")]
    transformer = signature_input_specs(tf_model_base / "keras_transformer" / "1")
    assert transformer == [InputSpec("features", (1, 16, 32), "float32")]
    (image,) = random_inputs(cnn).values()
    assert image.shape == (1, 32, 32, 3) and image.dtype == np.float32


def test_unreadable_savedmodels_and_signatures_are_clear_errors(
    tf_model_base: Path, tmp_path: Path
) -> None:
    with pytest.raises(SignatureError, match=r"no signature 'predict'.*serving_default"):
        signature_input_specs(tf_model_base / "keras_cnn" / "1", "predict")
    with pytest.raises(SignatureError, match="cannot read"):
        signature_input_specs(tmp_path)
    (tmp_path / "saved_model.pb").write_bytes(b"\xff\xff")
    with pytest.raises(SignatureError, match="is not a SavedModel"):
        signature_input_specs(tmp_path)
