"""`xsp-sidecar serve` as a child process on free local ports, for the demo, tests and benches.

Started with this Python (`python -m sidecar serve`, this checkout first on its path), ready
once its gRPC health service says SERVING, stopped with SIGTERM (then SIGKILL after 20 s); its
/metrics is scraped over HTTP. Given the backend's REST address (`http_backend`), it relays
REST calls too, on `http_address`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.metrics_text import sample_sum, scrape
from tests.harness.process import ChildProcess, StartError, free_port, with_repo_on_path


class SidecarStartError(StartError):
    """The sidecar exited during start-up or did not report SERVING in time (with its log)."""


@dataclass
class SidecarProcess(ChildProcess):
    """`xsp-sidecar serve` in front of `backend`, on free ports, logging to `log_path`.

    `args` are further `serve` flags; `http_backend` (the backend's REST `HOST:PORT`) turns
    the HTTP plane on, listening on `http_port`. The child gets this process's environment
    without its `XSP_*` variables (flags only), unless `keep_xsp_env` passes the user's
    settings through; `extra_env` is added on top. Use as a context manager or call `start()`
    / `stop()`.
    """

    NAME: ClassVar[str] = "the sidecar"
    READY: ClassVar[str] = "SERVING"
    START_ERROR: ClassVar[type[StartError]] = SidecarStartError
    STOP_TIMEOUT: ClassVar[float] = 20.0
    POLL_S: ClassVar[float] = 0.1
    NEW_SESSION: ClassVar[bool] = False

    backend: str
    log_path: Path
    args: Sequence[str] = ()
    listen_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    http_backend: str | None = None
    http_port: int = field(default_factory=free_port)
    keep_xsp_env: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """Where the relay listens (the backend's protocol)."""
        return f"127.0.0.1:{self.listen_port}"

    @property
    def http_address(self) -> str:
        """Where the HTTP plane listens (with `http_backend`): REST clients call it."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        http = []
        if self.http_backend is not None:
            http = ["--http-listen", self.http_address, "--http-backend", self.http_backend]
        return [
            sys.executable, "-m", "sidecar", "serve", "--backend", self.backend,
            "--listen", self.address, "--metrics-port", str(self.metrics_port),
            "--grpc-port", str(self.grpc_port), *http, *self.args,
        ]  # fmt: skip

    def child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if self.keep_xsp_env or not k.startswith("XSP_")}
        return with_repo_on_path({**env, **self.extra_env})

    def start(self, timeout: float = 60.0) -> SidecarProcess:
        """Start the sidecar and wait until it reports SERVING."""
        return super().start(timeout)

    def log_tail(self, lines: int = 20) -> str:
        """The last 4000 characters of its log (a whole traceback, usually)."""
        return self.log()

    @contextlib.contextmanager
    def readiness(self) -> Iterator[Callable[[], bool]]:
        """SERVING from its gRPC health service (one channel for the whole wait)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                except grpc.RpcError:
                    return False
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            yield serving

    def metrics(self) -> str:
        """One scrape of its /metrics."""
        return scrape(self.metrics_url)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples `name` whose labels include `labels` (0 when absent)."""
        return sample_sum(self.metrics(), name, **labels)

    def worker_pids(self) -> list[int]:
        """Pids of the profiling worker processes (children of the sidecar)."""
        parent = self.pid
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"multiprocessing" in cmdline:
                pids.append(int(entry.name))
        return pids
