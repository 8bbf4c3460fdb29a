#!/usr/bin/env python3
"""Ask the sidecar's gRPC health service how it is; the exit code is the answer.

Used by the image's HEALTHCHECK and the chart's liveness probe (installed in the image as
`xsp-healthcheck`).

- default: exit 0 only when the service reports SERVING (the backend is ready behind the relay);
- `--live`: exit 0 when the health service answers at all, whatever the status, so a backend
  that is still loading models does not get the sidecar restarted.

Exit 1 otherwise, with the reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_PORT = 8013  # docs/contracts.md: --grpc-port / XSP_GRPC_PORT


def _default_port() -> int:
    value = os.environ.get("XSP_GRPC_PORT", "")
    return int(value) if value.isdigit() else DEFAULT_PORT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xsp-healthcheck", description="Check the xsp-sidecar gRPC health service."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of the sidecar")
    parser.add_argument(
        "--port",
        type=int,
        default=_default_port(),
        help="the sidecar's --grpc-port (default: $XSP_GRPC_PORT or 8013)",
    )
    parser.add_argument("--service", default="", help="health service name (default: overall)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default: 3)")
    parser.add_argument(
        "--live", action="store_true", help="healthy when the service answers, whatever its status"
    )
    return parser


def check(
    host: str, port: int, *, service: str = "", timeout: float = 3.0, live: bool = False
) -> str | None:
    """None when healthy, otherwise why not."""
    target = f"{host}:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        if not isinstance(exc, grpc.Call):
            return f"health check on {target} failed: {exc}"
        if live and exc.code() == grpc.StatusCode.NOT_FOUND:
            return None  # the server answered; it just does not know this service name
        return f"health check on {target} failed: {exc.code().name} {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if live or reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return f"{target} reports {status}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check(
        args.host, args.port, service=args.service, timeout=args.timeout, live=args.live
    )
    if problem is None:
        return 0
    print(problem, file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
