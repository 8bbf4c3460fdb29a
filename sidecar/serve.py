"""Wire the sidecar together: relay + `/metrics` HTTP server + health/reflection gRPC port,
plus (with `--http-listen` and `--http-backend`) the HTTP plane's relay of REST calls, (with
`--model-repository`) the sampling pipeline and (with `--admin`) the admin API.

`Sidecar` owns the parts; `run_sidecar(config)` runs it on uvloop until SIGTERM/SIGINT, then
shuts down gracefully: stop accepting, drain every client connection with HTTP/2 GOAWAY
(`proxy/drain.py`), let in-flight calls finish for up to `grace_period` seconds, end the rest
with UNAVAILABLE, stop the other servers. The HTTP plane stops accepting and finishes its
in-flight calls within the same grace period, beside the gRPC relay.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from sidecar.backends import BACKENDS, SpanSource, backend_named
from sidecar.config import TF_PROFILER_AT_BACKEND, ConfigError, ServeConfig
from sidecar.endpoint import Endpoint, PortInUseError, translate_bind_errors
from sidecar.health import BackendChecker, HealthServer, add_port, tcp_accepts
from sidecar.proxy import native
from sidecar.proxy.http import HttpLimits, HttpRelay
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.native_paths import NativeInfo, describe, paths
from sidecar.proxy.relay import Relay
from sidecar.proxy.streams import ObserverFactory
from sidecar.replay.device import CudaProbe, driver_devices
from sidecar.replay.options import ReplayOptions
from sidecar.sampling.pipeline import SamplingConfig, SamplingPipeline, TfProfilerSettings
from sidecar.sampling.settings import SamplingSettings
from sidecar.trace.errors import TraceStoreError
from sidecar.trace.retention import RetentionPolicy

log = logging.getLogger(__name__)

# Health service name that is NOT_SERVING while sampling is off (the relay's "" stays SERVING).
SAMPLING_HEALTH_SERVICE = "xsp.sampling"


def tls_context(cert: str, key: str, alpn: str = "h2") -> ssl.SSLContext:
    """Server-side TLS context that offers one application protocol: HTTP/2 (ALPN `h2`) for
    the gRPC port, `http/1.1` for the HTTP plane."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols([alpn])
    return context


