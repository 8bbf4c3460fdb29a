"""The data plane: a transparent HTTP/2 relay that watches gRPC calls (why it is built so:
docs/architecture.md, "The data plane").

`relay.Relay` pairs each client connection with a backend connection and forwards bytes
unchanged; `frames.FrameScanner` + `streams.ConnectionTracker` observe them; `metrics`
exports what was seen; `streams.ConnectionObserver` is the hook for request sampling;
`drain` is the graceful shutdown of a connection (two-step GOAWAY, refused streams).
"""

from __future__ import annotations

from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.relay import Relay
from sidecar.proxy.streams import (
    ConnectionInfo,
    ConnectionObserver,
    HeaderDecision,
    ObserverFactory,
    QuietEnd,
    RequestStart,
    StreamEnd,
)

__all__ = [
    "ConnectionInfo",
    "ConnectionObserver",
    "HeaderDecision",
    "ObserverFactory",
    "ProxyMetrics",
    "QuietEnd",
    "Relay",
    "RequestStart",
    "StreamEnd",
]
