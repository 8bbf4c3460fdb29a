"""The C walk's own stream bookkeeping against the Python sinks it stands in for.

With the C walk built, a tracker's streams are `_framewalk.Stream` records and the walk does a
DATA frame's work itself: byte counts, a unary request's model name, the request's end
(`_framewalk.c`). Without it (the reference), the sinks in streams.py do it on `_PyStream`
records. Whole random connections, both directions, chunked at random and at frame boundaries,
must leave every result the same: each open stream's record, the connection's last stream id
and the in-flight count after every chunk, what the observer is given (requests, bodies, stream
ends, an inference stream's messages) and its `QuietEnd` counts, the bytes
forwarded in hold mode and the /metrics text. With a hook that lets the relay decide unpicked
requests itself (`QuickDecisions`, a seeded coin), the same draws must give the same picks,
counts, forwarded bytes and /metrics text whether the walk or the hook flips the coin. The
connections mix unary calls (small, multi-frame, headers only, compressed, a model name spread
over several tiny DATA frames, TF-Serving's nested `model_spec.name`, a name not valid UTF-8,
a force header set or not), inference streams, unknown methods, DATA on
stream ids never opened or already ended, RST_STREAM from either side mid-stream, a GOAWAY, and
bodies captured over and under the capture limit.
"""

from __future__ import annotations

import bisect
import itertools
import random
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hpack import NeverIndexedHeaderTuple
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from tritonclient.grpc import service_pb2

from sidecar.backends.base import MethodInfo
from sidecar.proxy import frames, streams
from sidecar.proxy.frames import DATA, FLAG_END_STREAM
from sidecar.proxy.inferences import InferenceEnd
from sidecar.proxy.metrics import DURATION_BUCKETS, ProxyMetrics
from sidecar.proxy.streams import (
    ConnectionTracker,
    HeaderDecision,
    QuickDecisions,
    QuietEnd,
    RequestStart,
    StreamEnd,
)
from tests.harness.metrics_text import SampleKey, sample_map
from tests.proxy.proxy_h2build import (
    Conversation,
    data_frames,
    frame,
    goaway,
    grpc_message,
    headers_frames,
    request_headers,
    rst_stream,
)
from tests.proxy.test_framewalk import DATA_CALLS, Recorder, snapshot, untimed
from tests.proxy.test_proxy_model_name import field_bytes, tf_predict_request
from tests.proxy.test_stream_inferences import request as stream_request
from tests.proxy.test_stream_inferences import response as stream_response
from tests.proxy.wire_strategies import examples

pytestmark = pytest.mark.skipif(
    frames.native_walk is None or streams._NativeStream is None,
    reason="the C frame walker is not built here",
)

TRITON = "/inference.GRPCInferenceService/"
INFER = TRITON + "ModelInfer"
STREAM = TRITON + "ModelStreamInfer"
PREDICT = "/tensorflow.serving.PredictionService/Predict"
OTHER = "/my.Service/DoThing"
KINDS = ["infer", "infer", "headers-only", "predict", "raw", "compressed", "late", "short",
         "stream", "other", "forced", "unforced"]  # fmt: skip
FORCE = "x-force"  # QuickHook's force header: "forced" requests carry it as 1, "unforced" as 0


class Messages:
    """An inference stream's sampling: every message picked and kept whole (within a limit)."""

    def __init__(self, seen: list[Any], sid: int, limit: int) -> None:
        self.seen, self.sid, self.capture_limit = seen, sid, limit

    def pick(self, size: int) -> tuple[object, bool] | None:
        return size, True

    def message(self, token: object, model: str | None, full: bytes | None) -> object:
        self.seen.append(("message", self.sid, token, model, full))
        return token

    def ended(self, sample: object, end: InferenceEnd) -> None:
        self.seen.append(("ended", self.sid, sample, end.code, end.error, end.request_bytes,
                          end.response_bytes, end.responses))  # fmt: skip


