"""Batch windows against the real Triton's statistics extension: what the server executed
around a sampled request, and every way a window is refused instead of guessed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc

from sidecar.backends import backend_named
from sidecar.backends.triton_statistics import ModelCounts, read_statistics
from sidecar.sampling.batch_windows import BatchWindows, window
from tests.harness.triton.server import TritonServer


def _infer(client: tc.InferenceServerClient, batch: int) -> None:
    tensor = tc.InferInput("input", [batch, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((batch, 3, 32, 32), np.float32))
    client.infer("simple_cnn", [tensor])


def _closed(windows: BatchWindows, trace_id: str, model: str, answered_ns: int) -> dict[str, Any]:
    done = threading.Event()
    got: dict[str, Any] = {}

    def then(found: dict[str, Any]) -> None:
        got.update(found)
        done.set()

    assert windows.close(trace_id, model, answered_ns, then)
    assert done.wait(10)
    return got


def _executions(triton: TritonServer) -> int:
    with grpc.insecure_channel(triton.grpc_address) as channel:
        return read_statistics(channel, 10)["simple_cnn"].executions


def _listed(triton: TritonServer) -> bool:
    with grpc.insecure_channel(triton.grpc_address) as channel:
        return "simple_cnn" in read_statistics(channel, 10)


def _wait_for_executions(triton: TritonServer, executions: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := _executions(triton)) < executions:
        assert time.monotonic() < deadline, f"Triton counted {seen} executions, not {executions}"
        time.sleep(0.01)


def test_the_window_counts_what_the_server_executed(triton: TritonServer) -> None:
    client = tc.InferenceServerClient(triton.grpc_address)
    first = _executions(triton) if _listed(triton) else 0
    _infer(client, 1)  # the model has run once: its statistics list it
    _wait_for_executions(triton, first + 1)  # and count it before the window opens
    windows = BatchWindows(triton.grpc_address, read_statistics)
    try:
        windows.open("t1")
        # the first read is done before the requests run (waited for: a fixed sleep was not
        # enough on a loaded machine)
        windows._open["t1"].result(10)
        before = _executions(triton)
        _infer(client, 2)
        _infer(client, 3)
        # Triton counts an execution after its response left: wait until it has counted
        # both (the window's own retries cover a short lag, not a loaded machine's), so that
        # the second read sees what the server executed
        _wait_for_executions(triton, before + 2)
        got = _closed(windows, "t1", "simple_cnn", time.time_ns())
    finally:
        windows.stop()
    assert got.pop("closed_after_response_ms") >= 0
    assert got == {"inferences": 5, "executions": 2, "batch_sizes": {"2": 1, "3": 1}}


def test_a_late_first_read_is_refused(triton: TritonServer) -> None:
    windows = BatchWindows(triton.grpc_address, read_statistics)
    try:
        windows.open("t2")
        got = _closed(windows, "t2", "simple_cnn", answered_ns=0)  # answered long before
    finally:
        windows.stop()
    assert "unobserved" in got and "after the server's response" in got["unobserved"]


def test_a_late_first_read_that_predates_the_request_is_kept(triton: TritonServer) -> None:
    """The first read completed after the response (answered_ns=0 says so), but the latest
    request it knew of finished before this one started: it cannot count this request."""
    client = tc.InferenceServerClient(triton.grpc_address)
    _infer(client, 1)
    windows = BatchWindows(triton.grpc_address, read_statistics)
    try:
        windows.open("t5")
        windows._open["t5"].result(10)  # the first read is done
        started = time.time_ns()
        _infer(client, 4)
        done = threading.Event()
        got: dict[str, Any] = {}
        assert windows.close(
            "t5", "simple_cnn", 0, lambda w: (got.update(w), done.set()), started_ns=started
        )
        assert done.wait(10)
    finally:
        windows.stop()
    assert got["batch_sizes"] == {"4": 1}, got


def test_no_request_in_the_window_is_refused(triton: TritonServer) -> None:
    windows = BatchWindows(triton.grpc_address, read_statistics, settle_s=0.001)
    try:
        windows.open("t3")
        windows._open["t3"].result(10)  # the first read is done
        got = _closed(windows, "t3", "simple_cnn", time.time_ns())
    finally:
        windows.stop()
    assert "no computed request" in got["unobserved"]


def test_an_unreachable_backend_is_a_reason(tmp_path: Path) -> None:
    windows = BatchWindows(f"unix:{tmp_path / 'none.sock'}", read_statistics, timeout_s=0.2)
    try:
        windows.open("t4")
        got = _closed(windows, "t4", "simple_cnn", time.time_ns() + 10**10)
    finally:
        windows.stop()
    assert got["unobserved"].startswith("the backend's statistics could not be read (UNAVAILABLE")


def test_unknown_window_and_bounded_open_windows(triton: TritonServer) -> None:
    windows = BatchWindows(triton.grpc_address, read_statistics, limit=2)
    try:
        assert not windows.close("never-opened", "m", 0, lambda w: None)
        for tid in ("a", "b", "c"):
            windows.open(tid)
        assert not windows.close("a", "m", 0, lambda w: None)  # the oldest was given up
        assert windows.close("c", "m", 0, lambda w: None)
    finally:
        windows.stop()


def test_window_arithmetic() -> None:
    before = {"m": ModelCounts(10, 4, {1: 2, 4: 2})}
    after = {"m": ModelCounts(19, 6, {1: 3, 4: 2, 8: 1})}
    assert window(before, after, "m") == {
        "inferences": 9,
        "executions": 2,
        "batch_sizes": {"1": 1, "8": 1},
    }
    assert "do not list model" in window(before, after, "other")["unobserved"]
    assert window({}, after, "m")["inferences"] == 19  # first run of the model in the window


def test_only_triton_counts_its_batches() -> None:
    assert backend_named("triton").statistics is not None
    assert backend_named("tfserving").statistics is None


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Any:
    before = {t.name for t in threading.enumerate()}
    yield
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith("xsp-batch-window")]