def _client_tls(config: ServeConfig, alpn: str) -> ssl.SSLContext | None:
    """The client ports' TLS context (--tls-cert, --tls-key), offering `alpn`; None: plain."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    return tls_context(str(config.tls_cert), str(config.tls_key), alpn)


@dataclass
class Sidecar:
    """The running data plane. Use `await start()` then `await shutdown()`."""

    config: ServeConfig
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    observer_factory: ObserverFactory | None = None
    http_observer_factory: ObserverFactory | None = None
    health_interval: float = 1.0
    relay: Relay | None = None
    http_relay: HttpRelay | None = None
    http_listen: Endpoint | None = None  # the HTTP plane's bound address, when it has one
    health: HealthServer | None = None
    listen: Endpoint | None = None
    metrics_port: int = 0
    grpc_port: int = 0
    sampling: SamplingPipeline | None = None
    admin_server: grpc.Server | None = None
    admin_port: int = 0

    async def start(self) -> None:
        config = self.config
        methods = backend_named(config.backend_protocol).by_path  # only its calls are known
        metrics = ProxyMetrics(self.registry, max_models=config.max_models, methods=methods)
        self.registry.register(NativeInfo())
        if config.model_repository is not None:
            self.sampling = SamplingPipeline(
                sampling_config(config),
                self.registry,
                metrics.model_label,
                record_exemplar=metrics.record_exemplar,
            )
            self.sampling.start()
            warn_if_no_replay_gpu(config.replay_device)
            if self.observer_factory is None and self.sampling.enabled:
                self.observer_factory = self.sampling.hub.observer_factory
            if self.http_observer_factory is None and self.sampling.enabled:
                self.http_observer_factory = self.sampling.hub.http_observer_factory
        elif config.admin:
            raise ConfigError("--admin needs --model-repository (profiles replay its models)")
        elif config.sample_slow != "off":
            raise ConfigError("--sample-slow needs --model-repository (profiles replay its models)")
        else:
            log.info("sampling is off: give --model-repository to profile live requests")
        context = _client_tls(config, "h2")
        backend = config.backend_endpoint
        self.relay = Relay(
            backend, metrics, observer_factory=self.observer_factory, ssl_context=context,
            idle_timeout=config.idle_timeout or None,
        )  # fmt: skip
        self.listen = await self.relay.start(config.listen_endpoint)
        try:
            if config.http_plane:
                await self._start_http_plane(config, metrics)
            with translate_bind_errors(
                f"0.0.0.0:{config.metrics_port}", "/metrics", "--metrics-port"
            ):
                self._metrics_server, _ = start_http_server(
                    config.metrics_port, registry=self.registry
                )
        except OSError:
            self._stop_accepting()
            raise
        self.metrics_port = int(self._metrics_server.server_port)
        checker = BackendChecker(backend, config.backend_protocol)
        extra = {}
        if self.sampling is not None:
            extra[SAMPLING_HEALTH_SERVICE] = self.sampling.serving
        try:
            self.health = HealthServer(
                config.grpc_port,
                checker,
                interval=self.health_interval,
                on_change=lambda up: metrics.backend_up.set(1 if up else 0),
                extra=extra,
            )
        except PortInUseError:
            self._stop_accepting()
            self._metrics_server.shutdown()
            raise
        self.grpc_port = self.health.port
        if not tcp_accepts(backend, 1.0):
            log.warning(
                "backend %s does not accept connections yet; clients get UNAVAILABLE until it does",
                backend,
            )
        self.health.start()
        if config.admin and self.sampling is not None:
            self.admin_server, self.admin_port = start_admin(config.admin_listen, self.sampling)
        log.info(
            "relaying %s -> %s (%s); /metrics on :%d; health on :%d",
            self.listen, backend, config.backend_protocol, self.metrics_port, self.grpc_port,
        )  # fmt: skip
        if self.http_relay is not None:
            log.info(
                "relaying REST calls %s -> %s (HTTP/1.1%s, %s routes; sampling %s)",
                self.http_listen, config.http_backend_endpoint,
                " over TLS" if self.http_relay.ssl_context is not None else "",
                config.backend_protocol,
                "on" if self.http_observer_factory is not None else "off",
            )  # fmt: skip
        else:
            log.info("no HTTP plane: give --http-listen and --http-backend to relay REST calls")
        # which relay paths run in C (also xsp_relay_native_info); off where not built is news
        all_on = all(paths().values())
        log.log(logging.INFO if all_on or not native.ENABLED else logging.WARNING, "%s",
                describe())  # fmt: skip

    async def _start_http_plane(self, config: ServeConfig, metrics: ProxyMetrics) -> None:
        """The HTTP plane's relay: REST calls to --http-backend, counted under the backend's
        routes, and sampled by the pipeline's HTTP observers when sampling is on."""
        backend = config.http_backend_endpoint
        context = _client_tls(config, "http/1.1")
        self.http_relay = HttpRelay(
            backend, backend_named(config.backend_protocol), metrics,
            observer_factory=self.http_observer_factory,
            limits=HttpLimits(idle_timeout_s=config.idle_timeout or None),
            ssl_context=context,
        )  # fmt: skip
        self.http_listen = await self.http_relay.start(config.http_listen_endpoint)
        if not tcp_accepts(backend, 1.0):
            log.warning(
                "HTTP backend %s does not accept connections yet; REST clients get 503 until "
                "it does",
                backend,
            )

    def _stop_accepting(self) -> None:
        """A failed start: the relays take no more connections."""
        for relay in (self.relay, self.http_relay):
            if relay is not None:
                relay.stop_accepting()

    async def shutdown(self, grace_period: float | None = None) -> None:
        grace = self.config.grace_period if grace_period is None else grace_period
        relays = [r for r in (self.relay, self.http_relay) if r is not None]
        if relays:
            log.info("shutting down: waiting up to %.1f s for in-flight calls", grace)
            # both planes drain at once, within the one grace period
            await asyncio.gather(*(relay.shutdown(grace) for relay in relays))
        if self.health is not None:
            self.health.stop(0)
        if self.admin_server is not None:
            self.admin_server.stop(0)
        if self.sampling is not None:
            self.sampling.stop()
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


