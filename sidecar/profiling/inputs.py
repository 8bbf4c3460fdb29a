"""Model inputs for a profile: `--input name:shape:dtype` specs, `.npz` files, or the model's
own input signature (dynamic batch dims take the batch size)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np


class InputError(ValueError):
    """Inputs could not be built; the message says what to pass instead."""


@dataclass(frozen=True)
class InputSpec:
    """One input tensor to generate: name, shape, numpy dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def with_batch(self, batch: int) -> InputSpec:
        if not self.shape:
            raise InputError(f"input {self.name!r} is a scalar; it has no batch dimension")
        return replace(self, shape=(batch, *self.shape[1:]))


def parse_input_spec(text: str) -> InputSpec:
    """`input:1x3x224x224:float32` (or `1,3,224,224`; dtype defaults to float32)."""
    parts = text.rsplit(":", 2)
    if len(parts) == 3 and not _is_dtype(parts[2]):
        parts = [f"{parts[0]}:{parts[1]}", parts[2]]  # a name with ':' and no dtype
    if len(parts) < 2 or not parts[0]:
        raise InputError(
            f"bad --input {text!r}: expected NAME:SHAPE[:DTYPE], e.g. input:1x3x224x224:float32"
        )
    name, shape_text = parts[0], parts[1]
    dtype = parts[2] if len(parts) == 3 else "float32"
    if not _is_dtype(dtype):
        raise InputError(f"bad --input {text!r}: unknown dtype {dtype!r} (e.g. float32, int64)")
    try:
        shape = tuple(int(d) for d in shape_text.replace(",", "x").split("x") if d.strip())
    except ValueError:
        raise InputError(
            f"bad --input {text!r}: shape {shape_text!r} must be integers separated by 'x'"
        ) from None
    if any(d <= 0 for d in shape):
        raise InputError(f"bad --input {text!r}: every dimension must be a positive integer")
    return InputSpec(name, shape, str(np.dtype(dtype)))


def _is_dtype(text: str) -> bool:
    try:
        np.dtype(text)
    except TypeError:
        return False
    return True


def random_inputs(specs: Sequence[InputSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors for `specs`: uniform [0, 1) floats, small non-negative integers."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            out[spec.name] = rng.random(spec.shape).astype(dtype)
        elif dtype.kind in "iu":
            out[spec.name] = rng.integers(0, 10, spec.shape).astype(dtype)
        elif dtype.kind == "b":
            out[spec.name] = rng.random(spec.shape) < 0.5
        else:
            raise InputError(f"cannot generate random data of dtype {dtype} for {spec.name!r}")
    return out


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    """All arrays of an `.npz` file, by name."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"inputs file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path} as an .npz file: {exc}") from None


def onnx_input_specs(model_path: str | Path, batch_size: int) -> list[InputSpec]:
    """Specs from an ONNX model's graph inputs; a dynamic first dim becomes `batch_size`."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(model_path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    specs = []
    for value in graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims: list[int] = []
        for i, dim in enumerate(tensor.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                dims.append(int(dim.dim_value))
            elif i == 0:
                dims.append(batch_size)
            else:
                label = dim.dim_param or "?"
                raise InputError(
                    f"input {value.name!r} has dynamic dimension {i} ({label!r}) that is not the "
                    f"batch dimension; give its shape with --input {value.name}:SHAPE:DTYPE"
                )
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
        specs.append(InputSpec(value.name, tuple(dims), dtype))
    return specs


SERVE_TAG = "serve"


def _serving_graph(saved_model_dir: Path) -> Any:
    """The `MetaGraphDef` tagged `serve` of the SavedModel in `saved_model_dir` (not loaded)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import saved_model_pb2

    path = saved_model_dir / "saved_model.pb"
    model = saved_model_pb2.SavedModel()
    try:
        model.ParseFromString(path.read_bytes())
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    except DecodeError as exc:
        raise InputError(f"{path} is not a SavedModel: {exc}") from None
    for graph in model.meta_graphs:
        if SERVE_TAG in graph.meta_info_def.tags:
            return graph
    raise InputError(f"the SavedModel in {saved_model_dir} has no graph tagged {SERVE_TAG!r}")


def savedmodel_input_specs(
    saved_model_dir: str | Path,
    batch_size: int,
    signature: str = "serving_default",
    other_unknown_dims: int | None = None,
) -> list[InputSpec]:
    """Specs from a SavedModel signature's inputs (the keyword names the signature takes),
    read from `saved_model.pb` without loading the model.

    An unknown first dim takes `batch_size`; any other unknown dim takes `other_unknown_dims`,
    or is an `InputError` when that is None. Messages state the fact; callers add the advice
    (a `--input` flag, a TriggerProfile request).
    """
    import tensorflow as tf

    path = Path(saved_model_dir)
    graph = _serving_graph(path)
    if signature not in graph.signature_def:
        known = ", ".join(sorted(graph.signature_def)) or "none"
        raise InputError(
            f"the SavedModel in {path} has no signature {signature!r} (signatures: {known})"
        )
    inputs = graph.signature_def[signature].inputs
    if not inputs:
        raise InputError(f"signature {signature!r} of the SavedModel in {path} has no inputs")
    specs = []
    for name, info in sorted(inputs.items()):
        if info.tensor_shape.unknown_rank:
            raise InputError(f"input {name!r} of signature {signature!r} has an unknown rank")
        dims: list[int] = []
        for i, dim in enumerate(info.tensor_shape.dim):
            if dim.size >= 0:
                dims.append(int(dim.size))
            elif i == 0:
                dims.append(batch_size)
            elif other_unknown_dims is not None:
                dims.append(other_unknown_dims)
            else:
                raise InputError(
                    f"input {name!r} has dynamic dimension {i} that is not the batch dimension"
                )
        try:
            dtype = np.dtype(tf.dtypes.as_dtype(info.dtype).as_numpy_dtype).name
        except TypeError:
            raise InputError(f"input {name!r} has dtype {info.dtype}, not a tensor") from None
        specs.append(InputSpec(name, tuple(dims), dtype))
    return specs


def config_input_specs(config: Any, batch: int = 1) -> list[InputSpec]:
    """Input specs from a Triton `ModelConfig` (e.g. a Python-backend model, whose `model.py`
    declares nothing): variable dims become 1, and a model that batches gets `batch` first."""
    from tritonclient.grpc import model_config_pb2

    specs = []
    for tensor in config.input:
        name = model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")
        dtype = {"FP16": "float16", "FP32": "float32", "FP64": "float64", "BOOL": "bool"}.get(
            name, name.lower()
        )
        if dtype not in ("bool", "float16", "float32", "float64") and not dtype.startswith(
            ("int", "uint")
        ):
            raise InputError(f"cannot generate {name} data for input {tensor.name!r}")
        dims = tuple(1 if d < 0 else int(d) for d in tensor.dims)
        shape = (batch, *dims) if int(config.max_batch_size) > 0 else dims
        specs.append(InputSpec(tensor.name, shape, dtype))
    if not specs:
        raise InputError("the model's config.pbtxt declares no inputs")
    return specs
