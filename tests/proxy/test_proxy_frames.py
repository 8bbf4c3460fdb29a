"""The incremental HTTP/2 scanner on real HPACK-encoded byte streams, split every which way.

Every test runs twice: with the C frame walker (`sidecar/proxy/_framewalk.c`) and with the
pure-Python scanner alone (`frames.native_walk = None`), the fallback where it is not built.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.events
import pytest
from hpack import Decoder, Encoder
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2

from sidecar.proxy import frames
from sidecar.proxy.frames import PREFACE, FrameScanner, frame_header
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import (
    ConnectionTracker,
    HeaderDecision,
    QuietEnd,
    RequestStart,
    StreamEnd,
)
from tests.harness.metrics_text import with_protocol
from tests.proxy.proxy_h2build import (
    Conversation,
    data_frames,
    goaway,
    grpc_message,
    headers_frames,
    request_headers,
    rst_stream,
    window_update,
)

INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(autouse=True, scope="module", params=["c-walker", "pure-python"])
def frame_walk(request: pytest.FixtureRequest) -> Iterator[str]:
    """Module-scoped (hypothesis refuses function-scoped fixtures around @given tests)."""
    built = frames.native_walk
    if request.param == "c-walker" and built is None:
        pytest.skip("the C frame walker is not built here (no C compiler at install time)")
    if request.param == "pure-python":
        frames.native_walk = None
    yield request.param
    frames.native_walk = built


def infer_request(model: str, n: int = 4) -> bytes:
    req = service_pb2.ModelInferRequest(model_name=model, id="r1")
    tensor = req.inputs.add(name="INPUT0", datatype="FP32", shape=[n])
    tensor.contents.fp32_contents.extend(float(i) for i in range(n))
    return req.SerializeToString()


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, with_protocol(name, labels)) or 0.0


def scan(
    client: bytes | bytearray,
    server: bytes | bytearray,
    splits: tuple[list[int], list[int]] | None = None,
):
    """Run both directions through a fresh tracker; chunks cut at the given offsets."""
    reg = CollectorRegistry()
    tracker = ConnectionTracker(ProxyMetrics(reg))
    for data, scanner, cuts in (
        (client, tracker.request_scanner, splits[0] if splits else []),
        (server, tracker.response_scanner, splits[1] if splits else []),
    ):
        edges = [0, *cuts, len(data)]
        for a, b in itertools.pairwise(edges):
            scanner.observe(bytes(data[a:b]))
    return reg, tracker


def two_calls() -> Conversation:
    conv = Conversation()
    conv.request(1, INFER, infer_request("add_sub"))
    conv.response(1, b"\x0a\x07add_sub")
    conv.request(3, INFER, infer_request("simple_cnn"), metadata=[("x-user", "a")])
    conv.response(3, None, status=5, message="Request for unknown model")
    return conv


def assert_two_calls(reg: CollectorRegistry, tracker: ConnectionTracker) -> None:
    assert not tracker.request_scanner.failed and not tracker.response_scanner.failed
    ok = dict(method="ModelInfer", model="add_sub", grpc_code="OK")
    nf = dict(method="ModelInfer", model="simple_cnn", grpc_code="NOT_FOUND")
    assert sample(reg, "xsp_requests_total", **ok) == 1
    assert sample(reg, "xsp_requests_total", **nf) == 1
    assert sample(reg, "xsp_requests_in_flight") == 0
    body = len(grpc_message(infer_request("add_sub")))
    assert sample(reg, "xsp_request_bytes_total", method="ModelInfer", model="add_sub") == body
    assert sample(reg, "xsp_response_bytes_total", method="ModelInfer", model="add_sub") == 14


def test_whole_conversation() -> None:
    conv = two_calls()
    assert_two_calls(*scan(conv.client, conv.server))


def test_split_at_every_byte_boundary() -> None:
    conv = two_calls()
    for i in range(len(conv.client) + 1):
        assert_two_calls(*scan(conv.client, conv.server, ([i], [min(i, len(conv.server))])))


def test_byte_by_byte() -> None:
    conv = two_calls()
    assert_two_calls(
        *scan(
            conv.client, conv.server, (list(range(len(conv.client))), list(range(len(conv.server))))
        )
    )


@pytest.mark.parametrize("pad", [0, 1, 17])
@pytest.mark.parametrize("priority", [False, True])
@pytest.mark.parametrize("split", [0, 3, 10])
def test_padding_priority_continuation(pad: int, priority: bool, split: int) -> None:
    conv = Conversation()
    for sid, model in ((1, "m_one"), (3, "m_two")):  # 2nd block uses the dynamic table
        conv.request(
            sid, INFER, infer_request(model), pad=pad, priority=priority, split=split, data_pad=pad
        )
        conv.response(sid, b"ok")
    for i in range(0, len(conv.client) + 1, 7):
        reg, tracker = scan(conv.client, conv.server, ([i], []))
        assert not tracker.request_scanner.failed
        for model in ("m_one", "m_two"):
            labels = dict(method="ModelInfer", model=model, grpc_code="OK")
            assert sample(reg, "xsp_requests_total", **labels) == 1


def test_rst_stream_goaway_and_connection_loss() -> None:
    conv = Conversation()
    for sid in (1, 3, 5, 7):
        conv.request(sid, INFER, infer_request("add_sub"))
    conv.client += rst_stream(1)
    conv.client += window_update(0)
    conv.server += goaway(3)
    reg, tracker = scan(conv.client, conv.server)
    assert sample(reg, "xsp_requests_total", method="ModelInfer", model="add_sub",
                  grpc_code="CANCELLED") == 1  # fmt: skip
    assert sample(reg, "xsp_requests_total", method="ModelInfer", model="add_sub",
                  grpc_code="UNAVAILABLE") == 2  # fmt: skip
    assert tracker.in_flight == 1
    tracker.close("CANCELLED")
    assert sample(reg, "xsp_requests_total", method="ModelInfer", model="add_sub",
                  grpc_code="CANCELLED") == 2  # fmt: skip
    assert sample(reg, "xsp_requests_in_flight") == 0


def test_large_body_is_not_copied_and_counts_bytes() -> None:
    conv = Conversation()
    body = infer_request("big", n=200_000)
    conv.request(1, INFER, body)
    conv.response(1, b"x")
    reg, _tracker = scan(conv.client, conv.server, ([5000, 70000, 300000], []))
    assert sample(reg, "xsp_request_bytes_total", method="ModelInfer", model="big") == len(body) + 5


def test_garbage_stops_observation_but_is_counted() -> None:
    reg = CollectorRegistry()
    tracker = ConnectionTracker(ProxyMetrics(reg))
    tracker.request_scanner.observe(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert tracker.request_scanner.failed and tracker.response_scanner.failed
    assert sample(reg, "xsp_observation_failures_total", reason="preface") == 1
    tracker.request_scanner.observe(b"more bytes")  # no exception after failure


class Injector:
    """Observer that marks every request for sampling and appends a traceparent."""

    def __init__(self) -> None:
        self.starts: list[RequestStart] = []
        self.bodies: list[tuple[int, str | None, bytes]] = []
        self.ends: list[StreamEnd] = []

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        self.starts.append(start)
        tp = f"00-{start.stream_id:032x}-{start.stream_id:016x}-01"
        return HeaderDecision(extra_headers=[("traceparent", tp)], capture_body=True)

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.bodies.append((stream_id, model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.ends.append(end)


def decode_blocks(stream: bytes) -> list[tuple[int, list[tuple[str, str]]]]:
    """Decode every request header block with a *fresh* h2 server (its own HPACK decoder)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    out = []
    for event in conn.receive_data(stream):
        if isinstance(event, h2.events.RequestReceived):
            out.append((event.stream_id, [(k.decode(), v.decode()) for k, v in event.headers]))
    return out


