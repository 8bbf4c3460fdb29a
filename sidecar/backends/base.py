"""What a serving backend is to the sidecar: the `Backend` record each backend module declares.

A record says everything the other packages need to know of one backend: which gRPC methods
carry a model name and where (the relay's labels), which HTTP routes its REST API has and
which method label each is (the HTTP relay's labels, `http_route`), which methods of either
protocol can be replayed and how their request message is decoded (sampling, replay), how a
model is found in the backend's repository and how its configuration is read (replay, sampling,
admin), how its readiness is asked (health), where its own spans of a live request come from
(sampling, live) and how the batches it executed are counted (sampling's batch windows).

The relay's process imports every record, so a record and this module stay light: decoders
and repository lookups load numpy, tritonclient or TensorFlow when first called, in the
profiling worker (see `triton.py`, `tfserving.py`).
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import unquote_to_bytes

if TYPE_CHECKING:
    import grpc
    import numpy as np

    from sidecar.backends.model_repository import ModelLocation
    from sidecar.backends.triton_statistics import ModelCounts

FieldPath = tuple[int, ...]  # protobuf field numbers from the request down to the model name
UNKNOWN_METHOD = "_unknown"  # the method label of an HTTP request no route matches
_HTTP_CACHE_SIZE = 4096  # (verb, path) pairs whose `HttpCall` a backend keeps


@dataclass(frozen=True, slots=True)
class MethodInfo:
    """A gRPC method: its short name (the `method` label) and where its model name lives."""

    name: str
    model_field: FieldPath | None  # protobuf field path of the model name, or None
    per_message: bool = False  # a stream whose every request message is one inference


@dataclass(frozen=True, slots=True)
class HttpRoute:
    """One route of a backend's HTTP (REST) API.

    `pattern` is a regular expression `re.fullmatch`ed on the request target's path (the query
    stripped, still percent-encoded); a named group `model` holds the model name, which
    `Backend.http_route` percent-decodes. `method` is the method label: the gRPC short name of
    the same call (`ModelInfer`, `Predict`, ...), so one label covers both protocols.
    """

    verb: str  # "POST" | "GET"
    pattern: str
    method: str


class HttpCall(NamedTuple):
    """What an HTTP request is, by its route: its method label (`UNKNOWN_METHOD` where no
    route matches) and its percent-decoded model name (None where the route names none)."""

    method: str
    model: str | None


_UNKNOWN_CALL = HttpCall(UNKNOWN_METHOD, None)


class _HttpTable:
    """A backend's routes compiled once: per verb, one alternation of every route's pattern
    (each in its own group, its `model` group renamed), and a bounded cache of answers."""

    __slots__ = ("_by_verb", "_cache")

    def __init__(self, routes: tuple[HttpRoute, ...]) -> None:
        grouped: dict[bytes, list[tuple[int, HttpRoute]]] = {}
        for index, route in enumerate(routes):
            grouped.setdefault(route.verb.encode("ascii"), []).append((index, route))
        self._by_verb: dict[bytes, tuple[re.Pattern[bytes], dict[str, tuple[str, str | None]]]]
        self._by_verb = {}
        for verb, entries in grouped.items():
            parts, groups = [], {}
            for index, route in entries:
                pattern = route.pattern.replace("(?P<model>", f"(?P<m{index}>")
                parts.append(f"(?P<r{index}>{pattern})")
                has_model = f"(?P<m{index}>" in pattern
                groups[f"r{index}"] = (route.method, f"m{index}" if has_model else None)
            self._by_verb[verb] = (re.compile("|".join(parts).encode()), groups)
        self._cache: dict[tuple[bytes, bytes], HttpCall] = {}

    def route(self, verb: bytes, target: bytes) -> HttpCall:
        path = target.partition(b"?")[0]
        key = (verb, path)
        call = self._cache.get(key)
        if call is not None:
            return call
        call = self._match(verb, path)
        if len(self._cache) < _HTTP_CACHE_SIZE:
            self._cache[key] = call
        return call

    def _match(self, verb: bytes, path: bytes) -> HttpCall:
        if path[:1] != b"/":  # absolute form (`http://host/path`): the path after the host
            scheme, sep, rest = path.partition(b"://")
            if not sep or not scheme.isalpha():
                return _UNKNOWN_CALL
            path = b"/" + rest.partition(b"/")[2]
        table = self._by_verb.get(verb)
        if table is None:
            return _UNKNOWN_CALL
        pattern, groups = table
        match = pattern.fullmatch(path)
        if match is None or match.lastgroup is None:
            return _UNKNOWN_CALL
        method, model_group = groups[match.lastgroup]
        raw = match.group(model_group) if model_group is not None else None
        if raw is None:  # the route names no model (or an optional one not given)
            return HttpCall(method, None)
        return HttpCall(method, unquote_to_bytes(raw).decode("utf-8", "replace"))


@dataclass(frozen=True)
class DecodedInputs:
    """A sampled request's tensors, whatever protocol carried them."""

    inputs: dict[str, np.ndarray]
    version: str = ""  # the model version the request asks for ("": as the job says)
    attributes: dict[str, Any] | None = None  # protocol details for the trace


# a request message (no gRPC prefix; an HTTP request's `http_message.pack`) -> its tensors
Decoder = Callable[[bytes], DecodedInputs]
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
    # the routes of its HTTP (REST) API, tried in order (`http_route`)
    http_routes: tuple[HttpRoute, ...] = ()
    # method label of a replayable HTTP call -> the job's method, whose decoder (in `decoders`)
    # reads an HTTP request packed by `http_message.pack`
    http_replayable: Mapping[str, str] = field(default_factory=dict)

    @functools.cached_property
    def _http_table(self) -> _HttpTable:
        return _HttpTable(self.http_routes)

    def http_route(self, verb: bytes, target: bytes) -> HttpCall:
        """The method label and model name of an HTTP request (`verb`, its request target:
        path and query, as received). Routes are compiled once; answers are cached per verb and
        path (bounded)."""
        return self._http_table.route(verb, target)

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
        http_methods = {route.method for route in self.http_routes}
        if missing := set(self.http_replayable) - http_methods:
            raise ValueError(
                f"backend {self.name!r}: {sorted(missing)} HTTP-replayable but not routed"
            )
        if missing := set(self.http_replayable.values()) - set(self.decoders):
            raise ValueError(f"backend {self.name!r}: no decoder for {sorted(missing)}")
        for route in self.http_routes:
            try:
                compiled = re.compile(route.pattern)
            except re.error as exc:
                raise ValueError(f"backend {self.name!r}: route {route.pattern!r}: {exc}") from None
            if set(compiled.groupindex) - {"model"}:
                raise ValueError(
                    f"backend {self.name!r}: route {route.pattern!r}: the only named group is "
                    "`model`"
                )
        if (self.spans is SpanSource.PROFILER_CAPTURE) != (self.capture_path is not None):
            raise ValueError(f"backend {self.name!r}: a capture path goes with a profiler capture")
