"""Where `--otlp-export` sends stored traces: the endpoint URL and protocol, checked.

`http(s)://host:4318/v1/traces` -> OTLP/HTTP protobuf (a URL without a path gets `/v1/traces`);
`grpc://host:4317`, or any URL with protocol `grpc` -> OTLP/gRPC, plaintext unless `https://`.
Kept apart from the exporter so reading the config does not import the OpenTelemetry SDK.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

OTLP_PROTOCOLS = ("auto", "http", "grpc")  # auto: grpc:// is gRPC, anything else OTLP/HTTP


class OtlpExportError(ValueError):
    """The export endpoint cannot be used (bad URL or protocol)."""


@dataclass(frozen=True)
class OtlpTarget:
    """Where and how to export: the exporter's endpoint, its protocol, TLS or not."""

    endpoint: str  # OTLP/HTTP: the full URL; gRPC: host:port
    protocol: str  # "http" or "grpc"
    insecure: bool = True


def parse_target(url: str, protocol: str = "auto") -> OtlpTarget:
    """`http://host:4318/v1/traces`, `grpc://host:4317`, `http://host:4317` + grpc, ..."""
    if protocol not in OTLP_PROTOCOLS:
        raise OtlpExportError(f"protocol must be one of {', '.join(OTLP_PROTOCOLS)}: {protocol!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https", "grpc") or not parts.hostname:
        raise OtlpExportError(
            f"expected http://HOST:4318/v1/traces or grpc://HOST:4317, got {url!r}"
        )
    if protocol == "grpc" or (protocol == "auto" and parts.scheme == "grpc"):
        return OtlpTarget(parts.netloc, "grpc", insecure=parts.scheme != "https")
    if parts.scheme == "grpc":
        raise OtlpExportError(f"a grpc:// endpoint cannot be exported to over OTLP/HTTP: {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/v1/traces"
    return OtlpTarget(f"{parts.scheme}://{parts.netloc}{path}", "http")
