"""REST calls through the sidecar's HTTP plane, end to end: the real Triton 2.51 (its KServe v2
HTTP port, OpenTelemetry tracing to the sidecar), the real `xsp-sidecar serve` with
`--http-listen`/`--http-backend`, and real HTTP clients: perf_analyzer with its default HTTP
protocol (sync and async), `tritonclient.http` with binary tensors, and `curl` with JSON.

Every call is counted under its model (a real scrape of `/metrics`, `protocol="http"`) as
Triton's own statistics count it, and the sampled and forced ones become traces whose
Triton spans joined through the `traceparent` the relay added, with a live breakdown that
adds up, and that say they came over HTTP.

One sidecar serves the module, sampling every call (`--sample-rate 1`) under a budget of
`BUDGET` profiles per model per minute: the first calls to each model are sampled, the rest
skipped; the forced calls go to `sleep`, whose budget nothing else takes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from analysis.analyses.common import Frames
from analysis.analyses.live import TRITON_SUM, request_phases
from analysis.load.tracedb import TraceFilter, load_traces
from bench import perf_analyzer
from sidecar.trace import schema
from sidecar.trace.spans import Level, Source
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import wait_until
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton, pytest.mark.slow]

BUDGET = 3  # profiles per model per minute
N_CNN, N_JSON = 4, 3  # simple_cnn calls (tritonclient.http, binary), add_sub calls (curl, JSON)
FORCED_TRIES = 3  # Triton 2.51 now and then exports no spans for a request: force another
PA_REQUESTS = 150
HTTP = {"protocol": "http", "method": "ModelInfer"}


def triton_successes(triton: TritonServer, model: str) -> int:
    """Triton's own count of `model`'s successful inferences (its statistics extension, asked
    directly, not through the sidecar)."""
    client = httpclient.InferenceServerClient(triton.http_address)
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def curl(url: str, body: object | None = None, headers: dict[str, str] | None = None) -> Any:
    """`curl` with a JSON body (POST) or none (GET): (status, parsed JSON body or None)."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (apt-get install curl)")
    cmd = ["curl", "-sS", "-w", "\n%{http_code}", "--max-time", "30"]
    for name, value in (headers or {}).items():
        cmd += ["-H", f"{name}: {value}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    done = subprocess.run([*cmd, url], capture_output=True, text=True, check=True, timeout=40)
    text, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(text) if text else None


def add_sub_json(a: list[float], b: list[float]) -> dict[str, object]:
    return {
        "inputs": [
            {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": a},
            {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": b},
        ]
    }


def sleep_json(delay_ms: int) -> dict[str, object]:
    return {
        "inputs": [
            {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [0.0] * 4},
            {"name": "DELAY_MS", "shape": [1], "datatype": "INT32", "data": [delay_ms]},
        ]
    }


def cnn_inputs(batch: int) -> list[httpclient.InferInput]:
    x = httpclient.InferInput("input", [batch, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.random.default_rng(batch).random((batch, 3, 32, 32), np.float32))
    return [x]  # binary_data=True: the binary-tensor extension


@dataclass
class Traffic:
    """What the module's fixture sent through the sidecar, and what Triton counted of it."""

    proc: SidecarProcess
    db: Path
    sent: dict[str, int] = field(default_factory=dict)  # model -> calls through the sidecar
    served: dict[str, int] = field(default_factory=dict)  # model -> Triton's count of them
    forced: int = 0


@pytest.fixture(scope="module")
def traffic(
    traced_triton: TritonServer, tmp_path_factory: pytest.TempPathFactory, otlp_port: int
) -> Iterator[Traffic]:
    """The sidecar in front of Triton's gRPC and HTTP ports, after `N_CNN` simple_cnn calls
    over tritonclient.http (binary tensors), `N_JSON` add_sub calls with curl (JSON) and
    forced sleep calls (curl, JSON, the forced header) until one has Triton's spans."""
    tmp = tmp_path_factory.mktemp("rest-e2e")
    db = tmp / "traces.db"
    args = ["--model-repository", str(traced_triton.model_repository), "--db", str(db),
            "--otlp-port", str(otlp_port), "--sample-rate", "1", "--sample-budget", str(BUDGET),
            "--duty-cycle", "1", "--levels", "M", "--iterations", "1", "--warmup", "0",
            "--queue-size", "64"]  # fmt: skip
    proc = SidecarProcess(
        backend=traced_triton.grpc_address, log_path=tmp / "sidecar.log", args=args,
        http_backend=traced_triton.http_address,
    )  # fmt: skip
    with proc:
        models = ("simple_cnn", "add_sub", "sleep")
        before = {m: triton_successes(traced_triton, m) for m in models}
        run = Traffic(proc, db)
        client = httpclient.InferenceServerClient(proc.http_address)
        direct = httpclient.InferenceServerClient(traced_triton.http_address)
        for batch in range(1, N_CNN + 1):
            got = client.infer("simple_cnn", cnn_inputs(batch)).as_numpy("output")
            want = direct.infer("simple_cnn", cnn_inputs(batch)).as_numpy("output")
            assert got is not None and np.array_equal(got, want)  # the bytes went unchanged
        client.close()
        before["simple_cnn"] += N_CNN  # the direct calls
        direct.close()
        url = f"{proc.http_url}/v2/models/add_sub/infer"
        for i in range(N_JSON):
            a, b = [float(i + k) for k in range(16)], [1.0] * 16
            status, body = curl(url, add_sub_json(a, b))
            assert status == 200, body
            outputs = {o["name"]: o["data"] for o in body["outputs"]}
            assert outputs == {"OUTPUT0": [x + 1 for x in a], "OUTPUT1": [x - 1 for x in a]}
        store = TraceStore(db)
        try:
            for run.forced in range(1, FORCED_TRIES + 1):
                sleep_url = f"{proc.http_url}/v2/models/sleep/infer"
                status, body = curl(sleep_url, sleep_json(20), {"x-xsp-profile": "1"})
                assert status == 200, body
                if wait_until(lambda: joined(store, "sleep", "forced"), 30):
                    break
            # the sampled simple_cnn calls' spans came in the same exports, or soon after
            wait_until(lambda: joined(store, "simple_cnn", "rate"), 30)
        finally:
            store.close()
        run.sent = {"simple_cnn": N_CNN, "add_sub": N_JSON, "sleep": run.forced}
        run.served = {m: triton_successes(traced_triton, m) - before[m] for m in models}
        yield run


def joined(store: TraceStore, model: str, reason: str) -> list[str]:
    """Traces of `model` sampled for `reason` whose Triton spans joined the relay's."""
    return [
        t.trace_id
        for t in store.list_traces(model=model)
        if t.sample_reason == reason
        and any(s.source is Source.BACKEND for s in store.spans(t.trace_id))
    ]


def test_every_rest_call_is_counted_under_its_model_as_triton_counts_it(
    traffic: Traffic,
) -> None:
    text = traffic.proc.metrics()
    for model, sent in traffic.sent.items():
        counted = traffic.proc.metric("xsp_requests_total", model=model, **HTTP)
        assert counted == sent == traffic.served[model], (model, text)
        grpc = traffic.proc.metric("xsp_requests_total", model=model, protocol="grpc")
        assert grpc == 0, model
        durations = traffic.proc.metric("xsp_request_duration_seconds_count", model=model, **HTTP)
        assert durations == sent, model
        assert traffic.proc.metric("xsp_request_bytes_total", model=model, **HTTP) > 0


def test_sampled_and_forced_rest_calls_are_profiled_with_a_joined_live_breakdown(
    traffic: Traffic,
) -> None:
    store = TraceStore(traffic.db)
    try:
        forced = joined(store, "sleep", "forced")
        sampled = joined(store, "simple_cnn", "rate")
        assert forced, traffic.proc.log()
        assert sampled, traffic.proc.log()
        for trace_id in [*forced, *sampled]:
            trace = store.get_trace(trace_id)
            assert trace is not None and trace.status == "ok", trace
            spans = store.spans(trace_id)
            (request,) = [s for s in spans if s.level is Level.REQUEST]
            assert request.source is Source.PROXY and request.kind == "ModelInfer"
            assert request.attributes[schema.PROTOCOL] == "http"
            server = [s for s in spans if s.source is Source.BACKEND]
            roots = [s for s in server if s.parent_id == request.span_id]
            assert len(roots) == 1 and roots[0].kind == "request"  # Triton's, via traceparent
            assert [s for s in spans if s.level is Level.MODEL]  # the replay ran
        # the sampled calls are the first BUDGET of simple_cnn's, and no more
        rate = [t for t in store.list_traces(model="simple_cnn") if t.sample_reason == "rate"]
        assert len(rate) == min(N_CNN, BUDGET)
    finally:
        store.close()
    data = load_traces([traffic.db], TraceFilter(include_errors=True))
    per = request_phases(Frames(data)).set_index("trace_id").loc[[*forced, *sampled]]
    assert per["relay_marks"].all() and per["unplaced"].isna().all(), per
    cols = [*TRITON_SUM, "backend_response", "server_after_response"]
    assert (per[cols].fillna(0.0) >= 0).all().all(), per[cols]
    total = per[list(TRITON_SUM)].fillna(0.0).sum(axis=1)
    assert np.allclose(total, per["client_total"], rtol=0.01), (total, per["client_total"])
    assert (per["backend_response"] <= per["client_total"]).all()
    sleeps = per.loc[forced, "backend_response"] / 1e6
    assert (sleeps >= 20).all(), sleeps  # the forced calls asked the model to sleep 20 ms


@pytest.mark.parametrize("mode", ["--sync", "--async"])
def test_perf_analyzer_over_http_counts_alike(
    traffic: Traffic, traced_triton: TritonServer, mode: str
) -> None:
    """perf_analyzer's default protocol (HTTP), through the sidecar's HTTP port: the requests
    it sent, the sidecar's count and Triton's own are one number."""
    binary = perf_analyzer.find_binary()
    if binary is None:
        pytest.skip("perf_analyzer is neither on PATH nor obtainable from tritonclient 2.51")
    proc = traffic.proc
    before = triton_successes(traced_triton, "add_sub")
    counted_before = proc.metric("xsp_requests_total", model="add_sub", **HTTP)
    with tempfile.TemporaryDirectory(prefix="xsp-pa-") as tmp:
        libs = perf_analyzer.library_dir(traced_triton.env().library_dir, Path(tmp))
        cmd = [
            binary, "-m", "add_sub", "-u", proc.http_address, mode,
            "--concurrency-range", "2:2", "--shape", "INPUT0:16", "--shape", "INPUT1:16",
            "--request-count", str(PA_REQUESTS),
        ]  # fmt: skip
        library_path = f"{libs}:{traced_triton.env().library_dir}"
        env = {"LD_LIBRARY_PATH": library_path, "PATH": "/usr/bin:/bin"}
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        except OSError as exc:
            pytest.skip(f"perf_analyzer cannot run here: {exc}")
        if done.returncode != 0 and "error while loading shared libraries" in done.stderr:
            pytest.skip(f"perf_analyzer cannot run here: {done.stderr.strip()}")
        assert done.returncode == 0, done.stdout + done.stderr
    # with --request-count, perf_analyzer sends exactly that many (no warm-up, no windows)
    reported = re.search(r"Client: \n +Request count: (\d+)", done.stdout)
    assert reported, done.stdout
    served = triton_successes(traced_triton, "add_sub") - before
    counted = proc.metric("xsp_requests_total", model="add_sub", **HTTP) - counted_before
    assert int(reported.group(1)) == PA_REQUESTS == counted == served
    ok = proc.metric("xsp_requests_total", model="add_sub", grpc_code="OK", **HTTP)
    assert ok == proc.metric("xsp_requests_total", model="add_sub", **HTTP)


def test_sigterm_lets_a_rest_call_in_flight_finish(
    traced_triton: TritonServer, tmp_path: Path
) -> None:
    """SIGTERM to the real process while a REST call is at Triton (sleep, 800 ms): the call
    finishes within the grace period, then the process exits 0."""
    proc = SidecarProcess(
        backend=traced_triton.grpc_address, log_path=tmp_path / "sidecar.log",
        http_backend=traced_triton.http_address, args=["--grace-period", "10"],
    )  # fmt: skip
    with proc:
        url = f"{proc.http_url}/v2/models/sleep/infer"
        answers: list[tuple[int, Any]] = []
        call = threading.Thread(target=lambda: answers.append(curl(url, sleep_json(800))))
        call.start()
        assert wait_until(lambda: proc.metric("xsp_requests_in_flight") >= 1, 5, 0.02)
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        call.join(15)
        assert proc.process is not None and proc.process.wait(15) == 0, proc.log()
        took = time.monotonic() - started
    assert [status for status, _ in answers] == [200], answers
    assert took < 5, took  # it waited for the call, not for the whole grace period
