"""Acceptance: per-inference accounting of `ModelStreamInfer` through the sidecar in front of
the REAL Triton 2.51, with a decoupled Python-backend model (`token_stream`)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench import perf_analyzer
from sidecar.proxy import frames, stream_messages
from tests.harness.metrics_text import sample_sum, sample_value, scrape
from tests.harness.triton.model_repo import add_token_stream, build_model_repository
from tests.harness.triton.server import TritonServer
from tests.proxy.proxy_harness import SidecarThread

pytestmark = pytest.mark.triton
METHOD = "ModelStreamInfer"
STREAM_DEADLINE_S = 60  # a hung stream fails here, with what it got, not at the suite timeout


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("triton-streams")
    repo = add_token_stream(build_model_repository(root / "models"))
    with TritonServer(model_repository=repo, log_path=root / "tritonserver.log") as server:
        yield server


@pytest.fixture()
def sidecar(triton: TritonServer) -> Iterator[SidecarThread]:
    side = SidecarThread(triton.grpc_address)  # fresh metrics for each test
    yield side
    side.close()


def stream(address: str, messages: list[Any], pause_s: float = 0.0) -> list[Any]:
    def send() -> Iterator[Any]:
        for msg in messages:
            yield msg
            time.sleep(pause_s)

    replies: list[Any] = []
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            replies.extend(stub.ModelStreamInfer(send(), timeout=STREAM_DEADLINE_S))
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            got = [r.infer_response.id or r.error_message for r in replies]
            pytest.fail(f"the stream did not end in {STREAM_DEADLINE_S} s; replies: {got}")
    return replies


def tokens(
    count: int, first_ms: int, sleep_ms: int, ident: str = "", ask_final: bool = True
) -> Any:
    req = service_pb2.ModelInferRequest(model_name="token_stream", id=ident)
    for name, v in (("COUNT", count), ("FIRST_MS", first_ms), ("SLEEP_MS", sleep_ms)):
        req.inputs.add(name=name, datatype="INT32", shape=[1])
        req.raw_input_contents.append(np.array([v], np.int32).tobytes())
    if ask_final:
        req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def add_sub(model: str = "add_sub", ident: str = "") -> Any:
    req = service_pb2.ModelInferRequest(model_name=model, id=ident)
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[4])
        req.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    return req


def scrape_ended(sidecar: SidecarThread, streams: int = 1, timeout_s: float = 10) -> str:
    """/metrics once the relay has counted `streams` ended streams: the client can have the
    stream's trailers before the relay, which forwards them first, has counted them."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(sidecar.metrics_url)
        ended = sample_sum(text, "xsp_streams_total")
        if ended >= streams or time.monotonic() > deadline:
            return text
        time.sleep(0.01)


def requests(text: str, model: str, code: str = "OK") -> float | None:
    return sample_value(text, "xsp_requests_total", method=METHOD, model=model, grpc_code=code)


def test_decoupled_model_first_response_gaps_and_count(sidecar: SidecarThread) -> None:
    count, first_ms, sleep_ms = 6, 200, 60
    replies = stream(sidecar.address, [tokens(count, first_ms, sleep_ms, "t1")])
    assert len(replies) == count + 1  # N tokens and the empty final response
    text = scrape_ended(sidecar)
    labels = {"method": METHOD, "model": "token_stream"}
    assert requests(text, "token_stream") == 1
    assert sample_value(text, "xsp_responses_total", **labels) == count
    first = sample_value(text, "xsp_first_response_seconds_sum", **labels)
    assert first is not None and first_ms / 1e3 <= first < first_ms / 1e3 + 0.25
    gaps = sample_value(text, "xsp_response_gap_seconds_count", **labels)
    gap_sum = sample_value(text, "xsp_response_gap_seconds_sum", **labels)
    assert gaps == count - 1 and gap_sum is not None
    mean_gap = gap_sum / gaps
    assert sleep_ms / 1e3 * 0.9 <= mean_gap < sleep_ms / 1e3 + 0.1
    total = sample_value(text, "xsp_request_duration_seconds_sum", **labels)
    assert total is not None and total >= (first_ms + (count - 1) * sleep_ms) / 1e3
    assert sample_value(text, "xsp_final_response_unseen_total", **labels) is None
    assert sample_value(text, "xsp_streams_total", method=METHOD, grpc_code="OK") == 1
    assert sample_value(text, "xsp_streams_open", method=METHOD) == 0