class Hook:
    """Samples streams 1, 7, 13, ... (a traceparent, the body and an inference stream's
    messages, up to `limit` bytes), wants nothing more of streams 3, 9, 15, ... (a `QuietEnd`:
    their ends counted by the relay, by model label on every other one); records everything it
    is given."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: list[Any] = []
        self.ended = [0, 0]  # QuietEnd counts, by index
        self.per_model: dict[str, int] = {}

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | QuietEnd | None:
        self.seen.append(("start", *start))
        if start.stream_id % 6 == 3:
            index = start.stream_id % 4 == 1
            return QuietEnd(self.ended, int(index), self.per_model if index else None)
        if start.stream_id % 6 != 1:
            return None
        return HeaderDecision(
            extra_headers=[("traceparent", f"00-{start.stream_id:032x}-{1:016x}-01")],
            capture_body=True, capture_limit=self.limit,
            messages=Messages(self.seen, start.stream_id, self.limit),
        )  # fmt: skip

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.seen.append(("body", stream_id, model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.seen.append(("end", *untimed(end)))


class QuickHook:
    """A sampling hook that lets the relay decide what it would answer itself
    (`QuickDecisions`): a seeded coin at `pick_rate`, the force header `FORCE`; picked or
    forced requests get a traceparent and their body captured (up to `limit`), an inference
    stream its messages; an unpicked one and a method never replayed a `QuietEnd`. Records
    what only it can see (not the requests it answers with a `QuietEnd`: the relay may)."""

    def __init__(self, limit: int, seed: int, pick_rate: float) -> None:
        self.limit = limit
        self.seen: list[Any] = []
        self.counts = [0, 0]  # requests started, ended (the QuietEnds')
        self.skipped: dict[str, int] = {}
        coin = SimpleNamespace(
            hot=SimpleNamespace(pick_rate=pick_rate, force_header=FORCE.encode()),
            rand=random.Random(seed).random,
        )
        # an inference stream replayed (its messages sampled) on odd seeds, never on even ones
        streamed = {"ModelStreamInfer"} if seed % 2 else set()
        self.quick = QuickDecisions(
            coin, frozenset({"ModelInfer", "Predict"}),
            frozenset({"ModelInfer", "Predict"} | streamed), self.counts,
            QuietEnd(self.counts, 1, self.skipped), QuietEnd(self.counts, 1),
        )  # fmt: skip

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | QuietEnd | None:
        quick = self.quick
        self.counts[0] += 1
        if start.method not in quick.replayable:
            return quick.not_replayable
        forced = (FORCE.encode(), b"1") in start.raw_headers
        messages = None
        if start.method not in quick.per_call:
            messages = Messages(self.seen, start.stream_id, self.limit)
        elif not forced and not quick.coin_picked and quick.coin.rand() >= quick.coin.hot.pick_rate:
            return quick.unpicked
        self.seen.append(("asked", *start, forced))
        return HeaderDecision(
            extra_headers=[("traceparent", f"00-{start.stream_id:032x}-{1:016x}-01")],
            capture_body=True, capture_limit=self.limit, messages=messages,
        )  # fmt: skip

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.seen.append(("body", stream_id, model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.seen.append(("end", *untimed(end)))


def unary_body(draw: st.DrawFn, kind: str) -> bytes:
    """A request message's bytes (prefix included) for one kind of call."""
    if kind == "predict":
        return grpc_message(tf_predict_request(draw(st.sampled_from(["resnet", "résnet"]))))
    if kind == "raw":  # a name that is not valid UTF-8, after a field of another number
        return grpc_message(field_bytes(3, b"x") + field_bytes(1, b"\xffa\xc3"))
    if kind == "short":  # the message ends before its name does: still unread at the end
        return grpc_message(field_bytes(2, b"x" * 9) + field_bytes(1, b"name"))[:-2]
    if kind == "late":  # the name past the first HEAD_LIMIT bytes: never read
        return grpc_message(
            field_bytes(2, b"\0" * draw(st.sampled_from([1010, 1500]))) + field_bytes(1, b"m")
        )
    req = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from(["add_sub", "m"])))
    req.raw_input_contents.append(b"\1" * draw(st.sampled_from([0, 4, 300, 20000])))
    return grpc_message(req.SerializeToString(), compressed=kind == "compressed")


