"""A SavedModel's serving signature as input specs: what an admin profile without a request
feeds a TensorFlow model.

Read from `saved_model.pb` (the `MetaGraphDef` tagged `serve`) without loading the model:
each input of the signature becomes an `InputSpec` under its signature key (the name a
`PredictRequest` uses), unknown dimensions (`None`) become 1. TensorFlow loads on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.inputs import InputSpec
from sidecar.replay.tf_decode import DEFAULT_SIGNATURE

SERVE_TAG = "serve"


class SignatureError(LookupError):
    """The SavedModel's signature cannot be read or has no usable inputs."""


def _meta_graph(path: Path) -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import saved_model_pb2

    model = saved_model_pb2.SavedModel()
    try:
        model.ParseFromString((path / "saved_model.pb").read_bytes())
    except OSError as exc:
        raise SignatureError(f"cannot read {path / 'saved_model.pb'}: {exc.strerror}") from None
    except DecodeError as exc:
        raise SignatureError(f"{path / 'saved_model.pb'} is not a SavedModel: {exc}") from None
    for graph in model.meta_graphs:
        if SERVE_TAG in graph.meta_info_def.tags:
            return graph
    raise SignatureError(f"the SavedModel in {path} has no graph tagged {SERVE_TAG!r}")


def signature_input_specs(path: Path | str, signature: str = DEFAULT_SIGNATURE) -> list[InputSpec]:
    """Batch-1 input specs of `signature` of the SavedModel folder `path` (None dims -> 1)."""
    import tensorflow as tf

    path = Path(path)
    graph = _meta_graph(path)
    if signature not in graph.signature_def:
        known = ", ".join(sorted(graph.signature_def)) or "none"
        raise SignatureError(
            f"the SavedModel in {path} has no signature {signature!r} (signatures: {known})"
        )
    inputs = graph.signature_def[signature].inputs
    if not inputs:
        raise SignatureError(f"signature {signature!r} of the SavedModel in {path} has no inputs")
    specs = []
    for name in sorted(inputs):
        info = inputs[name]
        if info.tensor_shape.unknown_rank:
            raise SignatureError(
                f"input {name!r} of signature {signature!r} has an unknown rank; "
                "give inputs in the TriggerProfile request"
            )
        try:
            dtype = np.dtype(tf.dtypes.as_dtype(info.dtype).as_numpy_dtype)
        except TypeError:
            raise SignatureError(f"input {name!r} has dtype {info.dtype}, not a tensor") from None
        shape = tuple(1 if d.size < 0 else int(d.size) for d in info.tensor_shape.dim)
        specs.append(InputSpec(name, shape, dtype.name))
    return specs
