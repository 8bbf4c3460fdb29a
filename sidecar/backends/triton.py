"""NVIDIA Triton Inference Server, over KServe v2 gRPC (`inference.GRPCInferenceService`).

Model names: the first field of most requests (`ModelInferRequest.model_name` = 1); the
repository and trace settings requests carry it as field 2. Replayed: `ModelInfer` and
`ModelStreamInfer` (a stream's first message is a `ModelInferRequest`), decoded by
`kserve_decode`. Models: a Triton model repository (`model_repository`), configured by each
model's `config.pbtxt`. Ready: `ServerReady` answers `ready: true`. Its own spans: Triton's
OpenTelemetry trace, exported over OTLP to the sidecar's receiver (`live/triton_spans`). Its
executed batches: the statistics extension's `batch_stats` (`triton_statistics`).

The decoder and the repository lookup load their modules on first use (numpy, tritonclient
and the runners' model formats): the relay's process reads only the tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.backends.base import Backend, DecodedInputs, Readiness, Repository, SpanSource

if TYPE_CHECKING:
    import grpc

    from sidecar.backends.model_repository import ModelLocation
    from sidecar.backends.triton_statistics import ModelCounts

SERVICE = "/inference.GRPCInferenceService/"
SERVER_READY = SERVICE + "ServerReady"
CONFIG_FILE = "config.pbtxt"


def decode_model_infer(message: bytes) -> DecodedInputs:
    """A `ModelInferRequest`'s tensors."""
    from sidecar.backends.kserve_decode import decode_model_infer_request

    return DecodedInputs(dict(decode_model_infer_request(message).inputs))


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
    decoders={"ModelInfer": decode_model_infer, "ModelStreamInfer": decode_model_infer},
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
