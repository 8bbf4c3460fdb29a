"""NVIDIA Triton Inference Server, over KServe v2 gRPC (`inference.GRPCInferenceService`) and
its KServe v2 HTTP/REST API (`HTTP_ROUTES`; each route labelled as the gRPC method of the same
call).

Model names: the first field of most requests (`ModelInferRequest.model_name` = 1); the
repository and trace settings requests carry it as field 2. Replayed: `ModelInfer` and
`ModelStreamInfer` (a stream's first message is a `ModelInferRequest`), decoded by
`kserve_decode`, and the HTTP `ModelInfer` (`POST /v2/models/{name}[/versions/{v}]/infer`, JSON
or the binary-tensor extension), as job method `HttpModelInfer`, decoded by
`kserve_http_decode`. Models: a Triton model repository (`model_repository`), configured by each
model's `config.pbtxt`. Ready: `ServerReady` answers `ready: true`. Its own spans: Triton's
OpenTelemetry trace, exported over OTLP to the sidecar's receiver (`live/triton_spans`). Its
executed batches: the statistics extension's `batch_stats` (`triton_statistics`).

The decoder and the repository lookup load their modules on first use (numpy, tritonclient
and the runners' model formats): the relay's process reads only the tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.backends.base import (
    Backend,
    DecodedInputs,
    HttpRoute,
    Readiness,
    Repository,
    SpanSource,
)

if TYPE_CHECKING:
    import grpc

    from sidecar.backends.model_repository import ModelLocation
    from sidecar.backends.triton_statistics import ModelCounts

SERVICE = "/inference.GRPCInferenceService/"
SERVER_READY = SERVICE + "ServerReady"
CONFIG_FILE = "config.pbtxt"
HTTP_INFER = "HttpModelInfer"  # the job method of a sampled HTTP inference

_MODEL = r"/v2/models/(?P<model>[^/]+)"
_VERSIONED = _MODEL + r"(?:/versions/[0-9]+)?"
_REGION = r"(?:/region/[^/]+)?"
# KServe v2 HTTP and Triton's extensions, as Triton's HTTP server routes them (`/v2/models/stats`
# is every model's statistics, not the metadata of a model named `stats`).
HTTP_ROUTES = (
    HttpRoute("POST", _VERSIONED + "/infer", "ModelInfer"),
    HttpRoute("GET", r"/v2/models(?:/(?P<model>[^/]+)(?:/versions/[0-9]+)?)?/stats",
              "ModelStatistics"),
    HttpRoute("GET", _VERSIONED, "ModelMetadata"),
    HttpRoute("GET", _VERSIONED + "/ready", "ModelReady"),
    HttpRoute("GET", _VERSIONED + "/config", "ModelConfig"),
    HttpRoute("POST", _VERSIONED + "/generate", "ModelGenerate"),
    HttpRoute("POST", _VERSIONED + "/generate_stream", "ModelGenerateStream"),
    HttpRoute("GET", "/v2/health/live", "ServerLive"),
    HttpRoute("GET", "/v2/health/ready", "ServerReady"),
    HttpRoute("GET", "/v2", "ServerMetadata"),
    HttpRoute("POST", "/v2/repository/index", "RepositoryIndex"),
    HttpRoute("POST", r"/v2/repository/models/(?P<model>[^/]+)/load", "RepositoryModelLoad"),
    HttpRoute("POST", r"/v2/repository/models/(?P<model>[^/]+)/unload", "RepositoryModelUnload"),
    HttpRoute("GET", r"/v2(?:/models/(?P<model>[^/]+))?/trace/setting", "TraceSetting"),
    HttpRoute("POST", r"/v2(?:/models/(?P<model>[^/]+))?/trace/setting", "TraceSetting"),
    HttpRoute("GET", "/v2/logging", "LogSettings"),
    HttpRoute("POST", "/v2/logging", "LogSettings"),
    HttpRoute("GET", f"/v2/systemsharedmemory{_REGION}/status", "SystemSharedMemoryStatus"),
    HttpRoute("POST", r"/v2/systemsharedmemory/region/[^/]+/register",
              "SystemSharedMemoryRegister"),
    HttpRoute("POST", f"/v2/systemsharedmemory{_REGION}/unregister",
              "SystemSharedMemoryUnregister"),
    HttpRoute("GET", f"/v2/cudasharedmemory{_REGION}/status", "CudaSharedMemoryStatus"),
    HttpRoute("POST", r"/v2/cudasharedmemory/region/[^/]+/register", "CudaSharedMemoryRegister"),
    HttpRoute("POST", f"/v2/cudasharedmemory{_REGION}/unregister",
              "CudaSharedMemoryUnregister"),
)  # fmt: skip


def decode_model_infer(message: bytes) -> DecodedInputs:
    """A `ModelInferRequest`'s tensors."""
    from sidecar.backends.kserve_decode import decode_model_infer_request

    return DecodedInputs(dict(decode_model_infer_request(message).inputs))


