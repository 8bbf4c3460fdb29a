"""Sampling the messages of a `ModelStreamInfer` stream, end to end: the real `xsp-sidecar
serve` process (with its profiling worker) in front of the real Triton; each sampled message
becomes a trace replayed as `ModelInfer`."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from analysis.report import main as report_main
from sidecar.live.otlp_payload import parse_otlp_json, parse_otlp_protobuf
from sidecar.trace.spans import Level, Source
from sidecar.trace.store import TraceStore, count_traces
from tests.e2e.helpers import wait_until
from tests.e2e.test_sampling_e2e import sidecar
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import add_token_stream, build_model_repository
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton, pytest.mark.slow]
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def cnn_message(seed: int, **params: int) -> tuple[Any, str]:
    """A ModelInferRequest for simple_cnn and the digest its replay must record."""
    x = np.random.default_rng(seed).random((1, 3, 32, 32), np.float32)
    req = service_pb2.ModelInferRequest(model_name="simple_cnn", id=f"r{seed}")
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    for key, value in params.items():
        req.parameters[key].int64_param = value
    return req, "sha256:" + hashlib.sha256(x.tobytes()).hexdigest()[:32]


def stream(address: str, messages: list[Any]) -> list[Any]:
    def send() -> Iterator[Any]:
        yield from messages

    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return list(stub.ModelStreamInfer(send()))


def test_each_message_of_a_stream_becomes_its_own_modelinfer_trace(
    traced_triton: TritonServer, tmp_path: Path, otlp_port: int
) -> None:
    args = ["--sample-rate", "1", "--sample-budget", "100", "--duty-cycle", "1",
            "--queue-size", "50"]  # fmt: skip
    db = tmp_path / "traces.db"
    sent = [cnn_message(seed) for seed in range(4)]
    with sidecar(traced_triton, tmp_path, otlp_port, *args) as proc:
        responses = stream(proc.address, [req for req, _ in sent])
        assert [r.error_message for r in responses] == [""] * 4
        sampled = dict(model="simple_cnn", decision="sampled")
        assert proc.metric("xsp_sampling_decisions_total", **sampled) == 4  # one per message
        assert wait_until(lambda: proc.metric("xsp_profiles_total", outcome="ok") == 4, 180), (
            proc.log()
        )
        assert proc.metric("xsp_samples_dropped_total") == 0
        assert proc.metric("xsp_requests_total", method="ModelStreamInfer", grpc_code="OK") == 4
    assert count_traces(db) == 4
    store = TraceStore(db)
    digests = {}
    for trace in store.list_traces():
        assert trace.attributes["method"] == "ModelInfer" and trace.sample_reason == "rate"
        (request,) = [s for s in store.spans(trace.trace_id) if s.level is Level.REQUEST]
        assert request.source is Source.PROXY and request.kind == "ModelStreamInfer"
        assert request.name == STREAM and request.attributes["stream_message"] is True
        assert request.attributes["responses"] == 1 and request.attributes["grpc_code"] == "OK"
        assert request.start_ns < request.attributes["first_response_ns"] == request.end_ns
        (inputs,) = trace.attributes["inputs"]
        digests[request.span_id] = inputs["digest"]
    # the four messages, each replayed once with its own input
    assert sorted(digests.values()) == sorted(digest for _, digest in sent)


def test_a_later_message_is_sampled_when_the_first_is_not(
    traced_triton: TritonServer, tmp_path: Path, otlp_port: int
) -> None:
    """The force header forces every message; with the first one a sequence request (refused
    for replay), the second is the stream's sample."""
    args = ["--sample-rate", "0", "--sample-budget", "100", "--duty-cycle", "1"]
    db = tmp_path / "traces.db"
    first, _ = cnn_message(0, sequence_id=42)
    second, digest = cnn_message(1)
    with sidecar(traced_triton, tmp_path, otlp_port, *args) as proc:
        with grpc.insecure_channel(proc.address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            list(stub.ModelStreamInfer(iter([first, second]), metadata=[("x-xsp-profile", "1")]))
        dropped = proc.metric("xsp_samples_dropped_total", reason="sequence_model")
        assert dropped == 1, proc.log()
        assert wait_until(lambda: count_traces(db) == 1, 120), proc.log()
    (trace,) = TraceStore(db).list_traces()
    assert trace.sample_reason == "forced" and trace.attributes["inputs"][0]["digest"] == digest


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint keeping every span Triton exports (in `server.spans`)."""

    server: Any

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        json_body = "json" in self.headers.get("Content-Type", "")
        self.server.spans.extend(parse_otlp_json(body) if json_body else parse_otlp_protobuf(body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_triton_traces_every_inference_of_a_stream_under_its_traceparent(
    traced_triton: TritonServer, otlp_port: int
) -> None:
    """Why the relay adds no `traceparent` to a stream (docs/contracts.md): Triton applies the
    stream's to each of its inferences alike, one `InferRequest` span each under the stream's
    parent, told apart only by `triton.request_id`. The sidecar's OTLP port is ours here."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", otlp_port), _Receiver)
    server.spans = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    parent = "6" * 16

    def traced(trace_id: str) -> list[Any]:
        return [s for s in server.spans if s.trace_id == trace_id]  # type: ignore[attr-defined]

    def named(trace_id: str) -> list[Any]:
        return [s for s in traced(trace_id) if "triton.request_id" in s.attributes]

    try:
        for attempt in range(3):  # Triton 2.51 now and then exports nothing (tests/live/)
            trace_id = f"{attempt + 1:032x}"
            with grpc.insecure_channel(traced_triton.grpc_address) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                messages = iter([cnn_message(seed)[0] for seed in range(3)])
                metadata = [("traceparent", f"00-{trace_id}-{parent}-01")]
                assert len(list(stub.ModelStreamInfer(messages, metadata=metadata))) == 3
            if wait_until(lambda t=trace_id: len(named(t)) == 3, 20):
                break
        spans = traced(trace_id)
    finally:
        server.shutdown()
        server.server_close()
    roots = [s for s in spans if s.parent_span_id == parent]
    assert len(roots) == 3 and {s.name for s in roots} == {"InferRequest"}
    per_message = {s.attributes["triton.request_id"]: s.parent_span_id for s in named(trace_id)}
    assert sorted(per_message) == ["r0", "r1", "r2"]
    assert set(per_message.values()) == {s.span_id for s in roots}  # one InferRequest each


@pytest.fixture(scope="module")
def token_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("triton-token-stream")
    repo = add_token_stream(build_model_repository(root / "models"))
    with TritonServer(model_repository=repo, log_path=root / "tritonserver.log") as server:
        yield server


def tokens(count: int, first_ms: int, sleep_ms: int, ident: str) -> Any:
    """A request to the decoupled `token_stream` model: `count` responses, the first after
    `first_ms`, then one each `sleep_ms`; the empty final response asked for."""
    req = service_pb2.ModelInferRequest(model_name="token_stream", id=ident)
    for name, v in (("COUNT", count), ("FIRST_MS", first_ms), ("SLEEP_MS", sleep_ms)):
        req.inputs.add(name=name, datatype="INT32", shape=[1])
        req.raw_input_contents.append(np.array([v], np.int32).tobytes())
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def test_a_decoupled_model_s_sampled_message_records_its_responses(
    token_triton: TritonServer, tmp_path: Path
) -> None:
    """The live breakdown of a decoupled model: each sampled message's request span holds its
    responses' count, first and last times and gaps, and the report reads them (its replay
    counts only where it succeeded; `--include-errors` reads the rest)."""
    db = tmp_path / "traces.db"
    proc = SidecarProcess(
        backend=token_triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(token_triton.model_repository), "--db", str(db),
              "--sample-rate", "1", "--sample-budget", "100", "--duty-cycle", "1",
              "--iterations", "2", "--warmup", "1"],
    )  # fmt: skip
    plan = {"a": (4, 150, 40), "b": (3, 20, 120)}  # id: count, first ms, gap ms
    with proc:
        messages = [tokens(*plan[ident], ident) for ident in plan]
        got = stream(proc.address, messages)
        assert len(got) == 4 + 3 + 2  # the tokens and two empty final responses
        assert wait_until(lambda: proc.metric("xsp_profiles_total") == 2, 120), proc.log()
    store = TraceStore(db)
    by_count = {}
    for trace in store.list_traces():
        (request,) = [s for s in store.spans(trace.trace_id) if s.level is Level.REQUEST]
        by_count[request.attributes["responses"]] = request
    assert sorted(by_count) == [3, 4]
    for count, first_ms, gap_ms in plan.values():
        attrs = by_count[count].attributes
        first = (attrs["first_response_ns"] - by_count[count].start_ns) / 1e6
        gaps = [g / 1e6 for g in attrs["response_gaps_ns"]]
        assert first >= first_ms and len(gaps) == count - 1
        assert all(g >= gap_ms * 0.9 for g in gaps)  # the model sleeps between tokens
        assert attrs["last_response_ns"] - attrs["first_response_ns"] == pytest.approx(
            sum(attrs["response_gaps_ns"]), abs=count
        )
    out = tmp_path / "report"
    assert report_main([str(db), "--include-errors", "--format", "json", "--out", str(out)]) == 0
    doc = json.loads((out / "report.json").read_text())
    (row,) = doc["stream_responses"]["rows"]
    assert row["model"] == "token_stream" and row["requests"] == 2 and row["gaps"] == 5
