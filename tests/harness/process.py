"""What the harness's child processes share: a server started with its output in a log file,
ready once its own probe says so, stopped with SIGTERM (then SIGKILL), and the log's tail in
every start-up error.

`TritonServer`, `TfServingServer` and `SidecarProcess` are `ChildProcess`es: each gives its
command, its environment and its readiness probe.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, Self

from tests.harness import REPO_ROOT

_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago and that this process has not handed out
    before: the kernel may give two calls in a row the same port (a relay's --listen and its
    --metrics-port once collided so in CI)."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no TCP port that was not handed out before")


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


class StartError(RuntimeError):
    """A child process exited during start-up or was not ready in time.

    `summary` says which and how, `reason` is the log's most telling line ("" if none),
    `log_path` where the whole log is; the message adds the log's tail."""

    def __init__(
        self, summary: str, log_path: Path | None = None, reason: str = "", tail: str = ""
    ) -> None:
        where = f"; last lines of {log_path}:\n{tail}" if log_path is not None else ""
        super().__init__(summary + where)
        self.summary = summary
        self.log_path = log_path
        self.reason = reason


# a Python logging prefix, e.g. "2025-01-01 10:00:00,000 ERROR sidecar.serve: "
_LOG_PREFIX = re.compile(r"^.*?\b(?:ERROR|CRITICAL)\s+[\w.]+:\s*")
_ERROR_WORDS = re.compile(r"error|exception|in use|failed|refused", re.IGNORECASE)


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with this checkout first on `PYTHONPATH`, so a child `python -m sidecar` or
    `python -m tests.harness...` runs this checkout's code whatever its working folder."""
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class ChildProcess:
    """A server run as a child process, its stdout and stderr in `log_path`.

    Subclasses (dataclasses) hold `log_path` and `process` and give `command()`, `child_env()`
    and `readiness()`; `NAME` names the server in errors, `READY` says what ready means,
    `START_ERROR` (a `StartError`) is what a failed start raises. Use as a context manager or
    call `start()` / `stop()`.
    """

    NAME: ClassVar[str]
    READY: ClassVar[str] = "ready"
    START_ERROR: ClassVar[type[StartError]] = StartError
    STOP_TIMEOUT: ClassVar[float] = 15.0
    POLL_S: ClassVar[float] = 0.2
    NEW_SESSION: ClassVar[bool] = True  # the terminal's Ctrl-C reaches the parent only

    log_path: Path
    process: subprocess.Popen[bytes] | None

    def command(self) -> list[str]:
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        return dict(os.environ)

    def readiness(self) -> contextlib.AbstractContextManager[Callable[[], bool]]:
        """A context whose value answers "ready yet?" (it may hold a channel open meanwhile)."""
        raise NotImplementedError

    def ready_means(self) -> str:
        """What the server reports once ready, for the error when it does not."""
        return self.READY

    def before_start(self) -> None:
        """Checks and preparations before the process starts (raise `START_ERROR` to refuse)."""

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.NAME} is not running")
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 120.0) -> Self:
        """Start the process and wait until it is ready; `START_ERROR` (with the log's tail) if
        it exits first or is not ready after `timeout` seconds, and then it is stopped."""
        self.before_start()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, env=self.child_env(),
                start_new_session=self.NEW_SESSION,
            )  # fmt: skip
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.readiness() as ready:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    code = self.process.returncode
                    raise self.start_error(f"{self.NAME} exited with code {code} during start-up")
                if ready():
                    return
                time.sleep(self.POLL_S)
        raise self.start_error(
            f"{self.NAME} did not report {self.ready_means()} within {timeout:g} s"
        )

    def start_error(self, summary: str) -> StartError:
        return self.START_ERROR(summary, self.log_path, self.reason_in_log(), self.log_tail())

    def reason_in_log(self) -> str:
        """The log's most telling line: the last that speaks of an error, else its last line
        (without a Python logging prefix); "" for an empty or missing log."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines()]
        except OSError:
            return ""
        lines = [ln for ln in lines if ln]
        errors = [ln for ln in lines if _ERROR_WORDS.search(ln)]
        line = errors[-1] if errors else lines[-1] if lines else ""
        return _LOG_PREFIX.sub("", line)[:300]

    def log(self, tail: int = 4000) -> str:
        """The last `tail` characters of the log."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` (`STOP_TIMEOUT`) s."""
        stop_child(self.process, self.STOP_TIMEOUT if timeout is None else timeout)

    def __enter__(self) -> Self:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def polled(probe: Callable[[], bool]) -> Iterator[Callable[[], bool]]:
    """`readiness()` for a probe that needs nothing held open."""
    yield probe
