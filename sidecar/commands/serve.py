"""`xsp-sidecar serve`: relay gRPC traffic to the backend and export metrics."""

from __future__ import annotations

import argparse
import logging
import sys

from sidecar.config import BACKEND_PROTOCOLS, ConfigError, load_serve_config

NAME = "serve"
HELP = "relay gRPC traffic to Triton / TF-Serving unchanged and export Prometheus metrics"

log = logging.getLogger(__name__)

_KEYS = (
    "backend", "listen", "metrics_port", "grpc_port", "config", "grace_period",
    "tls_cert", "tls_key", "max_models", "backend_protocol",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so that environment and TOML values can fill the gaps (flag > env >
    # file > default); the documented defaults live in sidecar.config.ServeConfig.
    add = parser.add_argument
    add(
        "--backend",
        metavar="HOST:PORT|unix:PATH",
        help="the model server's gRPC endpoint (env XSP_BACKEND, default localhost:8001)",
    )
    add(
        "--listen",
        metavar="HOST:PORT",
        help="relay address clients call (env XSP_LISTEN, default 0.0.0.0:8011)",
    )
    add(
        "--metrics-port",
        metavar="N",
        help="Prometheus /metrics HTTP port (env XSP_METRICS_PORT, default 8012)",
    )
    add(
        "--grpc-port",
        metavar="N",
        help="port of the sidecar's health + reflection gRPC services "
        "(env XSP_GRPC_PORT, default 8013)",
    )
    add(
        "--config",
        metavar="FILE",
        help="TOML file with keys named like the flags, e.g. metrics_port = 9000 (env XSP_CONFIG)",
    )
    add(
        "--grace-period",
        metavar="S",
        help="seconds in-flight calls may take to finish after SIGTERM "
        "(env XSP_GRACE_PERIOD, default 10)",
    )
    add("--tls-cert", metavar="PEM", help="terminate TLS on the client side with this certificate")
    add("--tls-key", metavar="PEM", help="private key for --tls-cert")
    add(
        "--max-models",
        metavar="N",
        help="distinct model label values tracked; the rest count as _other "
        "(env XSP_MAX_MODELS, default 100)",
    )
    add(
        "--backend-protocol",
        choices=BACKEND_PROTOCOLS,
        type=str.lower,
        help="backend kind, for the readiness check (env XSP_BACKEND_PROTOCOL, default triton)",
    )


def run(args: argparse.Namespace) -> int:
    flags = {key: getattr(args, key, None) for key in _KEYS}
    try:
        config = load_serve_config(flags)
    except ConfigError as exc:
        print(f"xsp-sidecar serve: error: {exc}", file=sys.stderr)
        return 2
    from sidecar.serve import run_sidecar

    return run_sidecar(config)
