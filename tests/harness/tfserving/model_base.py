"""The SavedModels of a TF-Serving model base path, loaded and run with real TensorFlow.

Part of the stand-in for `tensorflow_model_server` (which cannot be installed here). The layout
is TF-Serving's: `<base>/<name>/<version>/saved_model.pb`. Every numeric version is loaded; a
request without `model_spec.version` gets the latest. Requests fail as TF-Serving fails them:
`ServingError` carries the gRPC status code and TF-Serving's message, and the gRPC layer
(`server.py`) turns it into the call's status.

Imports TensorFlow at module import: only the stand-in's own process (and tests) import this.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc
import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_pb2,
    predict_pb2,
)

from tests.harness.tfserving.layout import SAVED_MODEL, model_versions

DEFAULT_SIGNATURE = "serving_default"
SERVE_TAG = "serve"
SIGNATURE_DEF = "signature_def"
CLASSIFY_INPUTS, CLASSIFY_CLASSES, CLASSIFY_SCORES = "inputs", "classes", "scores"
REGRESS_INPUTS, REGRESS_OUTPUTS = "inputs", "outputs"


class ServingError(Exception):
    """A request TF-Serving would refuse: its gRPC status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def dtype_name(dtype: int) -> str:
    """TensorFlow's own name of a `DataType` (`DT_FLOAT` -> `float`), as in its messages."""
    return str(types_pb2.DataType.Name(dtype)).removeprefix("DT_").lower()


def _join(names: Iterable[str]) -> str:
    return ",".join(sorted(names))


