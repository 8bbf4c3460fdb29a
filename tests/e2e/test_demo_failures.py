"""A demo that cannot run says so in one line (what went wrong, what to do) on stderr and exits
non-zero, without a traceback: a port taken, a Triton that does not start, a Triton environment
not set up, TensorFlow missing (issue 26)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT
from tests.harness.demo.failures import explain
from tests.harness.process import StartError, free_port
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import build_model_repository
from tests.harness.triton.server import TritonServer


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.harness.demo", *args],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, env=env,
    )  # fmt: skip


def assert_one_line(run: subprocess.CompletedProcess[str], *words: str) -> str:
    assert run.returncode != 0, run.stdout[-2000:]
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    for word in words:
        assert word in line, line
    return line


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_the_demo_has_a_command_line_of_its_own() -> None:
    run = demo("--help")
    assert run.returncode == 0, run.stderr
    assert "usage: python -m tests.harness.demo" in run.stdout
    assert "--backend {triton,tfserving}" in run.stdout


def test_a_taken_port_is_one_line_that_says_to_run_again(taken_port: int, tmp_path: Path) -> None:
    sidecar = SidecarProcess(
        f"127.0.0.1:{free_port()}", tmp_path / "sidecar.log", metrics_port=taken_port
    )
    with pytest.raises(StartError) as caught:
        sidecar.start(timeout=60)
    line = explain(caught.value)
    assert line is not None and "\n" not in line, line
    assert line.startswith("the sidecar exited with code 2 during start-up: cannot listen on")
    assert f":{taken_port}" in line and "already in use" in line, line
    assert line.endswith("; another process took a port the demo had picked; run the demo again")


def test_a_taken_http_port_is_one_line_that_names_the_http_plane(
    taken_port: int, tmp_path: Path
) -> None:
    sidecar = SidecarProcess(
        f"127.0.0.1:{free_port()}", tmp_path / "sidecar.log",
        http_backend=f"127.0.0.1:{free_port()}", http_port=taken_port,
    )  # fmt: skip
    with pytest.raises(StartError) as caught:
        sidecar.start(timeout=60)
    line = explain(caught.value)
    assert line is not None and "\n" not in line, line
    assert f"cannot listen on 127.0.0.1:{taken_port} for HTTP clients" in line, line
    assert "--http-listen" in line, line
    assert line.endswith("; another process took a port the demo had picked; run the demo again")


@pytest.mark.triton
def test_a_triton_that_does_not_start_is_one_line_with_its_first_error(tmp_path: Path) -> None:
    """Issue 26's failure: a SavedModel Triton cannot serve, in its model repository."""
    repo = build_model_repository(tmp_path / "models")
    (repo / "keras_cnn" / "1").mkdir(parents=True)
    (repo / "keras_cnn" / "1" / "saved_model.pb").write_bytes(b"")
    with pytest.raises(StartError) as caught:
        TritonServer(model_repository=repo, log_path=tmp_path / "triton.log").start(timeout=60)
    line = explain(caught.value)
    assert line is not None and "\n" not in line, line
    # exit code 1, or a crash while it shuts down after the failed load
    assert re.match(r"tritonserver exited with code -?\d+ during start-up: Poll failed", line)
    assert "keras_cnn" in line and line.endswith(f"; its log: {tmp_path / 'triton.log'}"), line


def test_the_demo_without_a_triton_environment_says_to_set_up(tmp_path: Path) -> None:
    home = tmp_path / "triton-home"
    (home / "venv").mkdir(parents=True)
    (home / "venv" / ".xsp-ready").write_text("ok\n")  # marked ready, but nothing installed
    env = {**os.environ, "XSP_TRITON_HOME": str(home)}
    run = demo("--out", str(tmp_path / "out"), "--requests", "1", env=env)
    assert_one_line(run, str(home / "venv"), "scripts/setup.sh")


def test_the_tfserving_demo_without_tensorflow_says_which_extra(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "tensorflow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named tensorflow (test)')\n")
    path = os.pathsep.join([str(shadow.parent), str(REPO_ROOT)])
    env = {**os.environ, "PYTHONPATH": path}
    run = demo("--backend", "tfserving", "--out", str(tmp_path / "out"), env=env)
    assert_one_line(run, "needs TensorFlow", "No module named tensorflow", "[tensorflow]")
    assert not (tmp_path / "out").exists()  # it stopped before doing anything
