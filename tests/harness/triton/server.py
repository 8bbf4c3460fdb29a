"""Start and stop a real `tritonserver` on free local ports, with readiness waiting."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Self

from tests.harness.process import ChildProcess, StartError, free_port, polled
from tests.harness.triton.environment import (
    TritonEnvironment,
    TritonSetupError,
    ensure_environment,
)

log = logging.getLogger(__name__)
# Triton's log prefix, e.g. "E0612 10:11:12.123456 1234 model_lifecycle.cc:654] "
# errors Triton logs on every machine without a GPU, whatever else goes wrong
_NO_GPU_NOISE = ("CudaDriverHelper has not been initialized",)
_TRITON_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")


class TritonStartError(TritonSetupError, StartError):
    """`tritonserver` exited during start-up or was not ready in time (with its log's tail)."""


@dataclass
class TritonServer(ChildProcess):
    """A `tritonserver` process serving `model_repository`.

    Use as a context manager or call `start()` / `stop()`. `extra_args` are passed through
    (e.g. `--trace-config mode=opentelemetry ...`). The server log is kept in `log_path` and
    its error lines and tail are included in the error when start-up fails.
    """

    NAME: ClassVar[str] = "tritonserver"
    READY: ClassVar[str] = "ready (/v2/health/ready)"
    START_ERROR: ClassVar[type[StartError]] = TritonStartError

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

    def env(self) -> TritonEnvironment:
        """The Triton venv (created on first use)."""
        if self.environment is None:
            self.environment = ensure_environment()
        return self.environment

    def command(self) -> list[str]:
        env = self.env()
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

    def child_env(self) -> dict[str, str]:
        return self.env().process_env()

    def readiness(self) -> contextlib.AbstractContextManager[Callable[[], bool]]:
        return polled(self.is_ready)

    def start(self, timeout: float = 120.0) -> Self:
        super().start(timeout)
        log.info("tritonserver ready: grpc %s, http %s", self.grpc_address, self.http_address)
        return self

    def is_ready(self) -> bool:
        try:
            url = f"http://{self.http_address}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 15) -> str:
        """The server's error lines followed by the last `lines` lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text if line.startswith("E") or "error" in line.lower()]
        return "\n".join(["errors:", *errors[-20:], "last lines:", *text[-lines:]])

    def reason_in_log(self) -> str:
        """Triton's first error line (the cause; later ones follow from it), its prefix cut;
        the error every machine without a GPU logs is not one."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [
            _TRITON_PREFIX.sub("", line).strip('"')
            for line in text
            if line.startswith("E") and not any(noise in line for noise in _NO_GPU_NOISE)
        ]
        return errors[0][:300] if errors else super().reason_in_log()
