"""Hold mode (sampling on) copies only what it has picked (issue 44, part 7).

A request the sampler did not pick is forwarded as it was read, however large: every piece
`FrameScanner.process` returns for its reads is the read itself, and scanning it allocates no
more than a frame's worth. A picked one is copied where it must be: its HEADERS frame
re-emitted with a traceparent, the rest of that read after it, and its captured body. Both
scanners, the C walk's and the pure-Python reference.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2

from sidecar.proxy import frames
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionTracker
from tests.proxy.proxy_h2build import Conversation
from tests.proxy.test_framewalk_streams import Hook
from tests.proxy.test_proxy_relay import INFER

READ = 256_000  # the relay's receive buffer (uvloop's UV_STREAM_RECV_BUF_SIZE)
TENSOR = 2 * 1024 * 1024
# Hook: stream 3 a QuietEnd, 5 left alone (both unpicked), 7 picked (traceparent, body)
UNPICKED, PICKED = (3, 5), 7


@pytest.fixture(params=["c walk", "python"])
def walk(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.param == "c walk" and frames.native_walk is None:
        pytest.skip("the C frame walker is not built here")
    saved = frames.native_walk
    if request.param == "python":
        frames.native_walk = None
    yield
    frames.native_walk = saved


def large_request() -> bytes:
    req = service_pb2.ModelInferRequest(model_name="m", id="x")
    req.inputs.add(name="INPUT0", datatype="UINT8", shape=[TENSOR])
    req.raw_input_contents.append(bytes(range(256)) * (TENSOR // 256))
    return req.SerializeToString()


def test_hold_mode_copies_only_the_requests_it_has_picked(walk: None) -> None:
    conv = Conversation()
    body = large_request()
    spans = {}  # stream id -> its bytes' [start, end) in the client's direction
    for sid in (*UNPICKED, PICKED):
        start = len(conv.client)
        conv.request(sid, INFER, body)
        spans[sid] = (start, len(conv.client))
    data = bytes(conv.client)
    hook = Hook(4 * TENSOR)
    scanner = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook).request_scanner
    assert scanner.hold
    first = spans[UNPICKED[0]][0]
    assert b"".join(scanner.process(data[:first])) == data[:first]  # preface, settings

    copied: dict[int, int] = dict.fromkeys(spans, 0)  # bytes forwarded not as read, by stream
    peak = dict.fromkeys(spans, 0)  # scanning's traced peak over a stream's reads
    tracemalloc.start()
    try:
        for at in range(first, len(data), READ):
            read = data[at : at + READ]
            tracemalloc.reset_peak()
            held = tracemalloc.get_traced_memory()[0]  # the read itself, the last pieces
            pieces = scanner.process(read)
            traced = tracemalloc.get_traced_memory()[1] - held
            touched = [sid for sid, (a, b) in spans.items() if a < at + len(read) and at < b]
            assert b"".join(pieces) == read or PICKED in touched
            if PICKED in touched:  # a read that ends one unpicked and starts the picked one
                touched = [PICKED]
            for sid in touched:
                copied[sid] += sum(len(p) for p in pieces if p is not read)
                peak[sid] = max(peak[sid], traced)
    finally:
        tracemalloc.stop()
    for sid in UNPICKED:
        assert copied[sid] == 0, f"stream {sid} (unpicked) was copied"
        assert peak[sid] < 64 * 1024, f"scanning stream {sid} (unpicked) allocated {peak[sid]}"
    (captured,) = [seen[3] for seen in hook.seen if seen[:2] == ("body", PICKED)]
    assert len(captured) == len(body) + 5  # the gRPC message, kept for the replay
    assert copied[PICKED] > 0 and peak[PICKED] > TENSOR
