"""Run the relay / the whole sidecar in-process on uvloop in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc
import uvloop
from prometheus_client import CollectorRegistry

from sidecar.config import ServeConfig
from sidecar.endpoint import Endpoint
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.relay import Relay
from sidecar.proxy.streams import ObserverFactory
from sidecar.serve import Sidecar

T = TypeVar("T")
TRITON_SERVICE = "inference.GRPCInferenceService"


class LoopThread:
    """A uvloop event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RelayThread(LoopThread):
    """Just the relay, on 127.0.0.1:0."""

    def __init__(
        self,
        backend: Endpoint,
        *,
        observer_factory: ObserverFactory | None = None,
        ssl_context: Any = None,
        registry: CollectorRegistry | None = None,
        **relay_args: Any,
    ) -> None:
        super().__init__()
        self.registry = registry or CollectorRegistry()
        self.relay = Relay(
            backend, ProxyMetrics(self.registry), observer_factory=observer_factory,
            ssl_context=ssl_context, **relay_args,
        )  # fmt: skip
        self.endpoint = self.run(self.relay.start(Endpoint("127.0.0.1", 0)))
        self.address = f"127.0.0.1:{self.endpoint.port}"

    def close(self, grace: float = 0.0) -> None:
        self.run(self.relay.shutdown(grace))
        self.stop()


class SidecarThread(LoopThread):
    """The whole data plane (relay + /metrics + health) on free ports."""

    def __init__(self, backend: str, health_interval: float = 0.2, **config: Any) -> None:
        super().__init__()
        cfg = ServeConfig(
            backend=backend, listen="127.0.0.1:0", metrics_port=0, grpc_port=0, **config
        )
        self.sidecar = Sidecar(cfg, health_interval=health_interval)
        self.run(self.sidecar.start())
        assert self.sidecar.listen is not None
        self.address = f"127.0.0.1:{self.sidecar.listen.port}"
        self.metrics_url = f"http://127.0.0.1:{self.sidecar.metrics_port}/metrics"
        self.grpc_address = f"127.0.0.1:{self.sidecar.grpc_port}"

    def close(self) -> None:
        self.run(self.sidecar.shutdown(0))
        self.stop()


def grpc_backend(
    handlers: dict[str, grpc.RpcMethodHandler], address: str = "127.0.0.1:0", workers: int = 8
) -> tuple[grpc.Server, int]:
    """A plain grpcio server (a real gRPC backend, not Triton) with raw-bytes handlers."""
    server = grpc.server(
        futures.ThreadPoolExecutor(workers),
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(TRITON_SERVICE, handlers)]
    )
    port = server.add_insecure_port(address)
    server.start()
    return server, port


def unary(fn: Callable[[bytes, grpc.ServicerContext], bytes]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(fn)


def server_ready_handler() -> dict[str, grpc.RpcMethodHandler]:
    return {"ServerReady": unary(lambda req, ctx: b"\x08\x01")}
