"""Run `xsp-sidecar serve` as a real subprocess for end-to-end tests, and talk to it."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.localtriton.server import free_port


@dataclass
class SidecarProcess:
    """`xsp-sidecar serve` in front of `backend`, on free ports, logging to `log_path`."""

    backend: str
    log_path: Path
    args: list[str]
    listen_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    def start(self) -> SidecarProcess:
        cmd = [
            sys.executable, "-m", "sidecar", "serve", "--backend", self.backend,
            "--listen", self.address, "--metrics-port", str(self.metrics_port),
            "--grpc-port", str(self.grpc_port), *self.args,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("XSP_")}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.wait_serving()
        return self

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(f"sidecar exited:\n{self.log()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise AssertionError(f"sidecar not SERVING after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        total = 0.0
        for line in self.metrics().splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
            if not match or match.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
        return total

    def worker_pids(self) -> list[int]:
        """Pids of the profiling worker processes (children of the sidecar)."""
        assert self.process is not None
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
            if ppid == self.process.pid and b"multiprocessing" in cmdline:
                pids.append(int(entry.name))
        return pids


def cnn_infer(
    client: grpcclient.InferenceServerClient, batch: int = 1, headers: dict[str, str] | None = None
) -> np.ndarray:
    x = grpcclient.InferInput("input", [batch, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.random.default_rng(batch).random((batch, 3, 32, 32), np.float32))
    result = client.infer("simple_cnn", [x], headers=headers)
    output: np.ndarray = result.as_numpy("output")
    return output


def count_traces(db: Path, where: str = "1=1") -> int:
    if not db.exists():
        return 0
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        try:
            return int(con.execute(f"SELECT count(*) FROM traces WHERE {where}").fetchone()[0])
        except sqlite3.Error:
            return 0


def wait_until(predicate: object, timeout: float = 60.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False
