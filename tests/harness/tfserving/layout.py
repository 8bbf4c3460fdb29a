"""TF-Serving's model base path layout, `<base>/<name>/<version>/saved_model.pb`, read without
TensorFlow."""

from __future__ import annotations

from pathlib import Path

SAVED_MODEL = "saved_model.pb"


def model_versions(base: Path) -> dict[str, list[int]]:
    """`{name: sorted versions}` of the SavedModels under a model base path."""
    found: dict[str, list[int]] = {}
    for model in sorted(p for p in Path(base).iterdir() if p.is_dir()):
        versions = sorted(
            int(v.name) for v in model.iterdir() if v.name.isdigit() and (v / SAVED_MODEL).is_file()
        )
        if versions:
            found[model.name] = versions
    return found
