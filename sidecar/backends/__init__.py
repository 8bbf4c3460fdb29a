"""The serving backends the sidecar fronts: one module per backend (`triton`, `tfserving`), each
declaring one `Backend` record (`base`); this registry is the only list of them.

A sidecar serves one backend, the one `--backend-protocol` names: `serve` looks its record up
here (`backend_named`) and hands that record to the relay (its method table, `by_path`), the
sampling hook (its replayable methods), the replay (`ReplayOptions.backend_protocol`: its
decoders and model lookup), health and the capture path. No table merges the backends: a
sidecar started for one does not recognize, sample or replay another's methods. Adding a
backend: docs/architecture.md, "Adding a backend".
"""

from __future__ import annotations

from sidecar.backends.base import (
    UNKNOWN_METHOD,
    Backend,
    Decoder,
    FieldPath,
    HttpCall,
    HttpRoute,
    MethodInfo,
    SpanSource,
)
from sidecar.backends.tfserving import TF_SERVING
from sidecar.backends.triton import TRITON

BACKENDS: dict[str, Backend] = {}  # --backend-protocol value -> its record, in registration order


class UnknownBackendError(LookupError):
    """No backend is registered under that name."""


def register(backend: Backend) -> Backend:
    """Add `backend` to the registry (the names `--backend-protocol` offers)."""
    if backend.name in BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Withdraw the backend registered as `name`."""
    del BACKENDS[backend_named(name).name]


def backend_named(name: str) -> Backend:
    """The record registered as `name` (a --backend-protocol value)."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(f"no backend {name!r} (known: {', '.join(BACKENDS)})") from None


for _backend in (TRITON, TF_SERVING):
    register(_backend)

__all__ = [
    "BACKENDS",
    "TF_SERVING",
    "TRITON",
    "UNKNOWN_METHOD",
    "Backend",
    "Decoder",
    "FieldPath",
    "HttpCall",
    "HttpRoute",
    "MethodInfo",
    "SpanSource",
    "UnknownBackendError",
    "backend_named",
    "register",
    "unregister",
]