@dataclass
class Servable:
    """One loaded version of a model: its signature defs and TensorFlow's callables."""

    name: str
    version: int
    path: Path
    signature_defs: Mapping[str, meta_graph_pb2.SignatureDef]
    loaded: Any = field(repr=False)

    @classmethod
    def load(cls, name: str, version: int, path: Path) -> Servable:
        saved = saved_model_pb2.SavedModel.FromString((path / SAVED_MODEL).read_bytes())
        graphs = [g for g in saved.meta_graphs if SERVE_TAG in g.meta_info_def.tags]
        defs = graphs[0].signature_def if graphs else {}
        return cls(name, version, path, dict(defs), tf.saved_model.load(str(path), [SERVE_TAG]))

    def signature(self, name: str) -> meta_graph_pb2.SignatureDef:
        if name not in self.signature_defs or name not in self.loaded.signatures:
            raise ServingError(
                grpc.StatusCode.FAILED_PRECONDITION, f'Serving signature key "{name}" not found.'
            )
        return self.signature_defs[name]

    def predict(self, request: predict_pb2.PredictRequest) -> predict_pb2.PredictResponse:
        """Run the requested signature on the request's inputs, as TF-Serving's Predict does."""
        signature_name = request.model_spec.signature_name or DEFAULT_SIGNATURE
        signature = self.signature(signature_name)
        feeds = self._inputs(request, signature)
        aliases = self._output_aliases(request, signature)
        try:
            results = self.loaded.signatures[signature_name](**feeds)
        except tf.errors.OpError as exc:
            raise ServingError(grpc.StatusCode(_status_of(exc.error_code)), exc.message) from exc
        except (TypeError, ValueError) as exc:
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        response = predict_pb2.PredictResponse(model_spec=self.spec(signature_name))
        for alias in aliases:
            response.outputs[alias].CopyFrom(tf.make_tensor_proto(results[alias].numpy()))
        return response

    def metadata(self) -> get_model_metadata_pb2.GetModelMetadataResponse:
        """GetModelMetadata's answer: the signature_def map."""
        signatures = get_model_metadata_pb2.SignatureDefMap()
        for key, value in self.signature_defs.items():
            signatures.signature_def[key].CopyFrom(value)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = self.name
        response.model_spec.version.value = self.version
        response.metadata[SIGNATURE_DEF].Pack(signatures)
        return response

    def check_classify(self, signature_name: str) -> None:
        """TF-Serving's checks of a Classify signature (`PreProcessClassification`, without the
        method-name check, off by default); INVALID_ARGUMENT where one fails."""
        signature = self._named(signature_name)
        if len(signature.inputs) != 1:
            raise _invalid("Expected one input Tensor.")
        if len(signature.outputs) not in (1, 2):
            raise _invalid(f"Expected one or two output Tensors, found {len(signature.outputs)}")
        if CLASSIFY_INPUTS not in signature.inputs:
            raise _invalid(f"No classification inputs found in SignatureDef: {_text(signature)}")
        if CLASSIFY_CLASSES not in signature.outputs and CLASSIFY_SCORES not in signature.outputs:
            raise _invalid(
                "Expected classification signature outputs to contain at least one of "
                f'"{CLASSIFY_CLASSES}" or "{CLASSIFY_SCORES}". Signature was: {_text(signature)}'
            )

    def check_regress(self, signature_name: str) -> None:
        """TF-Serving's checks of a Regress signature (`PreProcessRegression`)."""
        signature = self._named(signature_name)
        if len(signature.inputs) != 1:
            raise _invalid("Expected one input Tensor.")
        if len(signature.outputs) != 1:
            raise _invalid("Expected one output Tensor.")
        if REGRESS_INPUTS not in signature.inputs:
            raise _invalid(f"No regression inputs found in SignatureDef: {_text(signature)}")
        if REGRESS_OUTPUTS not in signature.outputs:
            raise _invalid(f"No regression outputs found in SignatureDef: {_text(signature)}")

    def _named(self, signature_name: str) -> meta_graph_pb2.SignatureDef:
        name = signature_name or DEFAULT_SIGNATURE
        if name not in self.signature_defs:
            raise _invalid(f"No signature was found with the name: {name}")
        return self.signature_defs[name]

    def spec(self, signature_name: str = "") -> model_pb2.ModelSpec:
        spec = model_pb2.ModelSpec(name=self.name, signature_name=signature_name)
        spec.version.value = self.version
        return spec

    def _inputs(
        self, request: predict_pb2.PredictRequest, signature: meta_graph_pb2.SignatureDef
    ) -> dict[str, Any]:
        sent, expected = set(request.inputs), set(signature.inputs)
        if len(sent) != len(expected):
            raise ServingError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input size does not match signature: {len(sent)}!={len(expected)} "
                f"len({{{_join(sent)}}}) != len({{{_join(expected)}}}). "
                f"Sent extra: {{{_join(sent - expected)}}}. "
                f"Missing but required: {{{_join(expected - sent)}}}.",
            )
        feeds = {}
        for alias in sorted(sent):
            if alias not in expected:
                raise ServingError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"input tensor alias not found in signature: {alias}. "
                    f"Inputs expected to be in the set {{{_join(expected)}}}.",
                )
            proto = request.inputs[alias]
            try:
                value = tf.make_ndarray(proto)
            except (TypeError, ValueError) as exc:
                raise ServingError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"tensor parsing error: {alias}"
                ) from exc
            want = signature.inputs[alias]
            if proto.dtype != want.dtype:
                raise ServingError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"Expects arg[{sorted(expected).index(alias)}] to be "
                    f"{dtype_name(want.dtype)} but {dtype_name(proto.dtype)} is provided",
                )
            _check_shape(alias, value, want)
            feeds[alias] = tf.constant(value, dtype=tf.dtypes.as_dtype(want.dtype))
        return feeds

    @staticmethod
    def _output_aliases(
        request: predict_pb2.PredictRequest, signature: meta_graph_pb2.SignatureDef
    ) -> list[str]:
        for alias in request.output_filter:
            if alias not in signature.outputs:
                raise ServingError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"output tensor alias not found in signature: {alias} Outputs expected to "
                    f"be in the set {{{_join(signature.outputs)}}}.",
                )
        return sorted(request.output_filter or signature.outputs)


