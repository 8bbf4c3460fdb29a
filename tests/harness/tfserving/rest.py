"""The stand-in's REST API: TF-Serving's HTTP/JSON endpoints, on their own port.

As the binary's `--rest_api_port` serves them (`http_rest_api_handler.cc`, `http_server.cc`):

- `POST /v1/models/{name}[/versions/{v}|/labels/{l}]:predict`: row (`instances`) or columnar
  (`inputs`) JSON (`json_tensor`), run by the same `Servable.predict` as gRPC's Predict, so the
  numbers are the same; answered as `predictions` or `outputs`.
- `...:classify`, `...:regress`: the body's examples are read, then the signature is checked as
  TF-Serving checks it; the Keras models have no such signature, so they answer 400 as it does.
- `GET /v1/models/{name}[/versions/{v}|/labels/{l}]`: GetModelStatus as JSON;
  `.../metadata`: GetModelMetadata (`signature_def`) as JSON.
- errors: `{ "error": "<message>" }` with TF-Serving's HTTP status for the gRPC code; a path
  under `/v1/` that names no API is `Malformed request` (400); any other path is 404.

The HTTP/1.1 server is aiohttp's (keep-alive, pipelining, chunked bodies, `Expect:
100-continue`), in a thread of its own; TensorFlow runs in a thread pool beside it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

import grpc
import numpy as np
import tensorflow as tf
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
from tensorflow_serving.apis import get_model_metadata_pb2, model_pb2, predict_pb2

from tests.harness.tfserving import json_tensor
from tests.harness.tfserving.model_base import (
    DEFAULT_SIGNATURE,
    SIGNATURE_DEF,
    ModelBase,
    ServingError,
)

log = logging.getLogger("tests.harness.tfserving")

API_PATH = re.compile(r"/v1/.*", re.IGNORECASE)
_VERSION_OR_LABEL = r"(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
PREDICTION_API = re.compile(
    rf"/v1/models/([^/:]+){_VERSION_OR_LABEL}:(classify|regress|predict)", re.IGNORECASE
)
MODEL_STATUS_API = re.compile(
    rf"/v1/models(?:/([^/:]+))?{_VERSION_OR_LABEL}(?:/(metadata))?", re.IGNORECASE
)
MAX_BODY = 1 << 31  # TF-Serving sets no limit of its own
# http_server.cc's ToHTTPStatusCode
HTTP_STATUS = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500, grpc.StatusCode.UNAUTHENTICATED: 401,
}  # fmt: skip


def error_json(message: str) -> str:
    """TF-Serving's error body."""
    return '{ "error": ' + json.dumps(message) + " }"


def proto_json(message: Message, field_names: bool = False) -> str:
    """A proto as TF-Serving's `MessageToJsonString` (whitespace, primitive fields printed)."""
    text: str = json_format.MessageToJson(
        message, preserving_proto_field_name=field_names, indent=1,
        always_print_fields_with_no_presence=True,
    )  # fmt: skip
    return text


