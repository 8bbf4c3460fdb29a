"""`xsp-sidecar serve` as a child process on free local ports, for the demo, tests and benches.

Started with this Python (`python -m sidecar serve`), ready once its gRPC health service says
SERVING, stopped with SIGTERM (then SIGKILL after 20 s); its /metrics is scraped over HTTP.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.localtriton.server import free_port, stop_child
from sidecar.metrics_text import sample_sum, scrape


class SidecarStartError(RuntimeError):
    """The sidecar exited during start-up or did not report SERVING in time (with its log)."""


@dataclass
class SidecarProcess:
    """`xsp-sidecar serve` in front of `backend`, on free ports, logging to `log_path`.

    `args` are further `serve` flags. The child gets this process's environment without its
    `XSP_*` variables (flags only), unless `keep_xsp_env` passes the user's settings through;
    `extra_env` is added on top. Use as a context manager or call `start()` / `stop()`.
    """

    backend: str
    log_path: Path
    args: Sequence[str] = ()
    listen_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    keep_xsp_env: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """Where the relay listens (the backend's protocol)."""
        return f"127.0.0.1:{self.listen_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the sidecar was not started")
        return self.process.pid

    def start(self, timeout: float = 60.0) -> SidecarProcess:
        """Start the sidecar and wait until it reports SERVING."""
        cmd = [
            sys.executable, "-m", "sidecar", "serve", "--backend", self.backend,
            "--listen", self.address, "--metrics-port", str(self.metrics_port),
            "--grpc-port", str(self.grpc_port), *self.args,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if self.keep_xsp_env or not k.startswith("XSP_")}
        env.update(self.extra_env)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self.wait_serving(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Poll the gRPC health service until SERVING; SidecarStartError if the process exits
        or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if not self.alive():
                    code = self.process.returncode if self.process else None
                    raise SidecarStartError(
                        f"the sidecar exited with code {code}; its log ({self.log_path}) ends:\n"
                        + self.log()
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise SidecarStartError(
            f"the sidecar did not report SERVING within {timeout:g} s; its log "
            f"({self.log_path}) ends:\n{self.log()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self, tail: int = 4000) -> str:
        """The last `tail` characters of the sidecar's log."""
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited after 20 s."""
        stop_child(self.process, 20)

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
