"""What a serving backend is to the sidecar: the `Backend` record each backend module declares.

A record says everything the other packages need to know of one backend: which gRPC methods
carry a model name and where (the relay's labels), which methods can be replayed and how
their request message is decoded (sampling, replay), how a model is found in the backend's
repository and how its configuration is read (replay, sampling, admin), how its readiness is
asked (health), where its own spans of a live request come from (sampling, live) and how the
batches it executed are counted (sampling's batch windows).

The relay's process imports every record, so a record and this module stay light: decoders
and repository lookups load numpy, tritonclient or TensorFlow when first called, in the
profiling worker (see `triton.py`, `tfserving.py`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc
    import numpy as np

    from sidecar.backends.model_repository import ModelLocation
    from sidecar.backends.triton_statistics import ModelCounts

FieldPath = tuple[int, ...]  # protobuf field numbers from the request down to the model name


@dataclass(frozen=True, slots=True)
class MethodInfo:
    """A gRPC method: its short name (the `method` label) and where its model name lives."""

    name: str
    model_field: FieldPath | None  # protobuf field path of the model name, or None
    per_message: bool = False  # a stream whose every request message is one inference


@dataclass(frozen=True)
class DecodedInputs:
    """A sampled request's tensors, whatever protocol carried them."""

    inputs: dict[str, np.ndarray]
    version: str = ""  # the model version the request asks for ("": as the job says)
    attributes: dict[str, Any] | None = None  # protocol details for the trace


Decoder = Callable[[bytes], DecodedInputs]  # a request message (no gRPC prefix) -> its tensors
# the backend's cumulative execution counters of every model, read over a gRPC channel to it
# with a timeout in seconds (`triton_statistics`); raises `grpc.RpcError` when the call fails
StatisticsReader = Callable[["grpc.Channel", float], Mapping[str, "ModelCounts"]]


class SpanSource(enum.Enum):
    """Where the backend's own spans of a sampled live request come from."""

    # the backend exports OpenTelemetry spans to the sidecar's OTLP receiver
    # (`live/otlp_receiver`, converted by `live/triton_spans`)
    OTLP = "otlp"
    # the sidecar asks the backend's profiler for a short capture per sampled request on
    # `Backend.capture_path` (`live/tf_profiler`, `live/xspace`; needs --tf-profiler-address)
    PROFILER_CAPTURE = "profiler_capture"


@dataclass(frozen=True)
class Readiness:
    """How the health port asks the backend whether it is ready.

    `rpc`: the path of a unary method called with an empty request; the backend is ready when
    it answers exactly `ready_response`. None: a gRPC connection that opens is enough (for a
    backend without a readiness call that needs no model name).
    """

    rpc: str | None = None
    ready_response: bytes = b""


@dataclass(frozen=True)
class Repository:
    """How a model is found in the backend's model repository and its configuration read.

    `contains(root, model)`: whether `model` names a model of the repository (cheap; the relay's
    process asks it per sampled request). `find(root, model, version)`: the file to replay and
    what its configuration says (`version` None: the one the backend serves).
    `read_config(path)`: the parsed configuration file `config_file` of a model folder; both
    None for a backend without per-model configuration.
    """

    layout: str  # the layout in words, for documentation and messages
    contains: Callable[[Path, str], bool]
    find: Callable[[Path, str, str | int | None], ModelLocation]
    config_file: str | None = None
    read_config: Callable[[Path], Any] | None = None


@dataclass(frozen=True)
class Backend:
    """One serving backend; see the module docstring. Registered in `sidecar.backends`; a
    sidecar reads only the record of the backend it was started for (`--backend-protocol`)."""

    name: str  # the --backend-protocol value
    # gRPC path -> where its request's model name is (None: the method names no model)
    methods: Mapping[str, FieldPath | None]
    # short method name of a replayable call -> the job's method, which picks its decoder
    replayable: Mapping[str, str]
    decoders: Mapping[str, Decoder]  # job method -> decoder of its request message
    repository: Repository
    readiness: Readiness
    spans: SpanSource
    # the gRPC path whose sampled calls trigger a capture (SpanSource.PROFILER_CAPTURE only)
    capture_path: str | None = None
    # how the batches the backend executed are counted (None: the backend does not say)
    statistics: StatisticsReader | None = None
    # gRPC paths of inference streams: each request message is one inference (`proxy/
    # inferences.py` reads them with Triton's `ModelInferRequest`/`ModelStreamInferResponse`)
    inference_streams: frozenset[str] = frozenset()

    @functools.cached_property
    def by_path(self) -> Mapping[bytes, MethodInfo]:
        """The relay's table: a request's `:path` -> its method label and model name field."""
        return {
            path.encode(): MethodInfo(
                path.rsplit("/", 1)[-1], field, per_message=path in self.inference_streams
            )
            for path, field in self.methods.items()
        }

    def __post_init__(self) -> None:
        methods = {path.rsplit("/", 1)[-1] for path in self.methods}
        if missing := set(self.replayable) - methods:
            raise ValueError(f"backend {self.name!r}: {sorted(missing)} replayable but not served")
        if missing := set(self.replayable.values()) - set(self.decoders):
            raise ValueError(f"backend {self.name!r}: no decoder for {sorted(missing)}")
        if (self.spans is SpanSource.PROFILER_CAPTURE) != (self.capture_path is not None):
            raise ValueError(f"backend {self.name!r}: a capture path goes with a profiler capture")