class RestApi:
    """TF-Serving's REST handler over a `ModelBase`: (verb, path, body) -> (status, JSON)."""

    def __init__(self, models: ModelBase) -> None:
        self.models = models

    def handle(self, verb: str, path: str, body: bytes) -> tuple[int, str]:
        """The HTTP status and JSON body TF-Serving answers (path: percent-encoded, no query)."""
        try:
            return 200, self._dispatch(verb, path, body)
        except _Unparsed:  # ParseModelInfo's errors leave the body empty
            return 400, ""
        except ServingError as error:
            return HTTP_STATUS.get(error.code, 500), error_json(error.message)
        except Exception as exc:  # a fault of the stand-in's own: said, not a dropped connection
            log.exception("REST %s %s failed", verb, path)
            return 500, error_json(f"{type(exc).__name__}: {exc}")

    def _dispatch(self, verb: str, path: str, body: bytes) -> str:
        malformed = json_tensor.invalid(f"Malformed request: {verb} {path}")
        if verb == "POST" and (m := PREDICTION_API.fullmatch(path)):
            spec = _spec(m.group(1), m.group(2), m.group(3))
            method = m.group(4)
            if method == "predict":
                return self.predict(spec, body)
            if method in ("classify", "regress"):
                self.classify_or_regress(method, spec, body)
        elif verb == "GET" and (m := MODEL_STATUS_API.fullmatch(path)):
            spec = _spec(m.group(1) or "", m.group(2), m.group(3))
            if not spec.name:
                raise json_tensor.invalid("Missing model name in request.")
            if m.group(4) == "metadata":
                request = get_model_metadata_pb2.GetModelMetadataRequest(
                    model_spec=spec, metadata_field=[SIGNATURE_DEF]
                )
                return _metadata_json(self.models.metadata(request))
            return proto_json(self.models.status(spec))
        raise malformed

    def predict(self, spec: model_pb2.ModelSpec, body: bytes) -> str:
        request = predict_pb2.PredictRequest(model_spec=spec)
        doc = json_tensor.parse_json(body)
        request.model_spec.signature_name = json_tensor.signature_name(doc)
        servable = self.models.resolve(request.model_spec)
        name = request.model_spec.signature_name or DEFAULT_SIGNATURE
        if name not in servable.signature_defs:
            raise json_tensor.invalid(
                f'Serving signature name: "{name}" not found in signature def'
            )
        found = json_tensor.fill_predict_request(doc, servable.signature_defs[name].inputs, request)
        return json_tensor.predict_json(numpy_outputs(servable.predict(request)), found)

    def classify_or_regress(self, method: str, spec: model_pb2.ModelSpec, body: bytes) -> None:
        doc = json_tensor.parse_json(body)
        signature = json_tensor.signature_name(doc)
        json_tensor.examples(doc)
        servable = self.models.resolve(spec)
        if method == "classify":
            servable.check_classify(signature)
        else:
            servable.check_regress(signature)
        raise ServingError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{method} is not implemented by this stand-in for tensorflow_model_server",
        )


class _Unparsed(Exception):
    """The path's version or name did not parse (TF-Serving answers 400 with no body)."""


def _spec(name: str, version: str | None, label: str | None) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=unquote(name))
    if version:
        number = int(version)
        if number >= 1 << 63:
            raise _Unparsed(version)
        spec.version.value = number
    if label:
        spec.version_label = unquote(label)
    return spec


def _metadata_json(response: get_model_metadata_pb2.GetModelMetadataResponse) -> str:
    """GetModelMetadata as TF-Serving's REST API writes it (proto field names)."""
    signatures = get_model_metadata_pb2.SignatureDefMap()
    response.metadata[SIGNATURE_DEF].Unpack(signatures)
    spec = proto_json(response.model_spec, field_names=True)
    defs = proto_json(signatures, field_names=True)
    return f'{{\n"model_spec":{spec},\n"metadata": {{"signature_def": {defs}}}\n}}\n'


class RestServer:
    """`RestApi` served over HTTP/1.1 by aiohttp, on its own thread and event loop."""

    def __init__(self, api: RestApi, host: str, port: int, workers: int = 4) -> None:
        self.api, self.host, self.port = api, host, port
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="rest")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rest", daemon=True)
        self.runner: web.AppRunner | None = None

    def start(self) -> int:
        """Listen and serve; the bound port."""
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        server: Any = site._server
        port: int = server.sockets[0].getsockname()[1]
        return port

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.rel_url.raw_path
        if not API_PATH.fullmatch(path):
            raise web.HTTPNotFound()
        body = await request.read()
        loop = asyncio.get_running_loop()
        status, text = await loop.run_in_executor(
            self.pool, self.api.handle, request.method, path, body
        )
        return web.Response(status=status, text=text, content_type="application/json")

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)


def numpy_outputs(response: predict_pb2.PredictResponse) -> dict[str, np.ndarray]:
    """A Predict answer's outputs as numpy arrays."""
    return {k: tf.make_ndarray(v) for k, v in response.outputs.items()}
