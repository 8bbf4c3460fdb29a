"""Start and stop the stand-in for `tensorflow_model_server` (`tests.harness.tfserving.server`)
as a child process on free local ports, ready once every model reports AVAILABLE.

TensorFlow is loaded only in the child: the readiness poll speaks `GetModelStatus` in raw
protobuf bytes, so whoever starts the server (the demo, a test) does not import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Self

import grpc

from tests.harness.process import ChildProcess, StartError, free_port, with_repo_on_path
from tests.harness.tfserving.layout import model_versions

log = logging.getLogger(__name__)

SERVER_MODULE = "tests.harness.tfserving.server"
GET_MODEL_STATUS = "/tensorflow.serving.ModelService/GetModelStatus"
AVAILABLE = 30  # tensorflow.serving.ModelVersionStatus.State.AVAILABLE


class TfServingStartError(StartError):
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
class TfServingServer(ChildProcess):
    """The stand-in for `tensorflow_model_server` serving `model_base`, on free ports.

    Use as a context manager or call `start()` / `stop()`. TF-Serving's REST API listens on
    `rest_address` (`rest_url`) beside gRPC on `grpc_address`. With `profiler=True` it also
    serves TensorFlow's ProfilerService on `profiler_address`. The server's log is kept in
    `log_path` and its tail is included in the error when start-up fails.
    """

    NAME: ClassVar[str] = "the TF-Serving stand-in"
    START_ERROR: ClassVar[type[StartError]] = TfServingStartError

    model_base: Path
    log_path: Path
    profiler: bool = False
    host: str = "127.0.0.1"
    grpc_port: int = field(default_factory=free_port)
    rest_port: int = field(default_factory=free_port)
    profiler_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def ready_means(self) -> str:
        return ", ".join(model_versions(self.model_base)) + " AVAILABLE"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def rest_address(self) -> str:
        """Where TF-Serving's REST API listens (the binary's `--rest_api_port`)."""
        return f"{self.host}:{self.rest_port}"

    @property
    def rest_url(self) -> str:
        return f"http://{self.rest_address}"

    @property
    def profiler_address(self) -> str:
        if not self.profiler:
            raise RuntimeError("this server was started without a profiler port")
        return f"{self.host}:{self.profiler_port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", SERVER_MODULE, "--host", self.host,
            "--port", str(self.grpc_port), "--rest-api-port", str(self.rest_port),
            "--model-base-path", str(self.model_base),
        ]  # fmt: skip
        return [*cmd, "--profiler-port", str(self.profiler_port)] if self.profiler else cmd

    def child_env(self) -> dict[str, str]:
        level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
        return with_repo_on_path({**os.environ, "TF_CPP_MIN_LOG_LEVEL": level})

    def before_start(self) -> None:
        if not model_versions(self.model_base):
            raise TfServingStartError(f"no SavedModel under {self.model_base}")

    def start(self, timeout: float = 120.0) -> Self:
        super().start(timeout)
        log.info("TF-Serving stand-in ready: grpc %s, REST %s", self.grpc_address, self.rest_url)
        return self

    @contextlib.contextmanager
    def readiness(self) -> Iterator[Callable[[], bool]]:
        """True once GetModelStatus answers AVAILABLE for every model (over one channel)."""
        models = list(model_versions(self.model_base))
        with grpc.insecure_channel(self.grpc_address) as channel:
            yield lambda: self.is_ready(channel, models)

    def is_ready(self, channel: grpc.Channel, models: list[str]) -> bool:
        """True when GetModelStatus answers AVAILABLE for every model."""
        status = channel.unary_unary(GET_MODEL_STATUS, None, None)
        try:
            return all(available_versions(status(status_request(m), timeout=1.0)) for m in models)
        except grpc.RpcError:
            return False