@st.composite
def connections(draw: st.DrawFn) -> list[tuple[bool, bytes]]:
    """One connection as steps (the client's direction?, its bytes), in the order they pass."""
    conv = Conversation()
    steps: list[tuple[bool, bytes]] = []
    marks = [0, 0]

    def cut() -> None:
        for i, buf in enumerate((conv.client, conv.server)):
            if len(buf) > marks[i]:
                steps.append((i == 0, bytes(buf[marks[i] :])))
                marks[i] = len(buf)

    pending: list[int] = []
    kinds: dict[int, str] = {}

    def respond(sid: int) -> None:
        how = draw(
            st.sampled_from(["ok", "ok", "trailers-only", "reset", "error", "status-early", "http"])
        )
        enc = conv.server_encoder
        if how == "reset":
            conv.server += rst_stream(sid, draw(st.sampled_from([7, 8])))
            return
        if how == "http":  # an HTTP error, the response ended by its DATA frame
            conv.server += headers_frames(enc.encode([(":status", "503")]), sid)
            conv.server += data_frames(b"unavailable", sid, end_stream=True)
            return
        if how == "status-early":  # a status in headers that do not end the response, then
            # headers without one, twice; fields never indexed: a block is cached once seen
            for fields in ([(":status", "200"), ("grpc-status", "5"), ("grpc-message", "x")],
                           [("x-more", "1")], [("x-more", "1")], [("x-end", "1")]):  # fmt: skip
                block = enc.encode([NeverIndexedHeaderTuple(*f) for f in fields])
                conv.server += headers_frames(block, sid, end_stream=fields[0][0] == "x-end")
            return
        status = 0 if how != "error" else 3
        if how == "trailers-only":
            block = enc.encode([(":status", "200"), ("grpc-status", str(status))])
            conv.server += headers_frames(block, sid, end_stream=True)
            return
        conv.server += headers_frames(enc.encode([(":status", "200")]), sid)
        if kinds[sid] == "stream":
            body = b"".join(stream_response("add_sub", str(i)) for i in range(2))
        else:
            body = grpc_message(b"\x0a\x03out" + b"\0" * draw(st.sampled_from([0, 5000])))
        sizes = [16384, 50, 1] if kinds[sid] == "stream" else [16384, 50]  # 1: byte by byte
        conv.server += data_frames(body, sid, max_size=draw(st.sampled_from(sizes)))
        trailers = [("grpc-status", str(status))] + ([("grpc-message", "bad%20x")] * status)
        conv.server += headers_frames(enc.encode(trailers), sid, end_stream=True)

    cut()
    for sid in range(1, 2 * draw(st.integers(1, 7)), 2):
        kind = draw(st.sampled_from(KINDS))
        kinds[sid] = kind
        if draw(st.integers(0, 4)) == 0:  # DATA on a stream id never opened
            conv.client += frame(DATA, FLAG_END_STREAM, sid + 1000, b"\0\0\0\0\1x")
        path = {"predict": PREDICT, "stream": STREAM, "other": OTHER}.get(kind, INFER)
        force = {"forced": [(FORCE, "1")], "unforced": [(FORCE, "0")]}.get(kind)
        block = conv.client_encoder.encode(request_headers(path, force))
        conv.client += headers_frames(block, sid, end_stream=kind == "headers-only")
        if kind != "headers-only":
            if kind == "stream":
                body = b"".join(stream_request("add_sub", str(i)) for i in range(2))
            elif kind == "other":
                body = grpc_message(b"\x0a\x02hi")
            else:
                body = unary_body(draw, kind)
            tiny = len(body) < 400 and draw(st.booleans())  # the name over several frames
            size = draw(st.sampled_from([1, 3, 7])) if tiny else draw(st.sampled_from([16384, 700]))
            pad = draw(st.sampled_from([0, 0, 0, 2]))
            ending = draw(st.sampled_from(["end", "end", "empty-end", "reset"]))
            conv.client += data_frames(
                body, sid, end_stream=ending == "end", pad=pad, max_size=size
            )
            if ending == "empty-end":
                conv.client += frame(DATA, FLAG_END_STREAM, sid, b"")
            elif ending == "reset":  # the client gives up mid-stream
                conv.client += rst_stream(sid)
        pending.append(sid)
        if draw(st.booleans()):
            cut()
            for done in pending:
                respond(done)
            pending = []
            if draw(st.integers(0, 3)) == 0:  # late DATA on a stream that ended
                conv.client += frame(DATA, 0, sid, b"late")
        cut()
    if pending and draw(st.booleans()):
        conv.server += goaway(max(draw(st.sampled_from(pending)) - 2, 0))
        cut()
    for sid in pending:
        respond(sid)
    cut()
    return steps


