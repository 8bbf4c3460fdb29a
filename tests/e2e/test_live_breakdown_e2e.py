"""The live breakdown on the relay's own clock, end to end: the real Triton 2.51 in
OpenTelemetry mode, the real `xsp-sidecar serve`, sampled requests of the Python-backend
models (`add_sub`, `simple_cnn`: ONNX Runtime inside the Python backend; `sleep`, which
answers after the delay it is asked for).

Triton stamps COMPUTE_END and REQUEST_END when it releases the request, after the response
left; placed on the relay's marks, every phase is >= 0, the phases add up to the client's
latency, and the work after the response is `server_after_response`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tritonclient.grpc as grpcclient

from analysis.analyses.common import Frames
from analysis.analyses.live import TRITON_SUM, request_phases
from analysis.load.tracedb import TraceFilter, load_traces
from analysis.trace_analysis import TraceAnalysis
from sidecar.trace.spans import Level, Source
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton, pytest.mark.slow]

DELAY_MS = 60
N_ADD_SUB = 6
N_CNN = 4
N_SLEEP = 3
N_ALL = N_ADD_SUB + N_CNN + N_SLEEP
SLEEP_ROUNDS = 3  # rounds of sleep requests sent at most (see `sampled`)


def add_sub(client: grpcclient.InferenceServerClient) -> None:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        x = grpcclient.InferInput(name, [16], "FP32")
        x.set_data_from_numpy(np.arange(16, dtype=np.float32))
        inputs.append(x)
    client.infer("add_sub", inputs)


def sleep(client: grpcclient.InferenceServerClient, delay_ms: int) -> None:
    x = grpcclient.InferInput("INPUT0", [4], "FP32")
    x.set_data_from_numpy(np.zeros(4, dtype=np.float32))
    d = grpcclient.InferInput("DELAY_MS", [1], "INT32")
    d.set_data_from_numpy(np.array([delay_ms], dtype=np.int32))
    client.infer("sleep", [x, d])


def with_backend_spans(store: TraceStore) -> set[str]:
    return {
        t.trace_id
        for t in store.list_traces()
        if any(s.source is Source.BACKEND and s.kind == "request" for s in store.spans(t.trace_id))
    }


def sleep_traces_with_spans(store: TraceStore) -> int:
    sleeps = {t.trace_id for t in store.list_traces(model="sleep")}
    return len(sleeps & with_backend_spans(store))


@pytest.fixture(scope="module")
def sampled(
    traced_triton: TritonServer, tmp_path_factory: pytest.TempPathFactory, otlp_port: int
) -> Path:
    """A store of sampled add_sub and sleep requests with Triton's spans."""
    tmp = tmp_path_factory.mktemp("live-breakdown")
    db = tmp / "traces.db"
    args = ["--model-repository", str(traced_triton.model_repository), "--db", str(db),
            "--otlp-port", str(otlp_port), "--sample-rate", "1", "--sample-budget", "1000",
            "--duty-cycle", "1",
            "--iterations", "1", "--warmup", "0", "--queue-size", "64"]  # fmt: skip
    with SidecarProcess(
        backend=traced_triton.grpc_address, log_path=tmp / "sidecar.log", args=args
    ) as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        for _ in range(N_ADD_SUB):
            add_sub(client)
        for _ in range(N_CNN):
            cnn_infer(client, batch=8)
        for _ in range(N_SLEEP):
            sleep(client, DELAY_MS)
        store = TraceStore(db)
        # Triton 2.51 now and then exports no trace at all (in one fresh-clone run fewer
        # than N_ALL - 2 arrived in 120 s): the checks below hold for every trace that did
        want = N_ALL // 2
        assert wait_until(lambda: len(with_backend_spans(store)) >= want, 120), proc.log()
        # the sleep requests are sent last, so their spans come last: the delay test needs one.
        # Triton now and then loses a whole export batch (in one fresh-clone run none of the
        # three sleep traces' spans arrived in 120 s while every earlier trace's had): send
        # the sleep requests again, each round in a batch of its own, before giving up
        for _ in range(SLEEP_ROUNDS - 1):
            if wait_until(lambda: sleep_traces_with_spans(store) >= 1, 40):
                break
            for _ in range(N_SLEEP):
                sleep(client, DELAY_MS)
        assert wait_until(lambda: sleep_traces_with_spans(store) >= 1, 60), proc.log()
        wait_until(lambda: len(with_backend_spans(store)) == N_ALL, 10)
        store.close()
    return db


def phases(db: Path) -> pd.DataFrame:
    data = load_traces([db], TraceFilter(include_errors=True))  # a replay may fail: no matter
    return request_phases(Frames(data)).set_index("trace_id")


