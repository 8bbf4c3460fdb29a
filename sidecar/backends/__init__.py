"""The serving backends the sidecar fronts: one module per backend (`triton`, `tfserving`), each
declaring one `Backend` record (`base`); this registry is the only list of them.

The proxy, sampling, replay, health and config read the records through the tables below,
which `register` keeps current (in place: a module that imported a table sees a backend
registered later). Adding a backend: docs/architecture.md, "Adding a backend".
"""

from __future__ import annotations

from sidecar.backends.base import Backend, Decoder, FieldPath, MethodInfo, SpanSource
from sidecar.backends.tfserving import TF_SERVING
from sidecar.backends.triton import TRITON

BACKENDS: dict[str, Backend] = {}  # --backend-protocol value -> its record, in registration order

# Read by the relay, per request: gRPC path -> its method label and model name field.
METHODS: dict[bytes, MethodInfo] = {}
# Short method name of a replayable call -> the job's method (the observer's check).
REPLAYABLE: dict[str, str] = {}
# Job method -> the decoder of its request message (the replay).
DECODERS: dict[str, Decoder] = {}
# gRPC paths whose sampled calls trigger a capture of the backend's side.
CAPTURE_PATHS: set[str] = set()


class UnknownBackendError(LookupError):
    """No backend is registered under that name."""


def _add(backend: Backend) -> None:
    BACKENDS[backend.name] = backend
    for path, field in backend.methods.items():
        per_message = path in backend.inference_streams
        METHODS[path.encode()] = MethodInfo(path.rsplit("/", 1)[-1], field, per_message)
    REPLAYABLE.update(backend.replayable)
    DECODERS.update(backend.decoders)
    if backend.capture_path is not None:
        CAPTURE_PATHS.add(backend.capture_path)


def register(backend: Backend) -> Backend:
    """Add `backend` to the registry and to every table read from it."""
    if backend.name in BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    taken = {path.decode() for path in METHODS}.intersection(backend.methods)
    taken |= set(REPLAYABLE).intersection(backend.replayable)
    taken |= set(DECODERS).intersection(backend.decoders)
    if taken:
        raise ValueError(f"backend {backend.name!r}: {sorted(taken)} belong to another backend")
    _add(backend)
    return backend


def unregister(name: str) -> None:
    """Withdraw the backend registered as `name` (and its methods from every table)."""
    rest = [b for b in BACKENDS.values() if b.name != backend_named(name).name]
    for table in (BACKENDS, METHODS, REPLAYABLE, DECODERS, CAPTURE_PATHS):
        table.clear()
    for backend in rest:
        _add(backend)


def backend_named(name: str) -> Backend:
    """The record registered as `name` (a --backend-protocol value)."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(f"no backend {name!r} (known: {', '.join(BACKENDS)})") from None


def backend_replaying(method: str) -> Backend | None:
    """The backend whose decoders read requests of the job method `method`, if any."""
    return next((b for b in BACKENDS.values() if method in b.decoders), None)


for _backend in (TRITON, TF_SERVING):
    register(_backend)

__all__ = [
    "BACKENDS",
    "CAPTURE_PATHS",
    "DECODERS",
    "METHODS",
    "REPLAYABLE",
    "Backend",
    "FieldPath",
    "MethodInfo",
    "SpanSource",
    "UnknownBackendError",
    "backend_named",
    "backend_replaying",
    "register",
    "unregister",
]