def untimed_metrics(registry: CollectorRegistry) -> dict[SampleKey, float]:
    text = generate_latest(registry).decode()
    return {
        k: v
        for k, v in sample_map(text).items()
        if not k[0].endswith(("_sum", "_bucket", "_created"))
    }


def chunks(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    """`data` cut at those of `cuts` that lie inside it, in order."""
    edges = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    for a, b in itertools.pairwise(edges):
        yield data[a:b]


Record = tuple[Any, int, int]


def fed(
    tracker: ConnectionTracker,
    steps: list[tuple[bool, bytes, list[int]]],
    send: Callable[[bool, bytes], None],
) -> list[Record]:
    """Each step's data cut at its cuts, each chunk given to `send(client, chunk)`; after each,
    the tracker's records, last stream id and in-flight count (what the walk may update itself
    in observe mode)."""
    records = []
    for client, data, cuts in steps:
        for chunk in chunks(data, cuts):
            send(client, chunk)
            records.append(
                (snapshot(tracker), tracker.last_stream_id, tracker.metrics.open_streams)
            )
    return records


def hook_records(hook: Hook | QuickHook | None) -> Any:
    """What only the hook sees: its records and counts (None without a hook)."""
    if isinstance(hook, Hook):
        return hook.seen, hook.ended, hook.per_model
    if hook is not None:
        return hook.seen, hook.counts, hook.skipped, hook.quick.coin_picked
    return None


def run(
    steps: list[tuple[bool, bytes, list[int]]],
    limit: int | None,
    walker: Any,
    quick: tuple[int, float] | None = None,
) -> tuple[Any, ...]:
    """Feed the steps (each cut at its own offsets) through a fresh tracker; sampling on when
    `limit` is given (with `quick`, (seed, pick rate), a `QuickHook`). Every result the sinks
    leave."""
    saved = frames.native_walk
    frames.native_walk = walker
    try:
        registry = CollectorRegistry()
        hook: Hook | QuickHook | None = None
        if limit is not None:
            hook = Hook(limit) if quick is None else QuickHook(limit, *quick)
        tracker = ConnectionTracker(ProxyMetrics(registry), observer=hook)
        forwarded = bytearray()

        def send(client: bool, chunk: bytes) -> None:
            if client and hook is not None:
                forwarded.extend(b"".join(tracker.request_scanner.process(chunk)))
            elif client:
                tracker.request_scanner.observe(chunk)
            else:
                tracker.response_scanner.observe(chunk)

        records = fed(tracker, steps, send)
        scanners_failed = (tracker.request_scanner.failed, tracker.response_scanner.failed)
        tracker.close("CANCELLED")
        stream_type = tracker.stream_type
        return (
            records,
            hook_records(hook),
            bytes(forwarded),
            untimed_metrics(registry),
            scanners_failed,
            (stream_type),
        )
    finally:
        frames.native_walk = saved


def frame_ends(data: bytes) -> list[int]:
    pos, out = len(frames.PREFACE) if data.startswith(frames.PREFACE) else 0, []
    while pos + 9 <= len(data):
        pos += 9 + int.from_bytes(data[pos : pos + 3], "big")
        out.append(pos)
    return out


def cut_at_random(
    steps: list[tuple[bool, bytes]], draw: st.DataObject
) -> list[tuple[bool, bytes, list[int]]]:
    """Each step with the offsets it is cut at: none, at frame ends, or anywhere."""
    cut_steps = []
    for client, data in steps:
        how = draw.draw(st.sampled_from(["whole", "frames", "anywhere"]))
        cuts: list[int] = []
        if how == "frames" and frame_ends(data):
            cuts = draw.draw(st.lists(st.sampled_from(frame_ends(data)), max_size=4))
        elif how == "anywhere":
            cuts = draw.draw(st.lists(st.integers(0, len(data)), max_size=3))
        cut_steps.append((client, data, cuts))
    return cut_steps


@settings(max_examples=examples(250), deadline=None)
@given(connections(), st.sampled_from([None, 60, 1 << 20]), st.data())
def test_every_result_is_the_same_with_the_walker_on_and_off(
    steps: list[tuple[bool, bytes]], limit: int | None, draw: st.DataObject
) -> None:
    cut_steps = cut_at_random(steps, draw)
    with_c = run(cut_steps, limit, frames.native_walk)
    without = run(cut_steps, limit, None)
    assert with_c[5] is streams._NativeStream and without[5] is streams._PyStream
    assert with_c[:5] == without[:5]
    assert with_c[4] == (False, False)  # observation never stopped
    metrics = with_c[3]
    calls = sum(v for (name, _), v in metrics.items() if name == "xsp_requests_total")
    assert calls > 0  # the connection's calls were counted


@settings(max_examples=examples(250), deadline=None)
@given(
    connections(),
    st.sampled_from([60, 1 << 20]),
    st.integers(0, 2**32),
    st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    st.data(),
)
def test_the_walks_coin_decides_as_the_hooks_given_the_same_draws(
    steps: list[tuple[bool, bytes]], limit: int, seed: int, rate: float, draw: st.DataObject
) -> None:
    """Sampling on with a hook that lets the relay decide (`QuickHook`): with the C walk an
    unpicked request whose block is cached is decided in C, without it by the hook; the same
    seed must pick the same requests (and force the same ones), count the same, forward the
    same bytes and leave the same records and /metrics text."""
    cut_steps = cut_at_random(steps, draw)
    with_c = run(cut_steps, limit, frames.native_walk, (seed, rate))
    without = run(cut_steps, limit, None, (seed, rate))
    assert with_c[:5] == without[:5]
    assert with_c[4] == (False, False)
    (_, counts, _, picked_flag) = with_c[1]
    assert counts[0] >= counts[1] and not picked_flag


def unary_connection(count: int = 3) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], int]:
    """A connection's first bytes each way (preface, settings), `count` unary calls (stream ids
    1, 3, 5, ...) as request and response chunks (as a gRPC client and Triton send them), and
    the request message's size."""
    conv = Conversation()
    start, server_start = bytes(conv.client), bytes(conv.server)
    req = service_pb2.ModelInferRequest(model_name="add_sub")
    req.raw_input_contents.append(b"\1" * 64)
    message = grpc_message(req.SerializeToString())
    calls = []
    for sid in range(1, 2 * count, 2):
        client, server = len(conv.client), len(conv.server)
        conv.client += headers_frames(conv.client_encoder.encode(request_headers(INFER)), sid)
        conv.client += data_frames(message, sid, end_stream=True)
        conv.response(sid, b"\x0a\x03out")
        calls.append((bytes(conv.client[client:]), bytes(conv.server[server:])))
    return start, server_start, calls, len(message)