@pytest.mark.parametrize("chunk", [11, 1 << 20])  # split frames, and whole frames per chunk
@pytest.mark.parametrize(
    ("pad", "split", "max_frame"), [(0, 0, 16384), (9, 0, 16384), (0, 5, 16384), (3, 0, 40)]
)
def test_header_injection_round_trip(pad: int, split: int, max_frame: int, chunk: int) -> None:
    conv = Conversation()
    conv.request(1, INFER, infer_request("add_sub"), metadata=[("x-a", "1")], pad=pad, split=split)
    conv.request(3, INFER, infer_request("add_sub"), metadata=[("x-a", "1")], pad=pad, split=split)
    observer = Injector()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=observer)
    tracker.request_scanner.max_frame_size = max_frame
    client = bytes(conv.client)
    out = b""
    for i in range(0, len(client), chunk):
        out += b"".join(tracker.request_scanner.process(client[i : i + chunk]))
    assert tracker.request_scanner.pending_bytes() == 0
    blocks = decode_blocks(out)
    assert [sid for sid, _ in blocks] == [1, 3]
    for sid, headers in blocks:
        original = request_headers(INFER, [("x-a", "1")])
        assert headers[: len(original)] == original
        assert headers[len(original) :] == [("traceparent", f"00-{sid:032x}-{sid:016x}-01")]
    # bodies captured in full, model names read, headers seen
    assert [(s, m) for s, m, _ in observer.bodies] == [(1, "add_sub"), (3, "add_sub")]
    assert observer.bodies[0][2] == grpc_message(infer_request("add_sub"))
    assert observer.starts[0].metadata["x-a"] == "1" and observer.starts[0].method == "ModelInfer"
    # our own decoder still agrees with the client's encoder after injection
    assert not tracker.request_scanner.failed


