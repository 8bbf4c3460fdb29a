"""Model formats: what kind of model file a path holds, by its extension or layout.

`format_of(path)` infers the format (`xsp-sidecar profile`); a SavedModel folder, or a
TF-Serving model folder of numbered versions, is found by its `saved_model.pb`; a `.py` file is
a Triton Python-backend model (`<repo>/<model>/<version>/model.py`); an ensemble is found by
the repository lookup only (its `config.pbtxt`, format `ensemble`). Which runner
profiles each format is `runners.select`'s business; this module imports no runtime.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from sidecar.profiling.vocabulary import ProfilingError


class ModelFormat(StrEnum):
    """What kind of model file a path holds."""

    ONNX = "onnx"
    TORCHSCRIPT = "torchscript"
    SAVEDMODEL = "savedmodel"
    PYTHON = "python"  # a Triton Python-backend model's own model.py
    ENSEMBLE = "ensemble"  # a Triton ensemble: its config.pbtxt's ensemble_scheduling


SUFFIXES: dict[ModelFormat, tuple[str, ...]] = {
    ModelFormat.ONNX: (".onnx",),
    ModelFormat.TORCHSCRIPT: (".pt", ".pth", ".torchscript", ".ts"),
    ModelFormat.SAVEDMODEL: (".savedmodel",),
    ModelFormat.PYTHON: (".py",),
}
SUPPORTED = (
    "ONNX through ONNX Runtime, TorchScript through PyTorch, SavedModel through TensorFlow, "
    "a Triton Python-backend model.py or an ensemble's config.pbtxt in its repository"
)


class UnsupportedFormatError(ProfilingError):
    """No runner here profiles this kind of model."""


def format_of(path: Path) -> ModelFormat | None:
    """The format a file's extension (or a SavedModel folder's layout) says, else None.

    A folder with `saved_model.pb` is a SavedModel, and so is a TF-Serving model folder
    (`<name>/<version>/saved_model.pb`); its runner takes the highest version."""
    suffix = path.suffix.lower()
    for fmt, suffixes in SUFFIXES.items():
        if suffix in suffixes:
            return fmt
    if savedmodel_dir(path) is not None:
        return ModelFormat.SAVEDMODEL
    return None


def savedmodel_dir(path: Path) -> Path | None:
    """The SavedModel folder `path` names: itself, or for a TF-Serving model folder
    (`<name>/<version>/saved_model.pb`) its highest numeric version; else None."""
    if (path / "saved_model.pb").is_file():
        return path
    if not path.is_dir():
        return None
    versions = [p for p in path.iterdir() if p.name.isdigit() and (p / "saved_model.pb").is_file()]
    return max(versions, key=lambda p: int(p.name)) if versions else None


def savedmodel_name(path: Path) -> str:
    """A SavedModel's model name: its folder, or the model folder above a version folder."""
    path = savedmodel_dir(path) or path
    resolved = path.resolve()
    return resolved.parent.name if resolved.name.isdigit() else resolved.name