def duration_buckets(registry: CollectorRegistry) -> tuple[float, list[float]]:
    """The ModelInfer/add_sub duration histogram: its sum and its cumulative bucket counts."""
    labels = {"method": "ModelInfer", "model": "add_sub", "protocol": "grpc"}
    total = registry.get_sample_value("xsp_request_duration_seconds_sum", labels) or 0.0
    counts = [
        registry.get_sample_value("xsp_request_duration_seconds_bucket", {**labels, "le": le})
        or 0.0
        for le in [*map(str, DURATION_BUCKETS), "+Inf"]
    ]
    return total, counts


def test_a_unary_call_crosses_into_python_only_until_its_blocks_are_cached() -> None:
    """Observe mode (sampling off): the request's DATA frame is counted, its model name read
    and its end stamped in C, on the clock of `time.perf_counter` (CLOCK_MONOTONIC). A header
    block is the sink's until it is cached (the first call adds fields to the HPACK table, the
    second finds them there and caches its blocks): the third call starts (its record, the
    connection's last stream id, the in-flight count) and ends (counted on /metrics: the call,
    its bytes, its duration in its bucket) in C, with no call into Python at all."""
    assert time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    start, server_start, calls, size = unary_connection()
    registry = CollectorRegistry()
    tracker = ConnectionTracker(ProxyMetrics(registry))
    tracker.request_scanner.observe(start)
    tracker.response_scanner.observe(server_start)
    tracker.request_scanner.sink = sent = Recorder(tracker.request)
    tracker.response_scanner.sink = received = Recorder(tracker.response)
    for i, (request, response) in enumerate(calls):
        sid = 2 * i + 1
        before = time.perf_counter()
        tracker.request_scanner.observe(request)
        after = time.perf_counter()
        st = tracker.streams[sid]
        assert type(st) is streams._NativeStream
        assert (st.model, st.head, st.request_bytes) == ("add_sub", None, size)
        assert before < st.start <= st.request_end < after
        assert (tracker.last_stream_id, registry.get_sample_value("xsp_requests_in_flight")) == (
            sid,
            1,
        )
        total, counts = duration_buckets(registry)
        tracker.response_scanner.observe(response)
        assert not tracker.streams
        assert registry.get_sample_value("xsp_requests_in_flight") == 0
        # the call's duration, in the bucket `bisect_left` puts it in (ProxyMetrics.record)
        total_after, counts_after = duration_buckets(registry)
        grew = [b - a for a, b in zip(counts, counts_after, strict=True)]
        first = bisect.bisect_left(DURATION_BUCKETS, total_after - total)
        assert grew == [0.0] * first + [1.0] * (len(grew) - first)
    assert [c[:2] for c in sent.calls] == [("on_header_block", sid) for sid in (1, 3)]
    assert [c[:2] for c in received.calls] == [("on_header_block", sid) for sid in (1, 1, 3, 3)]
    labels = {"method": "ModelInfer", "model": "add_sub", "protocol": "grpc"}
    assert registry.get_sample_value("xsp_requests_total", {**labels, "grpc_code": "OK"}) == 3
    assert registry.get_sample_value("xsp_request_bytes_total", labels) == 3 * size
    assert registry.get_sample_value("xsp_response_bytes_total", labels) == 3 * len(
        grpc_message(b"\x0a\x03out")
    )