def test_injected_block_decodes_with_fresh_hpack_decoder() -> None:
    encoder = Encoder()
    block = encoder.encode(request_headers(INFER))
    client = PREFACE + headers_frames(block, 1) + data_frames(grpc_message(b""), 1, end_stream=True)
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Injector())
    out = b"".join(tracker.request_scanner.process(client))
    length = int.from_bytes(out[24:27], "big")
    decoded = list(Decoder().decode(out[33 : 33 + length]))
    assert decoded[-1] == ("traceparent", f"00-{1:032x}-{1:016x}-01")
    assert decoded[:-1] == request_headers(INFER)


def test_observer_errors_never_reach_forwarding() -> None:
    class Broken(Injector):
        def on_request_headers(self, start: RequestStart) -> HeaderDecision:
            raise RuntimeError("boom")

    conv = two_calls()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Broken())
    out = b"".join(tracker.request_scanner.process(bytes(conv.client)))
    assert out == bytes(conv.client)


class Watcher(Injector):
    """Observer that captures bodies but adds no header fields."""

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        self.starts.append(start)
        return HeaderDecision(capture_body=True)


@settings(max_examples=150, deadline=None)
@given(
    prefix_valid=st.booleans(),
    junk=st.binary(max_size=400),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)
def test_random_bytes_never_raise_or_stop_forwarding(
    prefix_valid: bool, junk: bytes, cuts: list[int]
) -> None:
    conv = two_calls()
    stream = (bytes(conv.client[:60]) if prefix_valid else b"") + junk + bytes(conv.client)
    for hold in (False, True):
        reg = CollectorRegistry()
        observer = Watcher() if hold else None
        tracker = ConnectionTracker(ProxyMetrics(reg), observer=observer)
        scanner: FrameScanner = tracker.request_scanner
        edges = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
        out = b""
        for a, b in itertools.pairwise(edges):
            if hold:
                out += b"".join(scanner.process(stream[a:b]))
            else:
                scanner.observe(stream[a:b])
                tracker.response_scanner.observe(junk[: b - a])
        if hold:
            # Everything is forwarded except an incomplete trailing frame/header block.
            assert out + stream[len(out) :] == stream
            if scanner.failed:
                assert out == stream
            else:
                assert len(out) + scanner.pending_bytes() == len(stream)


_frames = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=11),  # frame type (10, 11: unknown extensions)
        st.integers(min_value=0, max_value=255),  # flags
        st.sampled_from([0, 1, 3, 5]),  # stream id
        st.binary(max_size=40),  # payload
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(frames=_frames, cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=6))
def test_random_frame_sequences_keep_flowing(
    frames: list[tuple[int, int, int, bytes]], cuts: list[int]
) -> None:
    conv = two_calls()
    stream = bytes(conv.client) + b"".join(
        frame_header(len(p), t, f, sid) + p for t, f, sid, p in frames
    )
    edges = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    observing = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    holding = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Watcher())
    out = b""
    for a, b in itertools.pairwise(edges):
        observing.request_scanner.observe(stream[a:b])
        out += b"".join(holding.request_scanner.process(stream[a:b]))
    scanner = holding.request_scanner
    if scanner.failed:
        assert out == stream
    else:
        assert len(out) + scanner.pending_bytes() == len(stream)
        assert stream.startswith(out)


