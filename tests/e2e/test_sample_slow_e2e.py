"""`--sample-slow` and forced samples end to end: a real Triton serves an ONNX model whose
latency is its input (a `Loop` whose trip count is an input tensor), the real sidecar samples at
rate 0 with a fixed slow threshold, and its real worker replays what it picked into a real
SQLite store: the traces are exactly the slow requests, with `sample_reason` `slow` (and
`forced` for a forced one). Below a full duty cycle, the forced and slow requests that come
while the worker is busy wait in its hold and are each profiled in turn."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper, numpy_helper

from sidecar.sampling.held import FORCED_HOLD, SLOW_HOLD
from sidecar.trace.spans import Level, Source
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import wait_until
from tests.harness.models import OPSET
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import TEMPLATES
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton, pytest.mark.slow]

WIDTH = 64
LOOP_CONFIG = f"""\
name: "loop"
backend: "python"
max_batch_size: 0
input [
  {{ name: "x" data_type: TYPE_FP32 dims: [ 1, {WIDTH} ] }},
  {{ name: "trips" data_type: TYPE_FP32 dims: [ 1 ] }}
]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1, {WIDTH} ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
FAST_TRIPS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
SLOW_TRIPS = (400000.0, 400001.0, 400002.0)  # about half a second each
SLOW_MS = "150"


