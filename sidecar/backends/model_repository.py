"""Find a model in a Triton model repository or a TF-Serving model base path, for the
profiling worker to replay.

Triton's layout: `<repo>/<model>/config.pbtxt` and `<repo>/<model>/<version>/<file>`, where
the file is `model.onnx` (ONNX Runtime), `model.pt` (PyTorch / TorchScript) or
`model.savedmodel/` (TensorFlow), or the name in the config's `default_model_filename`.
TF-Serving's layout: `<base>/<model>/<version>/saved_model.pb`, no config; the version folder
itself is the SavedModel. Without a requested version the highest numeric version folder is
used. A Python-backend model whose version folder holds a `model.onnx` (or `model.pt`)
counts as that format: it is how the sample `simple_cnn` is served. One with only its
`model.py` resolves to that file (format `python`: the worker runs the model's own code,
`runners.python_model`); where the operator turned that off (`--replay-python-models off`),
a backend's lookup is wrapped by `python_models(find, False)`, which refuses it with the
reason.
An ensemble (`platform: "ensemble"`) resolves to its `config.pbtxt` (format `ensemble`): the
replay runs its steps as a graph (`runners.ensemble`); under `--replay-python-models off` one
with a Python-backend step is refused, the step named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.profiling import server_config
from sidecar.profiling.formats import ModelFormat, format_of

if TYPE_CHECKING:  # loaded on first use: the relay's process asks only `model_in_repository`
    from tritonclient.grpc import model_config_pb2

CONFIG_FILE = "config.pbtxt"
ENSEMBLE_PLATFORM = "ensemble"
PYTHON_BACKEND = "python"
PYTHON_MODEL_FILE = "model.py"
PYTHON_MODELS_OFF = "--replay-python-models is off"
SAVED_MODEL_FILE = "saved_model.pb"  # a version folder holding it is a SavedModel (TF-Serving)


DEFAULT_FILENAMES: dict[ModelFormat, str] = {
    ModelFormat.ONNX: "model.onnx",
    ModelFormat.TORCHSCRIPT: "model.pt",
    ModelFormat.SAVEDMODEL: "model.savedmodel",
}

# Triton platform or backend -> format of the model file
_FORMATS: dict[str, ModelFormat] = {
    "onnxruntime_onnx": ModelFormat.ONNX,
    "onnxruntime": ModelFormat.ONNX,
    "pytorch_libtorch": ModelFormat.TORCHSCRIPT,
    "pytorch": ModelFormat.TORCHSCRIPT,
    "tensorflow_savedmodel": ModelFormat.SAVEDMODEL,
    "tensorflow": ModelFormat.SAVEDMODEL,
}
_UNSUPPORTED = {
    "tensorrt_plan": "TensorRT plans",
    "tensorrt": "TensorRT plans",
    "tensorflow_graphdef": "TensorFlow GraphDefs",
    "openvino": "OpenVINO models",
    "fil": "FIL (tree) models",
    "dali": "DALI pipelines",
}


class ModelRepositoryError(LookupError):
    """A model could not be resolved in the model repository."""


class ModelNotFoundError(ModelRepositoryError):
    """No folder for the model in the repository."""


class ModelVersionNotFoundError(ModelRepositoryError):
    """The model has no (such) version folder."""


class UnsupportedModelFormatError(ModelRepositoryError):
    """The model's files cannot be replayed by any runner here."""


class ModelConfigError(ModelRepositoryError):
    """`config.pbtxt` cannot be read or parsed."""


@dataclass(frozen=True)
class TensorSpec:
    """An input or output from the config; `datatype` uses KServe names (`FP32`, `BYTES`)."""

    name: str
    datatype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ModelLocation:
    """A resolved model: the file (or SavedModel folder) to load, and what the config says."""

    name: str
    version: str
    path: Path
    format: ModelFormat
    platform: str = ""
    backend: str = ""
    max_batch_size: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    config: model_config_pb2.ModelConfig | None = field(default=None, compare=False)