def _check_shape(alias: str, value: np.ndarray, want: meta_graph_pb2.TensorInfo) -> None:
    """INVALID_ARGUMENT when `value`'s shape cannot feed the signature's input `alias`."""
    if want.tensor_shape.unknown_rank:
        return
    dims = [d.size for d in want.tensor_shape.dim]
    fits = len(dims) == value.ndim and all(
        d < 0 or d == n for d, n in zip(dims, value.shape, strict=True)
    )
    if not fits:
        raise ServingError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input {alias} has shape {list(value.shape)}, which the signature's shape "
            f"{['?' if d < 0 else d for d in dims]} does not accept",
        )


def _invalid(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _text(message: Any) -> str:
    """A proto as C++'s `DebugString()` writes it (text format)."""
    return str(text_format.MessageToString(message))


def _status_of(error_code: int) -> Any:
    """The `grpc.StatusCode` value tuple of a TensorFlow error code (the same numbering)."""
    return next(c.value for c in grpc.StatusCode if c.value[0] == error_code)


class ModelBase:
    """Every model version under a model base path, looked up as TF-Serving looks them up."""

    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self.models: dict[str, dict[int, Servable]] = {
            name: {v: Servable.load(name, v, self.base / name / str(v)) for v in versions}
            for name, versions in model_versions(self.base).items()
        }

    def resolve(self, spec: model_pb2.ModelSpec) -> Servable:
        """The servable a request's `model_spec` names; NOT_FOUND as TF-Serving words it."""
        if spec.WhichOneof("version_choice") == "version_label":
            raise ServingError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Unrecognized servable version label: {spec.version_label}",
            )
        versions = self.models.get(spec.name, {})
        if spec.HasField("version"):
            servable = versions.get(spec.version.value)
            wanted = f"Specific({spec.name}, {spec.version.value})"
        else:
            servable = versions[max(versions)] if versions else None
            wanted = f"Latest({spec.name})"
        if servable is None:
            raise ServingError(
                grpc.StatusCode.NOT_FOUND, f"Servable not found for request: {wanted}"
            )
        return servable

    def versions(self, spec: model_pb2.ModelSpec) -> list[Servable]:
        """The versions GetModelStatus reports for `spec` (one if it names a version)."""
        if not spec.name:
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "Missing model name in request.")
        if spec.WhichOneof("version_choice") == "version_label":
            raise _invalid(f"Unrecognized servable version label: {spec.version_label}")
        versions = self.models.get(spec.name)
        if not versions:
            raise ServingError(
                grpc.StatusCode.NOT_FOUND, f"Could not find any versions of model {spec.name}"
            )
        if not spec.HasField("version"):
            return [versions[v] for v in sorted(versions)]
        if spec.version.value not in versions:
            raise ServingError(
                grpc.StatusCode.NOT_FOUND,
                f"Could not find version {spec.version.value} of model {spec.name}",
            )
        return [versions[spec.version.value]]

    def status(self, spec: model_pb2.ModelSpec) -> get_model_status_pb2.GetModelStatusResponse:
        """GetModelStatus's answer: every version `spec` names, AVAILABLE."""
        response = get_model_status_pb2.GetModelStatusResponse()
        for servable in self.versions(spec):
            status = response.model_version_status.add(version=servable.version)
            status.state = get_model_status_pb2.ModelVersionStatus.AVAILABLE
            status.status.error_message = ""
        return response

    def metadata(
        self, request: get_model_metadata_pb2.GetModelMetadataRequest
    ) -> get_model_metadata_pb2.GetModelMetadataResponse:
        """GetModelMetadata's answer (only `signature_def` is a metadata field)."""
        if not request.model_spec.name:
            raise _invalid("Missing model name in request.")
        if not request.metadata_field:
            raise _invalid("GetModelMetadataRequest must specify at least one metadata_field")
        for name in request.metadata_field:
            if name != SIGNATURE_DEF:
                raise _invalid(f"Metadata field {name} is not supported")
        return self.resolve(request.model_spec).metadata()
