"""Small Keras models saved as TF-Serving would load them: `<base>/<name>/<version>/`.

`keras_cnn` and `keras_transformer` are built in code with random weights (no downloads), every
layer named, so that profiles can be checked for Keras layer names. `build_model_base` writes
both into a model base path, one model folder each, version 1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CNN = "keras_cnn"
TRANSFORMER = "keras_transformer"
CNN_LAYERS = ("conv1", "pool1", "conv2", "gap", "fc")
TRANSFORMER_LAYERS = ("embed", "attention", "add1", "norm1", "ffn_up", "ffn_down", "add2",
                      "norm2", "pool", "head")  # fmt: skip


def keras_cnn(image_size: int = 32, classes: int = 10) -> Any:
    """A small image classifier: input `image` [N, S, S, 3] float32 -> `output_0` [N, classes]."""
    import keras

    image = keras.Input((image_size, image_size, 3), name="image")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(image)
    x = keras.layers.MaxPooling2D(2, name="pool1")(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    logits = keras.layers.Dense(classes, name="fc")(x)
    return keras.Model(image, logits, name=CNN)


def keras_transformer(
    tokens: int = 16, features: int = 32, heads: int = 4, classes: int = 4
) -> Any:
    """One transformer encoder block: input `features` [N, tokens, F] float32 -> `output_0`."""
    import keras

    inputs = keras.Input((tokens, features), name="features")
    x = keras.layers.Dense(features, name="embed")(inputs)
    attended = keras.layers.MultiHeadAttention(heads, features // heads, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm1")(keras.layers.Add(name="add1")([x, attended]))
    hidden = keras.layers.Dense(4 * features, activation="gelu", name="ffn_up")(x)
    hidden = keras.layers.Dense(features, name="ffn_down")(hidden)
    x = keras.layers.LayerNormalization(name="norm2")(keras.layers.Add(name="add2")([x, hidden]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(classes, name="head")(x)
    return keras.Model(inputs, logits, name=TRANSFORMER)


def save_model(model: Any, base: Path, name: str, version: int = 1) -> Path:
    """Export `model` as a SavedModel at `base/name/version` (signature `serving_default`)."""
    path = Path(base) / name / str(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.export(str(path), verbose=False)
    return path


def build_model_base(base: Path) -> Path:
    """A TF-Serving model base path with `keras_cnn` and `keras_transformer`, version 1."""
    import keras

    keras.utils.set_random_seed(0)
    base = Path(base)
    save_model(keras_cnn(), base, CNN)
    save_model(keras_transformer(), base, TRANSFORMER)
    return base
