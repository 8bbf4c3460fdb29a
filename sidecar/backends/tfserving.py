"""TensorFlow Serving, over its gRPC API (`tensorflow.serving.PredictionService`, `ModelService`)
and its REST API (`HTTP_ROUTES`; each route labelled as the gRPC method of the same call).

Model names: every request starts with `ModelSpec model_spec = 1` (its `name` = 1);
`MultiInference` names the model of its first task. Replayed: `Predict`, decoded by
`tf_decode` (TensorFlow loads on first use, in the profiling worker), and the REST `Predict`
(`POST /v1/models/{name}[/versions/{v}|/labels/{l}]:predict`, row or columnar JSON), as job
method `HttpPredict`, decoded by `tf_rest_decode`. Models: a model base
path, `<base>/<model>/<version>/saved_model.pb`, no per-model configuration; the version
folder itself is the SavedModel. Ready: no readiness call without a model name, so a gRPC
connection that opens is enough. Its own spans: a capture by TensorFlow's `ProfilerService`
for each sampled `Predict` of either protocol (`live/tf_profiler`, needs
--tf-profiler-address): the capture fires on the method label of `capture_path`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.backends.base import (
    Backend,
    DecodedInputs,
    HttpRoute,
    Readiness,
    Repository,
    SpanSource,
)
from sidecar.trace import schema

if TYPE_CHECKING:
    from sidecar.backends.model_repository import ModelLocation

PREDICTION_SERVICE = "/tensorflow.serving.PredictionService/"
MODEL_SERVICE = "/tensorflow.serving.ModelService/"
PREDICT_PATH = PREDICTION_SERVICE + "Predict"
HTTP_PREDICT = "HttpPredict"  # the job method of a sampled REST Predict

# TF-Serving's REST routes (`http_rest_api_handler.cc`: its regular expressions ignore case,
# but the handler then compares the verb as written: `:PREDICT` is a malformed request; a
# model name holds neither `/` nor `:`)
_MODEL = r"(?i:/v1/models/)(?P<model>[^/:]+)(?i:/versions/[0-9]+|/labels/[^/:]+)?"
HTTP_ROUTES = (
    HttpRoute("POST", _MODEL + ":predict", "Predict"),
    HttpRoute("POST", _MODEL + ":classify", "Classify"),
    HttpRoute("POST", _MODEL + ":regress", "Regress"),
    HttpRoute("GET", _MODEL, "GetModelStatus"),
    HttpRoute("GET", _MODEL + "(?i:/metadata)", "GetModelMetadata"),
)


def decode_predict(message: bytes) -> DecodedInputs:
    """A `PredictRequest`'s tensors, the version it asks for, its signature (and label)."""
    from sidecar.backends.tf_decode import decode_predict_request

    request = decode_predict_request(message)
    attributes = {schema.SIGNATURE_NAME: request.signature_name}
    if request.version_label:
        attributes[schema.VERSION_LABEL] = request.version_label
    return DecodedInputs(request.inputs, request.model_version, attributes)


def decode_http_predict(message: bytes) -> DecodedInputs:
    """A REST Predict's tensors (`http_message.pack`ed: its JSON body and target), the version
    or label its path names, its signature."""
    from sidecar.backends.tf_rest_decode import decode_rest_predict

    return decode_rest_predict(message)


def has_model(root: Path, model: str) -> bool:
    from sidecar.backends.model_repository import model_in_repository

    return model_in_repository(root, model)


def find_model(root: Path, model: str, version: str | int | None = None) -> ModelLocation:
    """The lookup Triton's repository uses too: without a `config.pbtxt`, a version folder
    holding `saved_model.pb` is the SavedModel."""
    from sidecar.backends import model_repository

    return model_repository.find_model(root, model, version)


TF_SERVING = Backend(
    name="tfserving",
    methods={
        PREDICT_PATH: (1, 1),
        PREDICTION_SERVICE + "Classify": (1, 1),
        PREDICTION_SERVICE + "Regress": (1, 1),
        PREDICTION_SERVICE + "GetModelMetadata": (1, 1),
        PREDICTION_SERVICE + "MultiInference": (1, 1, 1),  # tasks[0].model_spec.name
        MODEL_SERVICE + "GetModelStatus": (1, 1),
        MODEL_SERVICE + "HandleReloadConfigRequest": None,
    },
    replayable={"Predict": "Predict"},
    decoders={"Predict": decode_predict, HTTP_PREDICT: decode_http_predict},
    http_routes=HTTP_ROUTES,
    http_replayable={"Predict": HTTP_PREDICT},
    repository=Repository(
        layout="<base>/<model>/<version>/saved_model.pb (the version folder is the SavedModel)",
        contains=has_model,
        find=find_model,
    ),
    readiness=Readiness(rpc=None),  # a connection that opens
    spans=SpanSource.PROFILER_CAPTURE,
    capture_path=PREDICT_PATH,
)
