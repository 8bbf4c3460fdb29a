"""Start and stop the stand-in for `tensorflow_model_server` (`sidecar.localtfserving.server`)
as a child process on free local ports, ready once every model reports AVAILABLE.

TensorFlow is loaded only in the child: the readiness poll speaks `GetModelStatus` in raw
protobuf bytes, so whoever starts the server (the demo, a test) does not import it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc

from sidecar.localtfserving.layout import model_versions
from sidecar.localtriton.server import free_port, stop_child

log = logging.getLogger(__name__)

GET_MODEL_STATUS = "/tensorflow.serving.ModelService/GetModelStatus"
AVAILABLE = 30  # tensorflow.serving.ModelVersionStatus.State.AVAILABLE


class TfServingStartError(RuntimeError):
    """The stand-in exited during start-up or its models were not AVAILABLE in time (with its
    log's tail)."""


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    size, length = bytearray(), len(payload)
    while True:
        size.append(length & 0x7F | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            break
    return bytes([number << 3 | 2]) + bytes(size) + payload


def status_request(model: str) -> bytes:
    """`GetModelStatusRequest{model_spec{name}}`."""
    return _field(1, _field(1, model.encode()))


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """`(field number, varint value or bytes)` of one message's fields (no fixed32/64 here)."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(buf):
        tag = varint()
        if tag & 7 == 0:
            yield tag >> 3, varint()
        elif tag & 7 == 2:
            size = varint()
            pos += size
            yield tag >> 3, buf[pos - size : pos]
        else:
            raise ValueError(f"unexpected wire type {tag & 7}")


def available_versions(reply: bytes) -> list[int]:
    """Versions in state AVAILABLE in a `GetModelStatusResponse`."""
    versions = []
    for number, status in _fields(reply):
        if number == 1 and isinstance(status, bytes):
            fields = dict(_fields(status))  # version = 1, state = 2
            version = fields.get(1, 0)
            if fields.get(2) == AVAILABLE and isinstance(version, int):
                versions.append(version)
    return versions


@dataclass
class TfServingServer:
    """The stand-in for `tensorflow_model_server` serving `model_base`, on free ports.

    Use as a context manager or call `start()` / `stop()`. With `profiler=True` it also serves
    TensorFlow's ProfilerService on `profiler_address`. The server's log is kept in `log_path`
    and its tail is included in the error when start-up fails.
    """

    model_base: Path
    log_path: Path
    profiler: bool = False
    host: str = "127.0.0.1"
    grpc_port: int = field(default_factory=free_port)
    profiler_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def profiler_address(self) -> str:
        if not self.profiler:
            raise RuntimeError("this server was started without a profiler port")
        return f"{self.host}:{self.profiler_port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the TF-Serving stand-in is not running")
        return self.process.pid

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sidecar.localtfserving.server", "--host", self.host,
            "--port", str(self.grpc_port), "--model-base-path", str(self.model_base),
        ]  # fmt: skip
        return [*cmd, "--profiler-port", str(self.profiler_port)] if self.profiler else cmd

    def start(self, timeout: float = 120.0) -> TfServingServer:
        if not model_versions(self.model_base):
            raise TfServingStartError(f"no SavedModel under {self.model_base}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        log.info("TF-Serving stand-in ready: grpc %s", self.grpc_address)
        return self

    def is_ready(self, channel: grpc.Channel, models: list[str]) -> bool:
        """True when GetModelStatus answers AVAILABLE for every model."""
        status = channel.unary_unary(GET_MODEL_STATUS, None, None)
        try:
            return all(available_versions(status(status_request(m), timeout=1.0)) for m in models)
        except grpc.RpcError:
            return False

    def wait_ready(self, timeout: float) -> None:
        models = list(model_versions(self.model_base))
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.grpc_address) as channel:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise TfServingStartError(
                        f"the TF-Serving stand-in exited with code {self.process.returncode} "
                        f"during start-up; last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                if self.is_ready(channel, models):
                    return
                time.sleep(0.2)
        raise TfServingStartError(
            f"the TF-Serving stand-in did not report {', '.join(models)} AVAILABLE within "
            f"{timeout:g} s; last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        stop_child(self.process, timeout)

    def __enter__(self) -> TfServingServer:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
