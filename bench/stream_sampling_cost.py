"""What deciding on each message of an inference stream costs the relay, in-process.

Feeds the same `ModelStreamInfer` traffic (one `add_sub`-sized request message and its
response per inference, as the relay hands them over) through the relay's real pending table
(`StreamInferences`) with no sampling hook (no `--model-repository`), and with the sampling
observer's per-message hook (`StreamSampling`) at rate 0 (every message a coin flip, counted)
and at rate 0.01 with budget 0 (the coin comes up 1 % of the time: the message is copied and
the budget refuses it). Prints µs per inference of each and its ratio to no hook; the best of
`--repeat` rounds, the rounds alternated.

    python bench/stream_sampling_cost.py --inferences 20000 --repeat 5 [--pure-python]

`--pure-python` reads the messages with the pure-Python readers (`stream_messages`), the
fallback where the C message walker (`_messagewalk.c`) is not built.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2

from sidecar.backends.replayability import REPLAYABLE, Replayability
from sidecar.proxy import stream_messages
from sidecar.proxy.inferences import StreamInferences
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import RequestStart
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings

PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


def framed(message: bytes) -> bytes:
    return b"\0" + len(message).to_bytes(4, "big") + message


def traffic() -> tuple[bytes, bytes]:
    req = service_pb2.ModelInferRequest(model_name="add_sub", id="")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[4])
        req.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    resp = service_pb2.ModelStreamInferResponse()
    resp.infer_response.model_name = "add_sub"
    for name in ("OUTPUT0", "OUTPUT1"):
        resp.infer_response.outputs.add(name=name, datatype="FP32", shape=[4])
        resp.infer_response.raw_output_contents.append(np.ones(4, np.float32).tobytes())
    return framed(req.SerializeToString()), framed(resp.SerializeToString())


class Handler:
    """The hub's handler with nothing behind it (no job is ever accepted: budget 0)."""

    def model_label(self, model: str | None) -> str:
        return model or "_unknown"

    def known_model(self, model: str) -> bool:
        return True

    def sequence_model(self, model: str) -> bool:
        return False

    def on_sampled(self, *args: object) -> None: ...

    def replayability(self, model: str) -> Replayability:
        return REPLAYABLE

    def keep_live(self, *args: object) -> bool:
        return False

    def submit(self, job: object) -> bool:
        return False

    def remember(self, *args: object) -> None: ...

    def store_spans(self, *args: object) -> bool:
        return True

    def record_exemplar(self, *args: object) -> None: ...


def table(rate: float | None) -> StreamInferences:
    inf = StreamInferences(ProxyMetrics(CollectorRegistry()), "ModelStreamInfer")
    if rate is not None:
        settings = SamplingSettings(rate=rate, budget_per_minute=0.0, duty_cycle=1.0)
        hub = SamplingHub(Sampler(settings), SamplingMetrics(CollectorRegistry()), Handler())
        start = RequestStart(1, 1, PATH, "ModelStreamInfer", [(b":path", PATH.encode())])
        decision = hub.observer_factory(None).on_request_headers(start)  # type: ignore[arg-type]
        assert decision is not None and decision.messages is not None
        inf.sample_with(decision.messages)
    return inf


def run(rate: float | None, n: int, request: bytes, response: bytes) -> float:
    inf = table(rate)
    t0 = time.perf_counter()
    for _ in range(n):
        inf.request_data(request)
        inf.response_data(response)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inferences", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pure-python", action="store_true", help="without the C message walker")
    args = parser.parse_args()
    if args.pure_python:
        stream_messages.native_readers = None
    print(f"message reading: {'C' if stream_messages.native_readers else 'pure Python'}")
    request, response = traffic()
    cases = {"no hook": None, "rate 0": 0.0, "rate 0.01, budget 0": 0.01}
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeat):
        for name, rate in cases.items():
            best[name] = min(best[name], run(rate, args.inferences, request, response))
    base = best["no hook"]
    for name, us in best.items():
        print(f"{name:22s} {us:7.2f} µs/inference  x{us / base:.2f}")


if __name__ == "__main__":
    main()