class QuietHook:
    """Wants nothing more of any request (a `QuietEnd`, counted by model label); records the
    calls it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.ended = [0]
        self.per_model: dict[str, int] = {}

    def on_request_headers(self, start: RequestStart) -> QuietEnd:
        self.calls.append("start")
        return QuietEnd(self.ended, 0, self.per_model)

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.calls.append("body")

    def on_stream_end(self, end: StreamEnd) -> None:
        self.calls.append("end")


def test_a_quiet_call_ends_in_c_once_its_trailers_are_cached() -> None:
    """Sampling on: the hook is asked at every request's headers (hold mode, in Python); a
    request it answered with a `QuietEnd` ends in C once the response's blocks are cached,
    counted in the QuietEnd's counters and on /metrics as the sink would."""
    start, server_start, calls, _ = unary_connection()
    registry = CollectorRegistry()
    hook = QuietHook()
    tracker = ConnectionTracker(ProxyMetrics(registry), observer=hook)
    forwarded = tracker.request_scanner.process(start)
    tracker.response_scanner.observe(server_start)
    tracker.response_scanner.sink = received = Recorder(tracker.response)
    for request, response in calls:
        forwarded += tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
    assert b"".join(forwarded) == start + b"".join(request for request, _ in calls)
    assert not tracker.streams and not tracker.quiet_ends
    assert [c[:2] for c in received.calls] == [("on_header_block", sid) for sid in (1, 1, 3, 3)]
    assert hook.calls == ["start"] * 3
    assert (hook.ended, hook.per_model) == ([3], {"add_sub": 3})
    labels = {"method": "ModelInfer", "model": "add_sub", "grpc_code": "OK", "protocol": "grpc"}
    assert registry.get_sample_value("xsp_requests_total", labels) == 3


