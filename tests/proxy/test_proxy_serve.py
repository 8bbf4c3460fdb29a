"""`xsp-sidecar serve` as a subprocess: start-up errors, warnings, graceful SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.harness.process import free_port
from tests.proxy.proxy_harness import grpc_backend, unary

INFER = "/inference.GRPCInferenceService/ModelInfer"


def serve(*args: str) -> subprocess.Popen[str]:
    script = Path(sys.executable).with_name("xsp-sidecar")  # the installed console script
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "sidecar"]
    cmd = [*prefix, "serve", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("XSP_")}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def wait_listening(port: int, proc: subprocess.Popen[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early:\n{proc.communicate()[0]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("serve never started listening")


@pytest.fixture
def slow_backend() -> Iterator[int]:
    def handler(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        time.sleep(float(req.decode() or 0))
        return b"done:" + req

    server, port = grpc_backend({"ModelInfer": unary(handler)})
    yield port
    server.stop(0)


def ports() -> list[str]:
    return ["--metrics-port", str(free_port()), "--grpc-port", str(free_port())]


def test_sigterm_lets_in_flight_calls_finish(slow_backend: int) -> None:
    listen = free_port()
    proc = serve("--backend", f"127.0.0.1:{slow_backend}", "--listen", f"127.0.0.1:{listen}",
                 "--grace-period", "5", *ports())  # fmt: skip
    try:
        wait_listening(listen, proc)
        result: dict[str, object] = {}
        channel = grpc.insecure_channel(f"127.0.0.1:{listen}")
        call = channel.unary_unary(INFER, None, None)
        assert call(b"0") == b"done:0"

        def slow() -> None:
            try:
                result["reply"] = call(b"1.5", timeout=10)
            except grpc.RpcError as exc:
                result["error"] = exc

        thread = threading.Thread(target=slow)
        thread.start()
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(OSError):  # no longer accepting new connections
            socket.create_connection(("127.0.0.1", listen), timeout=0.5).close()
        thread.join(10)
        assert result.get("reply") == b"done:1.5", result
        code = proc.wait(10)
        assert code == 0
        assert time.monotonic() - sent < 4.5  # closed once idle, well before the grace period
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag", ["--listen", "--metrics-port", "--grpc-port"])
def test_port_in_use_exits_2_with_clear_message(slow_backend: int, flag: str) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        values = {
            "--listen": f"127.0.0.1:{free_port()}",
            "--metrics-port": str(free_port()),
            "--grpc-port": str(free_port()),
        }
        values[flag] = f"127.0.0.1:{port}" if flag == "--listen" else str(port)
        args = [item for pair in values.items() for item in pair]
        proc = serve("--backend", f"127.0.0.1:{slow_backend}", *args)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 2, out
    assert "already in use" in out and flag in out


def test_unreachable_backend_is_a_warning_not_a_crash() -> None:
    listen = free_port()
    proc = serve(
        "--backend", f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{listen}", *ports()
    )
    try:
        wait_listening(listen, proc)
        with (
            grpc.insecure_channel(f"127.0.0.1:{listen}") as channel,
            pytest.raises(grpc.RpcError) as info,
        ):
            channel.unary_unary(INFER, None, None)(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert "WARNING" in out and "does not accept connections yet" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
