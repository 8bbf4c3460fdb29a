"""The sidecar's own gRPC port: standard health service and server reflection.

Health is `SERVING` only while the backend accepts TCP connections *and* answers the
readiness check its record declares (`sidecar.backends`): Triton's
`inference.GRPCInferenceService/ServerReady` returning ready, or for TF-Serving (no readiness
RPC without a model name) a successful HTTP/2 connection. A
background thread re-checks every `interval` seconds and mirrors the result into
`xsp_backend_up`.

The overall status (service `""`, what a Kubernetes gRPC probe asks by default) depends on
the backend only. Parts of the sidecar that can fail without stopping the relay report under
their own service names (`extra`), e.g. `xsp.sampling`: NOT_SERVING there says that sampling is
off, while the pod stays ready.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar.backends import backend_named
from sidecar.endpoint import Endpoint, port_in_use

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def add_port(server: grpc.Server, address: str, what: str, flag: str) -> int:
    """Let `server` listen on `address`; `PortInUseError` if it cannot (gRPC does not say why,
    and the address itself was checked with the config)."""
    try:
        port = int(server.add_insecure_port(address))
    except RuntimeError:
        port = 0
    if port == 0:
        raise port_in_use(address, what, flag)
    return port


def tcp_accepts(endpoint: Endpoint, timeout: float) -> bool:
    """True if a connection to the endpoint can be opened now."""
    try:
        if endpoint.unix_path:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(endpoint.unix_path)
        else:
            with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout):
                pass
        return True
    except OSError:
        return False


class BackendChecker:
    """Readiness check of the backend over a reusable gRPC channel."""

    def __init__(self, endpoint: Endpoint, protocol: str = "triton", timeout: float = 1.0) -> None:
        self.endpoint = endpoint
        self.protocol = protocol
        self.readiness = backend_named(protocol).readiness
        self.timeout = timeout
        self._channel: grpc.Channel | None = None

    def _get_channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(
                self.endpoint.grpc_target, options=_CHANNEL_OPTIONS
            )
        return self._channel

    def check(self) -> bool:
        if not tcp_accepts(self.endpoint, self.timeout):
            self.close()
            return False
        try:
            channel = self._get_channel()
            if self.readiness.rpc is None:
                grpc.channel_ready_future(channel).result(timeout=self.timeout)
                return True
            call = channel.unary_unary(
                self.readiness.rpc, request_serializer=None, response_deserializer=None
            )
            response = call(b"", timeout=self.timeout, wait_for_ready=True)
            return bool(response == self.readiness.ready_response)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            log.debug("backend readiness check failed: %s", exc)
            self.close()  # a fresh channel next time: no reconnect back-off in the way
            return False

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class HealthServer:
    """grpcio server with health + reflection, and the thread that keeps health current."""

    def __init__(
        self,
        port: int,
        checker: BackendChecker,
        *,
        host: str = "0.0.0.0",
        interval: float = 1.0,
        on_change: Callable[[bool], None] | None = None,
        extra: dict[str, Callable[[], bool]] | None = None,
    ) -> None:
        self.checker = checker
        self.interval = interval
        self.on_change = on_change
        self.extra = dict(extra or {})
        self._extra_status: dict[str, bool] = {}
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        names = (
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        self.port = add_port(self.server, f"{host}:{port}", "health checks", "--grpc-port")
        self.serving: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="xsp-health", daemon=True)
        self._set(False)
        self._check_extra()

    def _set(self, serving: bool) -> None:
        if serving == self.serving:
            return
        self.serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.servicer.set("", status)
        log.info("backend %s: %s", self.checker.endpoint, "ready" if serving else "NOT ready")
        if self.on_change is not None:
            self.on_change(serving)

    def check_now(self) -> bool:
        serving = self.checker.check()
        self._set(serving)
        self._check_extra()
        return serving

    def _check_extra(self) -> None:
        for name, check in self.extra.items():
            try:
                serving = bool(check())
            except Exception:
                log.exception("health check of %s failed unexpectedly", name)
                serving = False
            if self._extra_status.get(name) is serving:
                continue
            self._extra_status[name] = serving
            self.servicer.set(
                name,
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            log.info("health of %s: %s", name, "SERVING" if serving else "NOT_SERVING")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_now()
            except Exception:
                log.exception("health check failed unexpectedly")
                self._set(False)
            self._stop.wait(self.interval)

    def start(self) -> None:
        self.server.start()
        self._thread.start()

    def stop(self, grace: float | None = None) -> None:
        self._stop.set()
        self.server.stop(grace)
        self._thread.join(timeout=5)
        self.checker.close()