def test_phases_add_up_to_the_client_latency_and_none_is_negative(sampled: Path) -> None:
    per = phases(sampled)
    placed = per[per["network_proxy"].notna()]
    assert len(placed) >= N_ALL // 2
    assert per["unplaced"].isna().all(), per["unplaced"].dropna().to_dict()
    assert per["relay_marks"].all()
    cols = [*TRITON_SUM, "backend_response", "server_after_response"]
    assert (placed[cols].fillna(0.0) >= 0).all().all(), placed[cols]
    total = placed[list(TRITON_SUM)].fillna(0.0).sum(axis=1)
    assert np.allclose(total, placed["client_total"], rtol=0.01), (total, placed["client_total"])
    # the relay's view: the backend answered inside the client's latency
    assert (placed["backend_response"] <= placed["client_total"]).all()


def test_work_after_the_response_is_shown_apart(sampled: Path) -> None:
    """Where Triton's spans end after the response's first byte reached the relay, that
    time is `server_after_response` (and only there)."""
    per = phases(sampled)
    store = TraceStore(sampled)
    try:
        after: dict[str, float] = {}
        for trace_id in per.index:
            spans = store.spans(trace_id)
            (request,) = [s for s in spans if s.level is Level.REQUEST]
            first_byte = request.attributes["relay_response_start_ns"]
            last_end = max((s.end_ns for s in spans if s.level is Level.SERVER), default=None)
            if last_end is not None:
                after[trace_id] = max(last_end - first_byte, 0)
    finally:
        store.close()
    assert after and any(v > 0 for v in after.values()), after  # Triton stamps its ends late
    for trace_id, ns in after.items():
        assert per.loc[trace_id, "server_after_response"] == pytest.approx(ns, abs=1)
    res = TraceAnalysis.from_paths([sampled], TraceFilter(include_errors=True)).result(
        "live_breakdown"
    )
    table = res.table
    assert set(table["phase"]) >= {"client_total", "backend_response", "server_after_response"}
    assert (table["mean_ms"] >= 0).all()


def test_the_backends_time_to_respond_is_the_delay(sampled: Path) -> None:
    data = load_traces([sampled], TraceFilter(models=("sleep",), include_errors=True))
    per = request_phases(Frames(data))
    assert len(per) >= 1
    respond_ms = per["backend_response"] / 1e6
    infer_ms = per["compute_infer"] / 1e6  # the model's execute, on Triton's clock
    # The model sleeps DELAY_MS in 5 ms polls, which oversleep on a busy machine; Triton's
    # own compute_infer says by how much. The relay's time to respond holds it, plus Triton's
    # queue, input/output copies, the Python backend's IPC and two loopback hops. How much
    # the sleep itself oversleeps depends on the machine's load (up to 2x seen on 2 busy
    # cores), so the delay is checked against the backend's own measure of its sleep.
    assert (respond_ms >= DELAY_MS).all(), respond_ms
    gap = (respond_ms - infer_ms).dropna()  # requests whose Triton spans arrived
    assert len(gap) >= 1 and ((gap >= 0) & (gap < 10)).all(), (respond_ms, infer_ms)
    assert (respond_ms <= 10 * DELAY_MS).all(), respond_ms  # (no tighter bound: see above)
    # the client's latency holds the backend's time to respond, and little else
    assert ((per["client_total"] - per["backend_response"]) / 1e6 < 20).all()


def test_fidelity_of_the_sampled_requests(sampled: Path) -> None:
    """Each sampled simple_cnn request (ONNX Runtime inside a Python-backend model) has its
    replay compared with Triton's own compute_infer; the differences name the Python backend;
    the batches Triton executed around each request were read from its statistics."""
    ta = TraceAnalysis.from_paths([sampled], TraceFilter(models=("simple_cnn",)))
    fd = ta.result("fidelity")
    assert fd.ok, fd.reason
    (row,) = fd.table.itertuples(index=False)
    assert row.batch_size == 8 and row.requests >= 1
    assert "Python-backend model" in row.differences
    store = TraceStore(sampled)
    try:
        traces = store.list_traces(model="simple_cnn")
    finally:
        store.close()
    found = [t.attributes.get("fidelity") for t in traces]
    compared = [f for f in found if f and f["ratio"] is not None]
    assert len(compared) == row.requests
    # a trace with the replay and Triton's compute is whole: the relay's span came too
    for t in traces:
        if (t.attributes.get("fidelity") or {}).get("ratio") is not None:
            assert t.attributes["assembly"] == {"state": "whole", "missing": [], "why": ""}
    for f in compared:
        assert f["live_source"] == "compute_infer" and f["live_compute_ns"] > 0
        assert f["ratio"] == pytest.approx(f["replay_model_ns"] / f["live_compute_ns"])
    windows = [f["server_batch_window"] for f in found if f and "server_batch_window" in f]
    observed = [w for w in windows if "unobserved" not in w]
    assert observed, windows
    for w in observed:  # a window may also hold the requests right after it (one client)
        assert w["batch_sizes"] == {"8": w["executions"]}, w
        assert w["inferences"] == 8 * w["executions"] and w["closed_after_response_ms"] >= 0, w