@pytest.mark.parametrize("chunk", [7, 1 << 20])  # split frames (Python scanner), whole (C walker)
def test_relay_marks_each_call_in_order(chunk: int) -> None:
    """Every call's marks: the request's end forwarded, then the response's first frame, each
    after the request's headers and before the call ended, read when the scanner met them."""
    import time

    conv = Conversation()
    conv.request(1, INFER, infer_request("add_sub"))  # headers, then DATA with END_STREAM
    conv.request(3, INFER, None)  # a request of headers only
    observer = Watcher()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=observer)
    server = Conversation()
    server.response(1, b"\x0a\x07add_sub")
    server.response(3, None, status=5, message="unknown")  # trailers-only

    def feed(scanner: FrameScanner, data: bytes, hold: bool) -> None:
        for i in range(0, len(data), chunk):
            piece = data[i : i + chunk]
            if hold:
                scanner.process(piece)
            else:
                scanner.observe(piece)

    feed(tracker.request_scanner, bytes(conv.client), hold=True)
    time.sleep(0.002)  # the backend "works"
    feed(tracker.response_scanner, bytes(server.server), hold=False)
    ends = {e.stream_id: e for e in observer.ends}
    assert set(ends) == {1, 3}
    for end in ends.values():
        assert end.request_end_s is not None and end.response_start_s is not None
        assert 0 <= end.request_end_s <= end.response_start_s <= end.duration_s
        assert end.response_start_s - end.request_end_s >= 0.0015
    assert ends[3].request_end_s == 0.0  # headers only: the request ended with its headers
    assert ends[3].response_start_s == pytest.approx(ends[3].duration_s, abs=1e-3)


def test_a_call_cut_before_its_response_has_no_response_mark() -> None:
    conv = Conversation()
    conv.request(1, INFER, infer_request("add_sub"))
    observer = Watcher()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=observer)
    tracker.request_scanner.process(bytes(conv.client))
    tracker.close("CANCELLED")
    (end,) = observer.ends
    assert end.request_end_s is not None and end.response_start_s is None


class Quiet(Injector):
    """Observer that wants nothing more of any request but stream 1's: it answers the others'
    headers with a `QuietEnd`, so the relay counts their ends itself."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = [0, 0]  # [started, ended], as the sampling hook's pressure counters
        self.per_model: dict[str, int] = {}
        self.quiet = QuietEnd(self.counts, 1, self.per_model)

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | QuietEnd | None:
        self.starts.append(start)
        self.counts[0] += 1
        return None if start.stream_id == 1 else self.quiet


def relay(tracker: ConnectionTracker, conv: Conversation, cut: int) -> bytes:
    """The client's bytes through the hold-mode scanner, the server's observed, both cut."""
    out = b"".join(
        b"".join(tracker.request_scanner.process(bytes(piece)))
        for piece in (conv.client[:cut], conv.client[cut:])
    )
    for piece in (conv.server[:cut], conv.server[cut:]):
        tracker.response_scanner.observe(bytes(piece))
    return out


@pytest.mark.parametrize("cut", [0, 7, 60, 200])
def test_a_quiet_end_is_counted_by_the_relay_without_a_call(cut: int) -> None:
    conv = two_calls()
    reg = CollectorRegistry()
    observer = Quiet()
    tracker = ConnectionTracker(ProxyMetrics(reg), observer=observer)
    assert relay(tracker, conv, cut) == bytes(conv.client)
    assert_two_calls(reg, tracker)  # the relay's own metrics are as without an observer
    assert [end.stream_id for end in observer.ends] == [1]  # stream 3 ended quietly
    assert observer.counts == [2, 1]
    assert observer.per_model == {"simple_cnn": 1}  # under its label, as the relay bounds it


def test_quiet_ends_by_reset_goaway_and_close_are_counted_under_bounded_labels() -> None:
    conv = Conversation()
    for sid, model in ((1, "a"), (3, "b"), (5, "c"), (7, "d")):
        conv.request(sid, INFER, infer_request(model))
    conv.client += rst_stream(3)
    conv.server += goaway(5)
    reg = CollectorRegistry()
    observer = Quiet()
    tracker = ConnectionTracker(ProxyMetrics(reg, max_models=2), observer=observer)
    relay(tracker, conv, 0)
    assert observer.counts == [4, 2]  # 3 reset by the client, 7 above the GOAWAY's last id
    tracker.close("CANCELLED")
    assert observer.counts == [4, 3]  # 5 ended with the connection; 1 was not quiet
    assert [end.stream_id for end in observer.ends] == [1]
    # labels go to names as their calls end: "b" and "d" took the two, "c" (and "a") are past
    # the cap; the same labels as the relay's own counts
    assert observer.per_model == {"b": 1, "d": 1, "_other": 1}
    assert sample(reg, "xsp_requests_total", method="ModelInfer", model="_other",
                  grpc_code="CANCELLED") == 2  # fmt: skip