def warn_if_no_replay_gpu(
    device: str, probe: Callable[[], CudaProbe] = driver_devices
) -> str | None:
    """One warning at start when `--replay-device cuda[:N]` names a GPU this container cannot
    see (the replays then fail one by one, each with the reason); the warning, or None.
    Asks the NVIDIA driver, which creates no CUDA context and imports no runtime."""
    if not device.startswith("cuda"):
        return None
    found = probe()
    index = int(device.split(":")[1])
    if index < found.devices:
        return None
    why = found.reason or f"it sees {found.devices} CUDA device(s)"
    message = (
        f"--replay-device {device}: {why}; every replay will fail with this reason. Give the "
        "sidecar's container the GPU (Helm: sidecar.gpu.enabled) or use --replay-device auto"
    )
    log.warning("%s", message)
    return message


def sampling_config(config: ServeConfig) -> SamplingConfig:
    """The sampling pipeline's part of the serve config (sampling needs --model-repository)."""
    if config.model_repository is None:
        raise ConfigError("sampling needs --model-repository (profiles replay its models)")
    settings = SamplingSettings(
        rate=config.sample_rate,
        budget_per_minute=config.sample_budget,
        force_header=config.sample_force_header or None,
        duty_cycle=config.duty_cycle,
        slow=config.sample_slow,
    )
    retention = RetentionPolicy(
        max_traces=config.retention_max_traces or None,
        max_bytes=int(config.retention_max_mb * 1024 * 1024) or None,
        max_age_s=config.retention_max_age_hours * 3600 or None,
    )
    replay_options = ReplayOptions(
        model_repository=config.model_repository,
        db_path=config.db,
        levels=config.levels,
        iterations=config.iterations,
        warmup=config.warmup,
        store_raw_inputs=config.store_raw_inputs,
        device=config.replay_device,
        python_models=config.replay_python_models == "on",
        backend_protocol=config.backend_protocol,
    )
    tf_profiler = None
    if config.tf_profiler_address:
        if backend_named(config.backend_protocol).spans is not SpanSource.PROFILER_CAPTURE:
            capturing = [b.name for b in BACKENDS.values() if b.capture_path is not None]
            raise ConfigError(
                f"--tf-profiler-address needs --backend-protocol {' or '.join(capturing)}"
            )
        address = config.tf_profiler_address
        tf_profiler = TfProfilerSettings(
            address=config.backend if address == TF_PROFILER_AT_BACKEND else address,
            capture_ms=config.tf_profiler_capture_ms,
            repository_root=config.tf_profiler_dir,
        )
    return SamplingConfig(
        settings=settings,
        replay_options=replay_options,
        otlp_host=config.otlp_host,
        otlp_port=config.otlp_port or None,
        queue_size=config.queue_size,
        profile_timeout_s=config.profile_timeout,
        retention=retention,
        tf_profiler=tf_profiler,
        otlp_export=config.otlp_export,
        otlp_export_protocol=config.otlp_export_protocol,
        backend_target=config.backend_endpoint.grpc_target,
        backend_protocol=config.backend_protocol,
    )


def start_admin(listen: str, sampling: SamplingPipeline) -> tuple[grpc.Server, int]:
    """The `xsp.v1.Profiler` admin API on its own (by default localhost-only) port."""
    from sidecar.admin.service import ProfilerService, add_to_server

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service = ProfilerService(
        sampling.sampler,
        sampling.submit,
        sampling.config.db_path,
        sampling.last_requests,
        model_repository=sampling.config.model_repository,
        disabled_reason=sampling.disabled_reason,
        replayability=sampling.replayability,
    )
    name = add_to_server(service, server)
    reflection.enable_server_reflection((name, reflection.SERVICE_NAME), server)
    port = add_port(server, listen, "the admin API", "--admin-listen")
    server.start()
    log.info("admin API (xsp.v1.Profiler) on %s", listen)
    return server, port


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
    except (ConfigError, TraceStoreError) as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:  # e.g. the OTLP port is taken
        log.error("cannot start: %s", exc)
        return 2
    finally:
        if sidecar.sampling is not None and sidecar.relay is None:
            sidecar.sampling.stop()
    return 0
