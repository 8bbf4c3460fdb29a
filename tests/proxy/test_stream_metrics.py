"""The stream metrics' /metrics text against prometheus_client's own metric types.

`StreamMetrics` keeps plain counters and turns them into families at scrape time; its text
must be what prometheus_client's `Histogram`, `Counter` and `Gauge` write for the same
observations (their `_created` samples aside), with the names, help and labels of
docs/contracts.md.
"""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sidecar.proxy.metrics import DURATION_BUCKETS
from sidecar.proxy.stream_metrics import STREAM_BUCKETS, StreamMetrics

PAIR = ["method", "model"]
FIRST = "Streamed inferences: from the request message to its first response."
GAP = "Streamed inferences: time between two responses to one request (per token)."
RESPONSES = (
    "Streamed inferences: responses with data or an error (an empty final response is not counted)."
)
UNSEEN = (
    "Streamed inferences ended at their last response seen: the client did not ask for empty "
    "final responses, so the final one could not be observed."
)
STREAMS = "Inference streams ended, by method and the stream's gRPC status."
LIFETIME = "Inference streams: from the stream's request headers to its end."
MESSAGES = "Messages on ended inference streams, by direction (request, response)."
OPEN = "Inference streams open now."


def text(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "_created" not in line and "xsp_stream_anomalies" not in line]


def test_families_match_prometheus_client() -> None:
    rng = random.Random(23)
    registry = CollectorRegistry()
    ours = StreamMetrics(registry, DURATION_BUCKETS)
    ref = CollectorRegistry()
    first = Histogram("xsp_first_response_seconds", FIRST, PAIR, registry=ref,
                      buckets=DURATION_BUCKETS)  # fmt: skip
    gaps = Histogram("xsp_response_gap_seconds", GAP, PAIR, registry=ref, buckets=DURATION_BUCKETS)
    responses = Counter("xsp_responses", RESPONSES, PAIR, registry=ref)
    unseen = Counter("xsp_final_response_unseen", UNSEEN, PAIR, registry=ref)
    streams = Counter("xsp_streams", STREAMS, ["method", "grpc_code"], registry=ref)
    lifetime = Histogram("xsp_stream_duration_seconds", LIFETIME, ["method"], registry=ref,
                         buckets=STREAM_BUCKETS)  # fmt: skip
    messages = Counter("xsp_stream_messages", MESSAGES, ["method", "direction"], registry=ref)
    open_ = Gauge("xsp_streams_open", OPEN, ["method"], registry=ref)
    methods = ["ModelStreamInfer", "Other"]
    for _ in range(300):
        pair = (rng.choice(methods), rng.choice(["a", "b", "c"]))
        seconds = rng.expovariate(20)
        what = rng.randrange(5)
        if what == 0:
            ours.histogram(ours.first_response, pair).observe(seconds)
            first.labels(*pair).observe(seconds)
        elif what == 1:
            ours.histogram(ours.gaps, pair).observe(seconds)
            gaps.labels(*pair).observe(seconds)
        elif what == 2:
            ours.responses[pair] = ours.responses.get(pair, 0) + 1
            responses.labels(*pair).inc()
            ours.final_unseen[pair] = ours.final_unseen.get(pair, 0) + 1
            unseen.labels(*pair).inc()
        elif what == 3:
            ours.stream_opened(pair[0])
            open_.labels(pair[0]).inc()
        else:
            code, lived = rng.choice(["OK", "CANCELLED"]), rng.expovariate(0.01)
            sent, received = rng.randrange(100), rng.randrange(100)
            ours.stream_ended(pair[0], code, lived, sent, received)
            open_.labels(pair[0]).dec()
            streams.labels(pair[0], code).inc()
            lifetime.labels(pair[0]).observe(lived)
            messages.labels(pair[0], "request").inc(sent)
            messages.labels(pair[0], "response").inc(received)
    assert text(registry) == text(ref)