def test_decoupled_without_final_flag_is_counted_apart(sidecar: SidecarThread) -> None:
    msgs = [tokens(3, 10, 10, ask_final=False), tokens(2, 10, 10, ask_final=False)]
    replies = stream(sidecar.address, msgs, pause_s=0.3)  # one after the other, no ids
    assert len(replies) == 5  # no final responses: the client did not ask
    text = scrape_ended(sidecar)
    labels = {"method": METHOD, "model": "token_stream"}
    assert requests(text, "token_stream") == 2
    assert sample_value(text, "xsp_final_response_unseen_total", **labels) == 2
    assert sample_value(text, "xsp_responses_total", **labels) == 5
    assert sample_value(text, "xsp_response_gap_seconds_count", **labels) == 3


@pytest.mark.parametrize("walker", ["c", "python"])
def test_one_stream_two_models_and_a_per_message_error(
    sidecar: SidecarThread, walker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if walker == "python":  # the fallbacks without a compiler
        monkeypatch.setattr(frames, "native_walk", None)
        monkeypatch.setattr(stream_messages, "native_readers", None)
    elif frames.native_walk is None or stream_messages.native_readers is None:
        pytest.skip("the C frame and message walkers are not built here")
    msgs = [
        add_sub(ident="a1"),
        tokens(3, 20, 20, "t1"),
        add_sub(ident="a2"),
        add_sub("no_such_model", "bad"),
        add_sub(),  # no id: matched in order
    ]
    replies = stream(sidecar.address, msgs)
    errors = [r.error_message for r in replies if r.error_message]
    assert len(errors) == 1 and "no_such_model" in errors[0]
    text = scrape_ended(sidecar)
    assert requests(text, "add_sub") == 3
    assert requests(text, "token_stream") == 1
    assert requests(text, "no_such_model", "UNKNOWN") == 1
    assert sample_value(text, "xsp_responses_total", method=METHOD, model="add_sub") == 3
    assert sample_sum(text, "xsp_stream_anomalies_total") == 0
    messages = {"method": METHOD, "direction": "request"}
    assert sample_value(text, "xsp_stream_messages_total", **messages) == 5
    # the stream itself is not an inference
    assert sample_value(text, "xsp_streams_total", method=METHOD, grpc_code="OK") == 1


def test_client_cancel_ends_pending_inferences(sidecar: SidecarThread) -> None:
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(iter([tokens(50, 10, 50, "long")]))
        assert next(call).infer_response.id == "long"
        call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = scrape(sidecar.metrics_url)
        if requests(text, "token_stream", "CANCELLED"):
            break
        time.sleep(0.1)
    assert requests(text, "token_stream", "CANCELLED") == 1
    assert sample_value(text, "xsp_stream_anomalies_total", reason="cancelled") == 1
    assert sample_value(text, "xsp_streams_total", method=METHOD, grpc_code="CANCELLED") == 1


def triton_success(triton: TritonServer, model: str) -> float:
    text = scrape(f"http://{triton.metrics_address}/metrics")
    return sample_sum(text, "nv_inference_request_success_total", model=model)  # parser adds _total


def test_perf_analyzer_streaming_counts_each_inference(
    triton: TritonServer, sidecar: SidecarThread
) -> None:
    binary = perf_analyzer.find_binary()
    if binary is None:
        pytest.skip("perf_analyzer is neither on PATH nor obtainable from tritonclient 2.51")
    env = triton.env()
    before = triton_success(triton, "add_sub")
    with tempfile.TemporaryDirectory(prefix="xsp-pa-") as tmp:
        libs = perf_analyzer.library_dir(env.library_dir, Path(tmp))
        cmd = [
            binary, "-m", "add_sub", "-i", "grpc", "-u", sidecar.address, "--streaming",
            "--concurrency-range", "4:4", "--shape", "INPUT0:16", "--shape", "INPUT1:16",
            "--measurement-mode", "count_windows", "--measurement-request-count", "300",
            "--max-trials", "3",
        ]  # fmt: skip
        run_env = {"LD_LIBRARY_PATH": f"{libs}:{env.library_dir}", "PATH": "/usr/bin:/bin"}
        try:
            done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300)
        except OSError as exc:
            pytest.skip(f"perf_analyzer cannot run here: {exc}")
        if done.returncode != 0 and "error while loading shared libraries" in done.stderr:
            pytest.skip(f"perf_analyzer cannot run here: {done.stderr.strip()}")
        unstable = "Failed to obtain stable measurement" in done.stdout + done.stderr
        assert done.returncode == 0 or unstable, done.stdout + done.stderr  # counts still hold
    served = triton_success(triton, "add_sub") - before
    text = scrape(sidecar.metrics_url)
    counted = sample_sum(text, "xsp_requests_total", method=METHOD, model="add_sub")
    assert served > 300
    assert counted == served
    assert sample_value(text, "xsp_responses_total", method=METHOD, model="add_sub") == served