def loop_onnx(seed: int = 0) -> onnx.ModelProto:
    """x [1, 64] -> y = tanh(y @ W) repeated `trips` times: compute scales with an input.
    `trips` is float (the sample repository's ONNX runner feeds float32) cast to int64."""
    w = np.random.default_rng(seed).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.1
    row = [1, WIDTH]
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["x_in", "W"], ["product"]),
            helper.make_node("Tanh", ["product"], ["x_out"]),
        ],
        "step",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, row),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, row),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["trips"], ["trips_int"], to=TensorProto.INT64),
            helper.make_node("Reshape", ["trips_int", "scalar"], ["count"]),
            helper.make_node("Loop", ["count", "", "x"], ["y"], body=body),
        ],
        "loop",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, row),
            helper.make_tensor_value_info("trips", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, row)],
        initializer=[
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(np.zeros(0, np.int64), "scalar"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def loop_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A running `tritonserver` serving only `loop`, through the sample ONNX runner."""
    root = tmp_path_factory.mktemp("loop-triton")
    version = root / "models" / "loop" / "1"
    version.mkdir(parents=True)
    (version.parent / "config.pbtxt").write_text(LOOP_CONFIG)
    (version / "model.py").write_text((TEMPLATES / "onnx_runner.py.tmpl").read_text())
    onnx.save(loop_onnx(), str(version / "model.onnx"))
    with TritonServer(model_repository=root / "models", log_path=root / "triton.log") as server:
        yield server


def infer(
    client: grpcclient.InferenceServerClient, trips: float, headers: dict[str, str] | None = None
) -> None:
    x = grpcclient.InferInput("x", [1, WIDTH], "FP32")
    x.set_data_from_numpy(np.full((1, WIDTH), 0.5, np.float32))
    count = grpcclient.InferInput("trips", [1], "FP32")
    count.set_data_from_numpy(np.array([trips], np.float32))
    client.infer("loop", [x, count], headers=headers)


def stored_trips(store: TraceStore) -> dict[float, str]:
    """The trip count each stored trace replayed (from its raw inputs) -> its sample_reason."""
    found = {}
    for trace in store.list_traces():
        raw = trace.attributes["raw_inputs"]["trips"]
        (value,) = np.frombuffer(base64.b64decode(raw["data_base64"]), raw["dtype"])
        found[float(value)] = trace.sample_reason
    return found


def sidecar(triton: TritonServer, tmp_path: Path, slow: str, duty: str = "1") -> SidecarProcess:
    """The sidecar at rate 0 with `--sample-slow slow`; it replays the model level once."""
    args = [
        "--model-repository", str(triton.model_repository), "--db", str(tmp_path / "traces.db"),
        "--otlp-port", "0", "--sample-rate", "0", "--sample-slow", slow,
        "--sample-budget", "1000", "--duty-cycle", duty, "--queue-size", "50",
        "--levels", "M", "--iterations", "1", "--warmup", "0", "--store-raw-inputs",
    ]  # fmt: skip
    return SidecarProcess(backend=triton.grpc_address, log_path=tmp_path / "sidecar.log", args=args)


def test_the_slow_requests_are_the_ones_profiled(loop_triton: TritonServer, tmp_path: Path) -> None:
    db = tmp_path / "traces.db"
    with sidecar(loop_triton, tmp_path, SLOW_MS) as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        for fast in FAST_TRIPS[:3]:
            infer(client, fast)
        for slow, fast in zip(SLOW_TRIPS, FAST_TRIPS[3:], strict=True):
            infer(client, slow)
            infer(client, fast)
        infer(client, 7.0, headers={"x-xsp-profile": "1"})  # fast, forced
        store = TraceStore(db)
        wanted = {**dict.fromkeys(SLOW_TRIPS, "slow"), 7.0: "forced"}
        assert wait_until(lambda: wanted.items() <= stored_trips(store).items(), 120), (
            proc.log_tail()
        )
        found = stored_trips(store)
        # a fast request the relay saw answered after SLOW_MS (a loaded machine) is slow too:
        # profiled as such, its request span says so below
        late = {trips: reason for trips, reason in found.items() if trips not in wanted}
        assert set(late) <= set(FAST_TRIPS) and set(late.values()) <= {"slow"}, found
        for trace in store.list_traces():
            assert trace.status == "ok", trace.error
            spans = store.spans(trace.trace_id)
            (request,) = [s for s in spans if s.level is Level.REQUEST]
            assert request.source is Source.PROXY and request.attributes["model"] == "loop"
            assert request.span_id == trace.attributes["request_span_id"]
            if trace.sample_reason == "slow":  # the request span is the slow response
                assert request.end_ns - request.start_ns > float(SLOW_MS) * 1e6

        def sampled(reason: str) -> float:
            return proc.metric("xsp_sampled_total", model="loop", reason=reason)

        slow = len(SLOW_TRIPS) + len(late)
        assert (sampled("slow"), sampled("forced"), sampled("rate")) == (slow, 1, 0)
        decisions = "xsp_sampling_decisions_total"
        assert proc.metric(decisions, model="loop", decision="sampled") == slow + 1
        skipped = len(FAST_TRIPS) - len(late)
        assert proc.metric(decisions, model="loop", decision="skipped_rate") == skipped


def test_with_p99_the_requests_slower_than_the_models_first_100_are_profiled(
    loop_triton: TritonServer, tmp_path: Path
) -> None:
    """The rolling p99 gives no threshold before 100 responses (so none of the first 100 is
    profiled) and is next recomputed at the 150th: the slow requests after the first 100 fast
    ones are judged against the fast ones' p99."""
    with sidecar(loop_triton, tmp_path, "p99") as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        infer(client, SLOW_TRIPS[0] + 10)  # slow, but no estimate yet
        for i in range(99):
            infer(client, FAST_TRIPS[i % len(FAST_TRIPS)])
        for slow in SLOW_TRIPS:
            infer(client, slow)
        store = TraceStore(tmp_path / "traces.db")
        assert wait_until(lambda: len(store.list_traces()) >= len(SLOW_TRIPS), 120)
        assert stored_trips(store) == dict.fromkeys(SLOW_TRIPS, "slow")
        assert proc.metric("xsp_sampled_total", model="loop", reason="slow") == len(SLOW_TRIPS)


def profiled_in_order(store: TraceStore) -> list[tuple[float, str]]:
    """(trip count, sample_reason) of each stored trace, in the order the worker ran them."""
    found = []
    for trace in sorted(store.list_traces(), key=lambda t: t.created_ns):
        raw = trace.attributes["raw_inputs"]["trips"]
        (value,) = np.frombuffer(base64.b64decode(raw["data_base64"]), raw["dtype"])
        found.append((float(value), trace.sample_reason))
    return found


FORCE = {"x-xsp-profile": "1"}
BUSY_TRIPS = 800000.0  # about a second to serve, and as long to replay


def test_forced_requests_sent_while_the_worker_is_busy_are_each_profiled_up_to_the_hold(
    loop_triton: TritonServer, tmp_path: Path
) -> None:
    """Duty cycle 0.5: one profile at a time, then as long a rest. Ten forced requests come
    while the first forced one's profile runs: the hold's 8 are profiled in turn, in the order
    they came; the 2 beyond it are dropped and counted."""
    with sidecar(loop_triton, tmp_path, "off", duty="0.5") as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        infer(client, BUSY_TRIPS, headers=FORCE)
        quick = [float(n) for n in range(1, 11)]
        for trips in quick:
            infer(client, trips, headers=FORCE)
        store = TraceStore(tmp_path / "traces.db")
        assert wait_until(lambda: len(store.list_traces()) >= 9, 120), proc.log_tail()
        held = FORCED_HOLD
        assert wait_until(lambda: proc.metric("xsp_profiles_total", outcome="ok") == held + 1, 60)
        assert profiled_in_order(store) == [(t, "forced") for t in (BUSY_TRIPS, *quick[:held])]
        assert proc.metric("xsp_samples_dropped_total", reason="hold_full") == 2
        assert proc.metric("xsp_sampling_decisions_total", decision="sampled") == 11
        assert proc.metric("xsp_sampling_decisions_total", decision="skipped_duty_cycle") == 0
        for trace in store.list_traces():
            assert trace.status == "ok", trace.error
            (request,) = store.spans(trace.trace_id, Level.REQUEST)
            assert request.span_id == trace.attributes["request_span_id"]


def test_slow_requests_met_while_the_worker_is_busy_are_profiled_slowest_first(
    loop_triton: TritonServer, tmp_path: Path
) -> None:
    """Duty cycle 0.2: the first slow request is profiled at once (about half a second), then
    the worker rests four times as long; the five slow ones after it come meanwhile: the four
    slowest are held (the fastest is pushed out and counted), then profiled the slowest
    first. (They are sent once the first profile is stored: sent during its replay, a request
    waits behind it on the model's one instance, and its latency, which orders the hold, is
    the replay's more than its own.)"""
    # 30 to 480 ms, 2x apart (1.5x was not enough: on two busy cores, the worker storing the
    # first profile slowed one live request by that much)
    later = (48000.0, 384000.0, 24000.0, 96000.0, 192000.0)
    with sidecar(loop_triton, tmp_path, "20", duty="0.2") as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        infer(client, SLOW_TRIPS[0])
        assert wait_until(lambda: proc.metric("xsp_profiles_total") >= 1, 120), proc.log_tail()
        for trips in later:
            infer(client, trips)
        store = TraceStore(tmp_path / "traces.db")
        slowest = sorted(later, reverse=True)[:SLOW_HOLD]
        # the worker rests 4x each profile's busy time: a loaded machine stretches both
        done = wait_until(lambda: proc.metric("xsp_profiles_total") >= 1 + SLOW_HOLD, 300)
        found = profiled_in_order(store)
        assert done, (found, proc.metric("xsp_samples_dropped_total"), proc.log_tail())
        assert found == [(t, "slow") for t in (SLOW_TRIPS[0], *slowest)], found
        assert proc.metric("xsp_samples_dropped_total", reason="hold_full") == 1
        assert proc.metric("xsp_sampled_total", model="loop", reason="slow") == 1 + SLOW_HOLD
