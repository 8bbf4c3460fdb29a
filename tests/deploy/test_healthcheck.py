"""docker/healthcheck.py against a real gRPC server running the standard health service."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.helpers import REPO

SCRIPT = REPO / "docker" / "healthcheck.py"
Status = health_pb2.HealthCheckResponse


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("xsp_healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load()


@pytest.fixture()
def server() -> Iterator[tuple[health.HealthServicer, int]]:
    servicer = health.HealthServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        yield servicer, port
    finally:
        grpc_server.stop(grace=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serving_is_healthy_as_a_process(server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = server
    servicer.set("", Status.SERVING)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    servicer.set("", Status.NOT_SERVING)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "NOT_SERVING" in done.stderr


def test_not_serving_is_unhealthy_but_alive(
    server: tuple[health.HealthServicer, int], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, port = server
    servicer.set("", Status.NOT_SERVING)
    assert healthcheck.main(["--port", str(port)]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    assert healthcheck.main(["--port", str(port), "--live"]) == 0


def test_unknown_service_counts_as_alive_only(server: tuple[health.HealthServicer, int]) -> None:
    _, port = server
    assert healthcheck.main(["--port", str(port), "--service", "nope"]) == 1
    assert healthcheck.main(["--port", str(port), "--service", "nope", "--live"]) == 0


def test_nothing_listening_is_dead(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    assert healthcheck.main(["--port", str(port), "--timeout", "1", "--live"]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and ("UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err)


def test_port_defaults_to_the_contract_env_var(
    server: tuple[health.HealthServicer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    servicer, port = server
    servicer.set("", Status.SERVING)
    monkeypatch.setitem(os.environ, "XSP_GRPC_PORT", str(port))
    assert healthcheck.build_parser().parse_args([]).port == port
    monkeypatch.delitem(os.environ, "XSP_GRPC_PORT")
    assert healthcheck.build_parser().parse_args([]).port == 8013