def decode_http_model_infer(message: bytes) -> DecodedInputs:
    """An HTTP inference request's tensors (`http_message.pack`ed: JSON, binary tensors, its
    target), the version its path names."""
    from sidecar.backends.kserve_http_decode import decode_http_infer

    return decode_http_infer(message)


def has_model(root: Path, model: str) -> bool:
    from sidecar.backends.model_repository import model_in_repository

    return model_in_repository(root, model)


def find_model(root: Path, model: str, version: str | int | None = None) -> ModelLocation:
    from sidecar.backends import model_repository

    return model_repository.find_model(root, model, version)


def read_config(path: Path) -> Any:
    """A `config.pbtxt` as a `ModelConfig`."""
    from sidecar.backends.model_repository import read_config

    return read_config(path)


def read_statistics(channel: grpc.Channel, timeout_s: float) -> dict[str, ModelCounts]:
    """Every model's execution counters (`ModelStatistics`)."""
    from sidecar.backends import triton_statistics

    return triton_statistics.read_statistics(channel, timeout_s)


TRITON = Backend(
    name="triton",
    methods={
        SERVICE + "ModelInfer": (1,),
        SERVICE + "ModelStreamInfer": (1,),
        SERVICE + "ModelMetadata": (1,),
        SERVICE + "ModelReady": (1,),
        SERVICE + "ModelConfig": (1,),
        SERVICE + "ModelStatistics": (1,),
        SERVICE + "RepositoryModelLoad": (2,),
        SERVICE + "RepositoryModelUnload": (2,),
        SERVICE + "TraceSetting": (2,),
        SERVICE + "LogSettings": None,
        SERVICE + "ServerLive": None,
        SERVER_READY: None,
        SERVICE + "ServerMetadata": None,
        SERVICE + "RepositoryIndex": None,
        SERVICE + "SystemSharedMemoryStatus": None,
        SERVICE + "SystemSharedMemoryRegister": None,
        SERVICE + "SystemSharedMemoryUnregister": None,
        SERVICE + "CudaSharedMemoryStatus": None,
        SERVICE + "CudaSharedMemoryRegister": None,
        SERVICE + "CudaSharedMemoryUnregister": None,
    },
    inference_streams=frozenset({SERVICE + "ModelStreamInfer"}),
    replayable={"ModelInfer": "ModelInfer", "ModelStreamInfer": "ModelInfer"},
    decoders={
        "ModelInfer": decode_model_infer,
        "ModelStreamInfer": decode_model_infer,
        HTTP_INFER: decode_http_model_infer,
    },
    http_routes=HTTP_ROUTES,
    http_replayable={"ModelInfer": HTTP_INFER},
    repository=Repository(
        layout="<repo>/<model>/config.pbtxt and <repo>/<model>/<version>/model.onnx "
        "(model.pt, model.savedmodel/ or the config's default_model_filename)",
        contains=has_model,
        find=find_model,
        config_file=CONFIG_FILE,
        read_config=read_config,
    ),
    readiness=Readiness(rpc=SERVER_READY, ready_response=b"\x08\x01"),  # {ready: true}
    spans=SpanSource.OTLP,
    statistics=read_statistics,
)
