"""Start and stop a real `tritonserver` on free local ports, with readiness waiting."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from sidecar.localtriton.environment import TritonEnvironment, TritonSetupError, ensure_environment

log = logging.getLogger(__name__)


def stop_child(process: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM a child process, then SIGKILL it if it has not exited after `timeout` s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class TritonServer:
    """A `tritonserver` process serving `model_repository`.

    Use as a context manager or call `start()` / `stop()`. `extra_args` are passed through
    (e.g. `--trace-config mode=opentelemetry ...`). The server log is kept in `log_path` and
    its tail is included in the error when start-up fails.
    """

    model_repository: Path
    log_path: Path
    environment: TritonEnvironment | None = None
    extra_args: Sequence[str] = ()
    host: str = "127.0.0.1"
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_address(self) -> str:
        return f"{self.host}:{self.metrics_port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("tritonserver is not running")
        return self.process.pid

    def command(self, env: TritonEnvironment) -> list[str]:
        return [
            str(env.server_binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={env.backend_dir}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            "--log-verbose=0",
            "--exit-timeout-secs=5",
            *self.extra_args,
        ]

    def start(self, timeout: float = 120.0) -> TritonServer:
        env = self.environment or ensure_environment()
        self.environment = env
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                self.command(env),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env.process_env(),
                start_new_session=True,
            )
        self.wait_ready(timeout)
        log.info("tritonserver ready: grpc %s, http %s", self.grpc_address, self.http_address)
        return self

    def is_ready(self) -> bool:
        try:
            url = f"http://{self.http_address}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise TritonSetupError(
                    f"tritonserver exited with code {self.process.returncode} during start-up; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TritonSetupError(
            f"tritonserver was not ready after {timeout:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 15) -> str:
        """The server's error lines followed by the last `lines` lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text if line.startswith("E") or "error" in line.lower()]
        return "\n".join(["errors:", *errors[-20:], "last lines:", *text[-lines:]])

    def stop(self, timeout: float = 15.0) -> None:
        stop_child(self.process, timeout)

    def __enter__(self) -> TritonServer:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
