"""Wire the data plane together: relay + `/metrics` HTTP server + health/reflection gRPC port.

`Sidecar` owns the parts; `run_sidecar(config)` runs it on uvloop until SIGTERM/SIGINT, then
shuts down gracefully: stop accepting, let in-flight calls finish for up to `grace_period`
seconds, close the remaining connections, stop the other servers.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import ssl
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server

from sidecar.config import ServeConfig
from sidecar.health import BackendChecker, HealthServer, tcp_accepts
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.relay import Endpoint, PortInUseError, Relay
from sidecar.proxy.streams import ObserverFactory

log = logging.getLogger(__name__)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """Server-side TLS context that offers HTTP/2 (ALPN h2)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    return context


@dataclass
class Sidecar:
    """The running data plane. Use `await start()` then `await shutdown()`."""

    config: ServeConfig
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    observer_factory: ObserverFactory | None = None
    health_interval: float = 1.0
    relay: Relay | None = None
    health: HealthServer | None = None
    listen: Endpoint | None = None
    metrics_port: int = 0
    grpc_port: int = 0

    async def start(self) -> None:
        config = self.config
        metrics = ProxyMetrics(self.registry, max_models=config.max_models)
        context = None
        if config.tls_cert is not None and config.tls_key is not None:
            context = tls_context(str(config.tls_cert), str(config.tls_key))
        backend = config.backend_endpoint
        self.relay = Relay(
            backend, metrics, observer_factory=self.observer_factory, ssl_context=context
        )
        self.listen = await self.relay.start(config.listen_endpoint)
        try:
            self._metrics_server, _ = start_http_server(config.metrics_port, registry=self.registry)
        except OSError as exc:
            self.relay.stop_accepting()
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    exc.errno,
                    f"cannot serve /metrics on port {config.metrics_port}: the port is already "
                    "in use (choose another with --metrics-port)",
                ) from None
            raise
        self.metrics_port = int(self._metrics_server.server_port)
        checker = BackendChecker(backend, config.backend_protocol)
        try:
            self.health = HealthServer(
                config.grpc_port,
                checker,
                interval=self.health_interval,
                on_change=lambda up: metrics.backend_up.set(1 if up else 0),
            )
        except PortInUseError:
            self.relay.stop_accepting()
            self._metrics_server.shutdown()
            raise
        self.grpc_port = self.health.port
        if not tcp_accepts(backend, 1.0):
            log.warning(
                "backend %s does not accept connections yet; clients get UNAVAILABLE until it does",
                backend,
            )
        self.health.start()
        log.info(
            "relaying %s -> %s (%s); /metrics on :%d; health on :%d",
            self.listen, backend, config.backend_protocol, self.metrics_port, self.grpc_port,
        )  # fmt: skip

    async def shutdown(self, grace_period: float | None = None) -> None:
        grace = self.config.grace_period if grace_period is None else grace_period
        if self.relay is not None:
            log.info("shutting down: waiting up to %.1f s for in-flight calls", grace)
            await self.relay.shutdown(grace)
        if self.health is not None:
            self.health.stop(0)
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


async def serve_until_signal(sidecar: Sidecar) -> None:
    """Start, wait for SIGTERM or SIGINT, shut down gracefully."""
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sidecar.shutdown()


def run_sidecar(config: ServeConfig, observer_factory: ObserverFactory | None = None) -> int:
    """Run until a signal; returns the process exit code."""
    import uvloop

    sidecar = Sidecar(config, observer_factory=observer_factory)
    try:
        uvloop.run(serve_until_signal(sidecar))
    except PortInUseError as exc:
        log.error("%s", exc.strerror)
        return 2
    return 0
