"""What sampling costs the relay's scan per unary call, replayed hot in-process.

Builds one HTTP/2 connection's bytes of `--calls` unary `ModelInfer` calls on `add_sub`
(HPACK-encoded headers, one request chunk and one response chunk per call, as the relay reads
them) and feeds them through a fresh `ConnectionTracker`, the way the relay does: sampling off
(no hook: both directions observed), and sampling on at its default settings (the real
`SamplingHub` hook; the client's direction in hold mode, `FrameScanner.process`) with the C
frame walker and with the pure-Python scanner alone. Prints µs per call of each (the best of
`--repeat` rounds, the cases alternated) and its difference to sampling off. No sockets: the
live relay pays several times these numbers (docs/benchmarks.md, relay_breakdown).

    python bench/hold_replay.py --calls 5000 --repeat 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from hpack import Encoder
from prometheus_client import CollectorRegistry
from stream_sampling_cost import Handler, framed  # the bench beside this one
from tritonclient.grpc import service_pb2

from sidecar.proxy import frames
from sidecar.proxy.frames import DATA, FLAG_END_STREAM, PREFACE, SETTINGS, frame_header
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionObserver, ConnectionTracker
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings

INFER = "/inference.GRPCInferenceService/ModelInfer"


def connection(calls: int) -> tuple[list[bytes], list[bytes]]:
    """The client's and the backend's chunks: the connection preface, then one per call."""
    req = service_pb2.ModelInferRequest(model_name="add_sub")
    resp = service_pb2.ModelInferResponse(model_name="add_sub")
    for i in range(2):
        req.inputs.add(name=f"INPUT{i}", datatype="FP32", shape=[16])
        req.raw_input_contents.append(np.ones(16, np.float32).tobytes())
        resp.outputs.add(name=f"OUTPUT{i}", datatype="FP32", shape=[16])
        resp.raw_output_contents.append(np.ones(16, np.float32).tobytes())
    request, response = (
        framed(req.SerializeToString()),
        framed(resp.SerializeToString()),
    )
    client, server = Encoder(), Encoder()
    settings = frame_header(0, SETTINGS, 0, 0)
    requests, responses = [PREFACE + settings], [settings]
    for sid in range(1, 2 * calls, 2):
        headers = client.encode(
            [(":method", "POST"), (":scheme", "http"), (":path", INFER),
             (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")]
        )  # fmt: skip
        requests.append(
            frames.header_frames(sid, headers, end_stream=False, max_frame_size=16384)
            + frame_header(len(request), DATA, FLAG_END_STREAM, sid)
            + request
        )
        head = server.encode([(":status", "200"), ("content-type", "application/grpc")])
        trailers = server.encode([("grpc-status", "0")])
        responses.append(
            frames.header_frames(sid, head, end_stream=False, max_frame_size=16384)
            + frame_header(len(response), DATA, 0, sid)
            + response
            + frames.header_frames(sid, trailers, end_stream=True, max_frame_size=16384)
        )
    return requests, responses


def default_hook() -> ConnectionObserver:
    hub = SamplingHub(Sampler(SamplingSettings()), SamplingMetrics(CollectorRegistry()), Handler())
    return hub.observer_factory(None)  # type: ignore[arg-type]


def run(
    hook: Callable[[], ConnectionObserver] | None, chunks: tuple[list[bytes], list[bytes]]
) -> float:
    """µs per call of scanning `chunks` as the relay does (hold mode when there is a hook)."""
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook and hook())
    request, response = tracker.request_scanner, tracker.response_scanner
    scan = request.process if request.hold else request.observe
    t0 = time.thread_time()
    for out, back in zip(*chunks, strict=True):
        scan(out)
        response.observe(back)
    spent = time.thread_time() - t0
    if tracker.failed or tracker.in_flight:
        raise RuntimeError("the replayed connection was not observed whole")
    return spent / (len(chunks[0]) - 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    chunks = connection(args.calls)
    built = frames.native_walk
    cases: dict[str, tuple[Callable[[], ConnectionObserver] | None, object]] = {
        "sampling off": (None, built),
        "sampling on, C walk": (default_hook, built),
        "sampling on, Python": (default_hook, None),
    }
    if built is None:
        print("the C frame walker is not built here: pure Python only")
        del cases["sampling on, C walk"]
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.repeat):
        for name, (hook, walker) in cases.items():
            frames.native_walk = walker  # type: ignore[assignment]
            best[name] = min(best[name], run(hook, chunks))
    frames.native_walk = built
    base = best["sampling off"]
    for name, us in best.items():
        print(f"{name:22s} {us:7.2f} µs/call  {us - base:+6.2f} vs off")


if __name__ == "__main__":
    main()