def datatype_name(data_type: int) -> str:
    """`TYPE_FP32` -> `FP32`; Triton's `TYPE_STRING` is KServe's `BYTES`."""
    from tritonclient.grpc import model_config_pb2

    name: str = model_config_pb2.DataType.Name(data_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def read_config(path: Path) -> model_config_pb2.ModelConfig:
    """Parse a `config.pbtxt` (protobuf text format) into a `ModelConfig`."""
    try:
        return server_config.read_config(path)
    except server_config.ServerConfigError as exc:
        raise ModelConfigError(str(exc)) from None


def _valid_name(model: str) -> bool:
    """A single path component: never the repository itself or a path outside it."""
    return bool(model) and model not in (".", "..") and not any(c in model for c in "/\\\0")


def model_in_repository(repository: Path, model: str) -> bool:
    """True if `model` names a model folder of `repository` (never a path outside it)."""
    if not _valid_name(model):
        return False
    try:
        return (repository / model).is_dir()
    except (OSError, ValueError):
        return False


def _check_model_name(repository: Path, model: str) -> Path:
    if not _valid_name(model):
        raise ModelNotFoundError(f"{model!r} is not a valid model name")
    model_dir = repository / model
    if not model_dir.is_dir():
        if not repository.is_dir():
            raise ModelNotFoundError(
                f"model repository {repository} does not exist; check --model-repository"
            )
        known = sorted(p.name for p in repository.iterdir() if p.is_dir())
        raise ModelNotFoundError(
            f"model {model!r} is not in the model repository {repository} "
            f"(found: {', '.join(known) or 'no models'})"
        )
    return model_dir


def _numeric_versions(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def _served_versions(versions: list[int], config: model_config_pb2.ModelConfig | None) -> list[int]:
    """The versions Triton's `version_policy` serves (default: the latest one)."""
    if config is None or not config.HasField("version_policy"):
        return versions
    policy = config.version_policy
    if policy.WhichOneof("policy_choice") == "specific":
        wanted = set(policy.specific.versions)
        return [v for v in versions if v in wanted]
    return versions


def _version_dir(
    model_dir: Path, version: str | int | None, config: model_config_pb2.ModelConfig | None
) -> tuple[str, Path]:
    versions = _numeric_versions(model_dir)
    if version in (None, "", -1, "-1"):
        versions = _served_versions(versions, config)
        if not versions:
            raise ModelVersionNotFoundError(
                f"model {model_dir.name!r} has no numeric version folder in {model_dir} "
                "that its version_policy serves (expected e.g. 1/model.onnx)"
            )
        return str(versions[-1]), model_dir / str(versions[-1])
    text = str(version)
    if not text.isdigit() or int(text) not in versions:
        raise ModelVersionNotFoundError(
            f"model {model_dir.name!r} has no version {text!r} in {model_dir} "
            f"(versions: {', '.join(map(str, versions)) or 'none'})"
        )
    return str(int(text)), model_dir / str(int(text))


def _resolve_file(
    model: str, version_dir: Path, config: model_config_pb2.ModelConfig | None
) -> tuple[Path, ModelFormat]:
    kind = ((config.platform or config.backend) if config is not None else "").lower()
    if kind == ENSEMBLE_PLATFORM:
        return version_dir.parent / CONFIG_FILE, ModelFormat.ENSEMBLE
    if kind in _UNSUPPORTED:
        raise UnsupportedModelFormatError(
            f"model {model!r} is served by {kind!r}: {_UNSUPPORTED[kind]} cannot be replayed "
            "by the profiler (supported: ONNX, TorchScript, SavedModel)"
        )
    if config is not None and config.default_model_filename:
        path = version_dir / config.default_model_filename
        fmt = _FORMATS.get(kind) or format_of(path)
        if not path.exists():
            raise UnsupportedModelFormatError(
                f"model {model!r}: default_model_filename {config.default_model_filename!r} "
                f"is not in {version_dir}"
            )
        if fmt is None:
            raise UnsupportedModelFormatError(
                f"model {model!r}: cannot tell the format of {path.name} (backend "
                f"{kind or 'unknown'}); supported: .onnx, .pt, .savedmodel"
            )
        return path, fmt
    if config is None and (version_dir / SAVED_MODEL_FILE).is_file():
        return version_dir, ModelFormat.SAVEDMODEL  # TF-Serving's model base layout
    expected = _FORMATS.get(kind)
    candidates = [expected] if expected else list(DEFAULT_FILENAMES)  # python backend, no config
    for fmt in candidates:
        path = version_dir / DEFAULT_FILENAMES[fmt]
        if path.exists():
            return path, fmt
    if kind == PYTHON_BACKEND and (version_dir / PYTHON_MODEL_FILE).is_file():
        return version_dir / PYTHON_MODEL_FILE, ModelFormat.PYTHON
    wanted = " or ".join(DEFAULT_FILENAMES[f] for f in candidates)
    if config is None:
        wanted += f" (or a TF-Serving SavedModel, {SAVED_MODEL_FILE})"
    present = ", ".join(sorted(p.name for p in version_dir.iterdir())) or "nothing"
    raise UnsupportedModelFormatError(
        f"model {model!r} (backend {kind or 'unknown'}): no {wanted} in {version_dir} "
        f"(found: {present}); the profiler replays ONNX, TorchScript and SavedModel files"
    )


def _specs(tensors: Iterable[Any]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(name=t.name, datatype=datatype_name(t.data_type), dims=tuple(t.dims))
        for t in tensors
    )


def find_model(
    repository: Path | str, model: str, version: str | int | None = None
) -> ModelLocation:
    """Resolve `model` (latest numeric version unless `version` is given) in `repository`."""
    repository = Path(repository)
    model_dir = _check_model_name(repository, model)
    config_path = model_dir / CONFIG_FILE
    config = read_config(config_path) if config_path.is_file() else None
    if config is not None and config.name and config.name != model:
        raise ModelConfigError(
            f"{config_path} names the model {config.name!r} but its folder is {model!r}; "
            "Triton requires them to match"
        )
    version_text, version_dir = _version_dir(model_dir, version, config)
    path, fmt = _resolve_file(model, version_dir, config)
    if config is None:
        return ModelLocation(name=model, version=version_text, path=path, format=fmt)
    return ModelLocation(
        name=model,
        version=version_text,
        path=path,
        format=fmt,
        platform=config.platform,
        backend=config.backend,
        max_batch_size=int(config.max_batch_size),
        inputs=_specs(config.input),
        outputs=_specs(config.output),
        config=config,
    )


Find = Callable[[Path, str, str | int | None], ModelLocation]  # a backend's `Repository.find`


def python_models(find: Find, allowed: bool) -> Find:
    """A backend's lookup `find`, which, unless `allowed` (`--replay-python-models`), refuses
    a model it resolves to a Python-backend `model.py` (`UnsupportedModelFormatError`: such
    a model cannot be replayed, and its samples are kept live-only)."""
    if allowed:
        return find

    def refusing(root: Path, model: str, version: str | int | None = None) -> ModelLocation:
        location = find(root, model, version)
        if location.format is ModelFormat.PYTHON:
            raise UnsupportedModelFormatError(
                f"model {model!r} is a Python-backend model (its model.py): {PYTHON_MODELS_OFF}"
            )
        if location.format is ModelFormat.ENSEMBLE:
            _refuse_python_steps(refusing, root, location)
        return location

    return refusing


def _refuse_python_steps(find: Find, root: Path, location: ModelLocation) -> None:
    """Refuse an ensemble with a step `find` refuses (a Python-backend step), naming it."""
    from sidecar.profiling.ensemble.graph import EnsembleGraphError, steps_of

    try:
        steps = steps_of(location.config)
    except EnsembleGraphError:
        return  # the replay records the fault
    for step in steps:
        try:
            find(root, step.model, None if step.version < 0 else step.version)
        except UnsupportedModelFormatError as exc:
            raise UnsupportedModelFormatError(
                f"ensemble {location.name!r} step {step.model!r}: {exc}"
            ) from None
        except ModelRepositoryError:
            continue
