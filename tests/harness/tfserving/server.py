"""A stand-in for `tensorflow_model_server`, which cannot be installed here.

Serves TF-Serving's gRPC API with the protos and stubs of `tensorflow-serving-api` and real
TensorFlow behind them, for the tests and the demo:

- `tensorflow.serving.PredictionService`: `Predict` runs the requested signature (default
  `serving_default`) of a SavedModel, inputs decoded with `tf.make_ndarray` and outputs encoded
  with `tf.make_tensor_proto`; `GetModelMetadata` returns the signature_def map. `Classify`,
  `Regress` and `MultiInference` answer UNIMPLEMENTED.
- `tensorflow.serving.ModelService`: `GetModelStatus` (AVAILABLE for every loaded version);
  `HandleReloadConfigRequest` answers UNIMPLEMENTED.
- With `--rest-api-port`, TF-Serving's REST API on that port (`rest.py`): `:predict` (row and
  columnar JSON, the same numbers as gRPC's Predict), `:classify` / `:regress`, model status and
  metadata, its JSON errors and HTTP status codes.
- With `--profiler-port`, TensorFlow's profiler server (`ProfilerService`, what TensorBoard's
  "capture profile" calls) on that second port; the real binary serves it on its gRPC port.

Models come from a model base path laid out as TF-Serving's (`<base>/<name>/<version>/`);
errors are TF-Serving's codes and messages (`model_base.ServingError`).

    python -m tests.harness.tfserving.server --port 8500 --rest-api-port 8501 \
        --model-base-path /models
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from tests.harness.tfserving.model_base import ModelBase, ServingError
from tests.harness.tfserving.rest import RestApi, RestServer

log = logging.getLogger("tests.harness.tfserving")

STAND_IN = "stand-in for tensorflow_model_server (which cannot be installed here)"
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _unimplemented(context: grpc.ServicerContext, method: str) -> Any:
    context.abort(
        grpc.StatusCode.UNIMPLEMENTED,
        f"{method} is not implemented by this {STAND_IN}: it serves Predict, GetModelMetadata "
        "and GetModelStatus",
    )


def _abort(context: grpc.ServicerContext, error: ServingError) -> Any:
    context.abort(error.code, error.message)


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """`tensorflow.serving.PredictionService` over a `ModelBase`."""

    def __init__(self, models: ModelBase) -> None:
        self.models = models

    def Predict(
        self, request: predict_pb2.PredictRequest, context: grpc.ServicerContext
    ) -> predict_pb2.PredictResponse:
        try:
            return self.models.resolve(request.model_spec).predict(request)
        except ServingError as error:
            return _abort(context, error)

    def GetModelMetadata(
        self,
        request: get_model_metadata_pb2.GetModelMetadataRequest,
        context: grpc.ServicerContext,
    ) -> get_model_metadata_pb2.GetModelMetadataResponse:
        try:
            return self.models.metadata(request)
        except ServingError as error:
            return _abort(context, error)

    def Classify(
        self, request: classification_pb2.ClassificationRequest, context: grpc.ServicerContext
    ) -> classification_pb2.ClassificationResponse:
        try:
            servable = self.models.resolve(request.model_spec)
            servable.check_classify(request.model_spec.signature_name)
        except ServingError as error:
            return _abort(context, error)
        return _unimplemented(context, "Classify")

    def Regress(
        self, request: regression_pb2.RegressionRequest, context: grpc.ServicerContext
    ) -> regression_pb2.RegressionResponse:
        try:
            servable = self.models.resolve(request.model_spec)
            servable.check_regress(request.model_spec.signature_name)
        except ServingError as error:
            return _abort(context, error)
        return _unimplemented(context, "Regress")

    def MultiInference(
        self, request: inference_pb2.MultiInferenceRequest, context: grpc.ServicerContext
    ) -> inference_pb2.MultiInferenceResponse:
        return _unimplemented(context, "MultiInference")


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    """`tensorflow.serving.ModelService`: every loaded version is AVAILABLE."""

    def __init__(self, models: ModelBase) -> None:
        self.models = models

    def GetModelStatus(
        self, request: get_model_status_pb2.GetModelStatusRequest, context: grpc.ServicerContext
    ) -> get_model_status_pb2.GetModelStatusResponse:
        try:
            return self.models.status(request.model_spec)
        except ServingError as error:
            return _abort(context, error)

    def HandleReloadConfigRequest(
        self, request: model_management_pb2.ReloadConfigRequest, context: grpc.ServicerContext
    ) -> model_management_pb2.ReloadConfigResponse:
        return _unimplemented(context, "HandleReloadConfigRequest")


def build_server(models: ModelBase, address: str, workers: int = 4) -> tuple[grpc.Server, int]:
    """A started gRPC server with both services on `address`; returns it and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(workers), options=UNLIMITED)
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(models), server
    )
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(models), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, port


def start_profiler(port: int) -> None:
    """TensorFlow's profiler server (`ProfilerService`) on `port`, for remote captures."""
    import tensorflow as tf

    tf.profiler.experimental.server.start(port)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.tfserving.server",
        description=f"A {STAND_IN}: TF-Serving's PredictionService and ModelService over gRPC, "
        "running the SavedModels of a TF-Serving model base path with real TensorFlow. For "
        "tests and the demo only.",
    )
    parser.add_argument("--port", type=int, required=True, help="gRPC port (as the binary's)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (%(default)s)")
    parser.add_argument(
        "--model-base-path", type=Path, required=True,
        help="directory of <name>/<version>/saved_model.pb; every model in it is served",
    )  # fmt: skip
    parser.add_argument(
        "--rest-api-port", type=int, default=0,
        help="also serve TF-Serving's REST API on this port (0: off), as the binary's",
    )  # fmt: skip
    parser.add_argument(
        "--profiler-port", type=int, default=0,
        help="also serve TensorFlow's ProfilerService on this port (0: off)",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=4, help="gRPC worker threads")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    models = ModelBase(args.model_base_path)
    loaded = ", ".join(f"{name} {sorted(v)}" for name, v in models.models.items()) or "none"
    if args.profiler_port:
        start_profiler(args.profiler_port)
    rest = None
    if args.rest_api_port:  # before gRPC: a client that saw gRPC ready finds REST too
        rest = RestServer(RestApi(models), args.host, args.rest_api_port, args.workers)
        rest.start()
    server, port = build_server(models, f"{args.host}:{args.port}", args.workers)
    profiler = f", ProfilerService on port {args.profiler_port}" if args.profiler_port else ""
    rest_on = f", REST API on port {args.rest_api_port}" if rest else ""
    log.info(
        "%s: serving models %s from %s on %s:%d%s%s",
        STAND_IN, loaded, args.model_base_path, args.host, port, rest_on, profiler,
    )  # fmt: skip
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    server.stop(1).wait()
    if rest is not None:
        rest.stop()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