def test_without_the_walker_the_sinks_do_the_same_work() -> None:
    """The reference: the Python records and every DATA call through the sinks."""
    saved = frames.native_walk
    frames.native_walk = None
    try:
        start, _, calls, size = unary_connection()
        tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
        tracker.request_scanner.observe(start)
        tracker.request_scanner.sink = sent = Recorder(tracker.request)
        tracker.request_scanner.observe(calls[0][0])
        st = tracker.streams[1]
        assert type(st) is streams._PyStream
        assert (st.model, st.request_bytes) == ("add_sub", size)
        assert {c[0] for c in sent.calls} == {"on_header_block"} | DATA_CALLS
    finally:
        frames.native_walk = saved


def nested(path: tuple[int, ...], value: bytes) -> bytes:
    """`value` as the length-delimited field at `path` (outermost first)."""
    for num in reversed(path):
        value = field_bytes(num, value)
    return value


MAX_PATH = 8  # the deepest model field path `_framewalk.c` reads itself


@pytest.mark.parametrize(
    "path",
    [(1,), (2, 1), (3,) * MAX_PATH, (3,) * (MAX_PATH + 1), (2**61 - 1,), (2**61,)],
    ids=lambda p: f"{len(p)} deep, field {p[0]}",
)
@pytest.mark.parametrize("frame_size", [16384, 3, 1])
def test_a_model_field_the_walk_cannot_read_is_read_by_the_sink(
    path: tuple[int, ...], frame_size: int
) -> None:
    """A backend's model field path deeper than the walk reads, or a field number past its
    bound, is left to the sink's Python: each request's model name is the same either way,
    whole in one DATA frame or spread over many."""
    message = grpc_message(field_bytes(9, b"x") + nested(path, b"deep-model"))
    seen = []
    for walker in (frames.native_walk, None):
        saved = frames.native_walk
        frames.native_walk = walker
        try:
            metrics = ProxyMetrics(
                CollectorRegistry(), methods={INFER.encode(): MethodInfo("ModelInfer", path)}
            )
            tracker = ConnectionTracker(metrics)
            conv = Conversation()
            tracker.request_scanner.observe(bytes(conv.client))
            models = []
            for sid in (1, 3, 5):
                at = len(conv.client)
                conv.client += headers_frames(
                    conv.client_encoder.encode(request_headers(INFER)), sid
                )
                conv.client += data_frames(message, sid, end_stream=True, max_size=frame_size)
                tracker.request_scanner.observe(bytes(conv.client[at:]))
                record = tracker.streams[sid]
                models.append((type(record).__name__, record.model, record.head))
            seen.append((models, tracker.request_scanner.failed))
        finally:
            frames.native_walk = saved
    with_c, without = seen
    assert [m[1:] for m in with_c[0]] == [m[1:] for m in without[0]]
    assert with_c[0][0][0] == "Stream" and without[0][0][0] == "_PyStream"
    assert with_c[1] is without[1] is False
    assert with_c[0][0][1] == "deep-model"
