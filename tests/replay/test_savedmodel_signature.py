"""Input specs from a SavedModel's serving signature, as replay asks for them (every unknown
dim 1) and as `profile` does (unknown batch dim = the batch size, others an error): the Keras
sample models, saved for real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling.inputs import InputError, InputSpec, random_inputs, savedmodel_input_specs


def test_serving_default_inputs_with_unknown_dims_as_one(tf_model_base: Path) -> None:
    cnn = savedmodel_input_specs(tf_model_base / "keras_cnn" / "1", 1, other_unknown_dims=1)
    assert cnn == [InputSpec("image", (1, 32, 32, 3), "float32")]
    transformer = savedmodel_input_specs(
        tf_model_base / "keras_transformer" / "1", 1, other_unknown_dims=1
    )
    assert transformer == [InputSpec("features", (1, 16, 32), "float32")]
    (image,) = random_inputs(cnn).values()
    assert image.shape == (1, 32, 32, 3) and image.dtype == np.float32


def test_the_batch_dim_takes_the_batch_size(tf_model_base: Path) -> None:
    specs = savedmodel_input_specs(tf_model_base / "keras_cnn" / "1", 8)
    assert specs == [InputSpec("image", (8, 32, 32, 3), "float32")]


def test_unreadable_savedmodels_and_signatures_are_clear_errors(
    tf_model_base: Path, tmp_path: Path
) -> None:
    with pytest.raises(InputError, match=r"no signature 'predict'.*serving_default"):
        savedmodel_input_specs(tf_model_base / "keras_cnn" / "1", 1, "predict")
    with pytest.raises(InputError, match="cannot read"):
        savedmodel_input_specs(tmp_path, 1)
    (tmp_path / "saved_model.pb").write_bytes(b"\xff\xff")
    with pytest.raises(InputError, match="is not a SavedModel"):
        savedmodel_input_specs(tmp_path, 1)
