"""The C frame walker against the pure-Python scanner it accelerates.

The walker must make exactly the sink calls the Python scanner makes, in the same order, and
leave everything it does not handle to it. Checked on random frame sequences (every frame
type, padding, priority, header blocks split into CONTINUATION frames, chunks cut anywhere).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import sys
import tracemalloc
import weakref
from collections import UserDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar.proxy import frames, streams
from sidecar.proxy.frames import FrameScanner, frame_header, ping_frame
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionTracker, HeaderDecision, RequestStart, StreamEnd
from tests.proxy.proxy_h2build import Conversation, rst_stream, window_update
from tests.proxy.test_proxy_frames import INFER, infer_request
from tests.proxy.wire_strategies import examples

pytestmark = pytest.mark.skipif(
    frames.native_walk is None, reason="the C frame walker is not built here"
)


class RecordingSink:
    """Records every call; wants the payload of odd stream ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_header_block(
        self, stream_id: int, end_stream: bool, block: bytes, ftype: int
    ) -> bytes | None:
        self.calls.append(("headers", stream_id, end_stream, block, ftype))
        return None

    def skim_header_block(self, chunk: bytes) -> None:
        self.calls.append(("skim", chunk))

    def on_header_block_lost(self, stream_id: int, end_stream: bool, ftype: int) -> None:
        self.calls.append(("lost", stream_id, end_stream, ftype))

    def on_data(self, stream_id: int, length: int) -> bool:
        self.calls.append(("data", stream_id, length))
        return stream_id % 2 == 1

    def on_data_payload(self, stream_id: int, chunk: bytes) -> None:
        self.calls.append(("payload", stream_id, chunk))

    def on_end_stream(self, stream_id: int) -> None:
        self.calls.append(("end", stream_id))

    def on_control(self, ftype: int, flags: int, stream_id: int, payload: bytes) -> None:
        self.calls.append(("control", ftype, flags, stream_id, payload))


def frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return frame_header(len(payload), ftype, flags, sid) + payload


@st.composite
def frame_sequences(draw: st.DrawFn) -> bytes:
    out = bytearray()
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["data", "headers", "block", "control", "skip", "odd"]))
        sid = draw(st.integers(1, 9))
        payload = draw(st.binary(max_size=40))
        flags = draw(st.sampled_from([0, frames.FLAG_END_STREAM]))
        if kind == "data":
            if draw(st.booleans()):  # padded
                pad = draw(st.integers(0, 5))
                payload = bytes([pad]) + payload + b"\0" * pad
                flags |= frames.FLAG_PADDED
            out += frame(frames.DATA, flags, sid, payload)
        elif kind == "headers":
            flags |= frames.FLAG_END_HEADERS
            if draw(st.booleans()):
                flags |= frames.FLAG_PRIORITY
                payload = b"\0\0\0\1\x10" + payload
            out += frame(frames.HEADERS, flags, sid, payload)
        elif kind == "block":  # HEADERS + CONTINUATION
            out += frame(frames.HEADERS, flags, sid, payload[:10])
            out += frame(frames.CONTINUATION, frames.FLAG_END_HEADERS, sid, payload[10:])
        elif kind == "control":
            ftype = draw(st.sampled_from([frames.SETTINGS, frames.PING, frames.RST_STREAM]))
            out += frame(ftype, draw(st.sampled_from([0, frames.FLAG_ACK])), 0, payload[:8])
        elif kind == "skip":
            out += frame(frames.WINDOW_UPDATE, 0, sid, b"\0\0\1\0")
        else:  # a type neither path handles specially
            out += frame(0x0B, 0, sid, payload)
    return bytes(out)


def observe_all(data: bytes, cuts: list[int], walker: Any) -> tuple[list[tuple[Any, ...]], bool]:
    saved = frames.native_walk
    frames.native_walk = walker
    try:
        sink = RecordingSink()
        scanner = FrameScanner(sink, client_side=False)
        edges = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
        for a, b in itertools.pairwise(edges):
            scanner.observe(data[a:b])
        return sink.calls, scanner.failed
    finally:
        frames.native_walk = saved


@settings(max_examples=examples(300), deadline=None)
@given(frame_sequences(), st.lists(st.integers(0, 600), max_size=4))
def test_the_walker_makes_the_same_calls_as_the_python_scanner(
    data: bytes, cuts: list[int]
) -> None:
    assert observe_all(data, cuts, frames.native_walk) == observe_all(data, cuts, None)


def test_the_walker_stops_where_the_python_scanner_must_take_over() -> None:
    walk = frames.native_walk
    assert walk is not None
    sink = RecordingSink()
    whole = frame(frames.DATA, frames.FLAG_END_STREAM, 1, b"abc")
    padded = frame(frames.DATA, frames.FLAG_PADDED, 3, b"\x01x\0")
    assert walk(sink, whole, 0, None) == len(whole)
    assert sink.calls == [("data", 1, 3), ("payload", 1, b"abc"), ("end", 1)]
    assert walk(sink, whole + padded, 0, None) == len(whole)  # padding: left to Python
    assert walk(sink, whole + whole[:10], 0, None) == len(whole)  # split frame: left to Python
    assert walk(sink, frame(frames.DATA, 0, 0, b"x"), 0, None) == 0  # stream 0: Python reports it
    with pytest.raises(ValueError):
        walk(sink, whole, len(whole) + 1, None)


def test_the_walker_takes_each_frame_type_it_handles_and_leaves_the_others() -> None:
    """Each type the fast path handles is taken whole (its payload read, or skipped where
    nothing is observed); every other type (a push promise, a CONTINUATION with no header
    block before it, an unknown type) is left to the Python scanner, which judges it."""
    walk = frames.native_walk
    assert walk is not None
    f = frames
    taken = {
        f.DATA: frame(f.DATA, 0, 1, b"x"),
        f.HEADERS: frame(f.HEADERS, f.FLAG_END_HEADERS, 1, b"\x82"),
        f.PRIORITY: frame(f.PRIORITY, 0, 1, b"\0\0\0\0\x10"),
        f.RST_STREAM: frame(f.RST_STREAM, 0, 1, b"\0\0\0\x08"),
        f.SETTINGS: frame(f.SETTINGS, 0, 0, b""),
        f.PING: frame(f.PING, 0, 0, b"12345678"),
        f.GOAWAY: frame(f.GOAWAY, 0, 0, b"\0\0\0\1\0\0\0\0"),
        f.WINDOW_UPDATE: frame(f.WINDOW_UPDATE, 0, 0, b"\0\0\1\0"),
    }
    for ftype, data in taken.items():
        assert walk(RecordingSink(), data, 0, None) == len(data), ftype
    left = {
        f.PUSH_PROMISE: frame(f.PUSH_PROMISE, f.FLAG_END_HEADERS, 1, b"\0\0\0\2\x82"),
        f.CONTINUATION: frame(f.CONTINUATION, f.FLAG_END_HEADERS, 1, b"\x82"),
        0x0A: frame(0x0A, 0, 0, b"origin"),
        0x0B: frame(0x0B, 0, 1, b"x"),
    }
    for ftype, data in left.items():
        sink = RecordingSink()
        assert walk(sink, data, 0, None) == 0 and sink.calls == [], ftype
    stray = left[f.CONTINUATION] + taken[f.DATA]
    assert observe_all(stray, [], walk) == observe_all(stray, [], None)
    assert observe_all(stray, [], walk)[1]  # the scanner failed: no header block before it


def test_a_sink_exception_propagates() -> None:
    class Failing(RecordingSink):
        def on_end_stream(self, stream_id: int) -> None:
            raise KeyError(stream_id)

    walk = frames.native_walk
    assert walk is not None
    with pytest.raises(KeyError):
        walk(Failing(), frame(frames.DATA, frames.FLAG_END_STREAM, 1, b""), 0, None)


class Answer:
    """A fresh object per sink answer (truthy or not): a weak reference tells whether anything
    still holds it."""

    def __init__(self, truth: bool) -> None:
        self.truth = truth

    def __bool__(self) -> bool:
        return self.truth


class AnsweringSink(RecordingSink):
    """Answers every call with a fresh `Answer` (on_data: truthy for odd stream ids; a header
    block: truthy, to be injected), keeps weak references to them; `emit_injected` (the walk's
    `hold`) records its call and answers the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[weakref.ref[Answer]] = []

    def answer(self, truth: bool = True) -> Answer:
        made = Answer(truth)
        self.answers.append(weakref.ref(made))
        return made

    def on_header_block(  # type: ignore[override]
        self, stream_id: int, end_stream: bool, block: bytes, ftype: int
    ) -> Answer:
        super().on_header_block(stream_id, end_stream, block, ftype)
        return self.answer(stream_id % 4 == 3)  # falsy (not None): nothing to inject

    def on_data(self, stream_id: int, length: int) -> Answer:  # type: ignore[override]
        return self.answer(super().on_data(stream_id, length))

    def on_data_payload(self, stream_id: int, chunk: bytes) -> Answer:  # type: ignore[override]
        super().on_data_payload(stream_id, chunk)
        return self.answer()

    def on_end_stream(self, stream_id: int) -> Answer:  # type: ignore[override]
        super().on_end_stream(stream_id)
        return self.answer()

    def on_control(  # type: ignore[override]
        self, ftype: int, flags: int, stream_id: int, payload: bytes
    ) -> Answer:
        super().on_control(ftype, flags, stream_id, payload)
        return self.answer()

    def emit_injected(self, data: bytes, at: int, extra: object) -> Answer:
        self.calls.append(("injected", at, bool(extra)))
        return self.answer()


def test_what_the_walk_gives_the_sink_and_the_sink_answers_is_released() -> None:
    """Every object the walk makes for a sink call (a stream id, a length, a payload, a
    position past 256: no cached small int) is held by the sink's records alone once the walk
    returns, and every answer the sink gave is freed."""
    walk = frames.native_walk
    assert walk is not None
    f = frames
    data = (
        frame(f.DATA, f.FLAG_END_STREAM, 1001, b"a" * 300)  # wanted: delivered
        + frame(f.DATA, 0, 1002, b"b" * 300)  # not wanted
        + frame(f.HEADERS, f.FLAG_END_HEADERS | f.FLAG_END_STREAM, 1003, b"\x82\x86")
        + frame(f.HEADERS, f.FLAG_END_HEADERS | f.FLAG_END_STREAM, 1005, b"\x82\x86")
        + frame(f.PING, 0, 0, b"12345678")
        + frame(f.RST_STREAM, 0, 1005, b"\0\0\0\x08")
    )
    sink = AnsweringSink()
    assert walk(sink, data, 0, sink) == len(data)
    assert [c[0] for c in sink.calls] == [
        "data", "payload", "end", "data", "headers", "injected", "headers", "control",
        "control",
    ]  # fmt: skip
    fresh: dict[int, list[Any]] = {}  # id -> [the object, how many records hold it]
    for call in sink.calls:
        for arg in call[1:]:
            if (type(arg) is int and arg > 256) or (type(arg) is bytes and len(arg) > 1):
                fresh.setdefault(id(arg), [arg, 0])[1] += 1
    del arg
    extra = {repr(x)[:20]: sys.getrefcount(x) - held for x, held in fresh.values()}
    assert len(fresh) >= 8 and len(set(extra.values())) == 1, extra  # the records' only
    gc.collect()
    assert len(sink.answers) == 9 and all(ref() is None for ref in sink.answers)
    observing = AnsweringSink()  # observe mode (no hold): a block's answer is not injected
    assert walk(observing, data, 0, None) == len(data)
    assert "injected" not in [c[0] for c in observing.calls] and len(observing.calls) == 8


# -- hold mode: the same calls, and the same pieces forwarded ---------------------------------


class HoldingSink(RecordingSink):
    """Appends HPACK bytes to the blocks of streams 3 and 6 (long ones to stream 6, so they
    overflow a small frame size into a CONTINUATION frame); may raise at its n-th call."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at

    def _count(self) -> None:
        if len(self.calls) == self.fail_at:
            raise RuntimeError("sink failed")

    def on_header_block(
        self, stream_id: int, end_stream: bool, block: bytes, ftype: int
    ) -> bytes | None:
        super().on_header_block(stream_id, end_stream, block, ftype)
        self._count()
        return {3: b"\x00\x01a\x01b", 6: b"\x00\x02xy\x20" + b"v" * 32}.get(stream_id)

    def on_data(self, stream_id: int, length: int) -> bool:
        wanted = super().on_data(stream_id, length)
        self._count()
        return wanted

    def on_end_stream(self, stream_id: int) -> None:
        super().on_end_stream(stream_id)
        self._count()

    def on_control(self, ftype: int, flags: int, stream_id: int, payload: bytes) -> None:
        super().on_control(ftype, flags, stream_id, payload)
        self._count()


def process_all(
    data: bytes, cuts: list[int], walker: Any, max_frame: int, fail_at: int | None
) -> tuple[list[tuple[Any, ...]], list[bytes], bool, int]:
    """Hold mode over chunks of `data`: the sink's calls, every piece returned, whether the
    scanner failed and what it still holds."""
    saved = frames.native_walk
    frames.native_walk = walker
    try:
        sink = HoldingSink(fail_at)
        scanner = FrameScanner(sink, client_side=False, hold=True)
        scanner.max_frame_size = max_frame
        edges = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
        pieces: list[bytes] = []
        for a, b in itertools.pairwise(edges):
            pieces += scanner.process(data[a:b])
        return sink.calls, pieces, scanner.failed, scanner.pending_bytes()
    finally:
        frames.native_walk = saved


@settings(max_examples=examples(400), deadline=None)
@given(
    frame_sequences(),
    st.lists(st.integers(0, 600), max_size=4),
    st.sampled_from([16384, 40]),
    st.none() | st.integers(0, 20),
)
def test_hold_mode_makes_the_same_calls_and_forwards_the_same_pieces(
    data: bytes, cuts: list[int], max_frame: int, fail_at: int | None
) -> None:
    with_c = process_all(data, cuts, frames.native_walk, max_frame, fail_at)
    assert with_c == process_all(data, cuts, None, max_frame, fail_at)
    calls, pieces, _, pending = with_c
    if not any(c[0] == "headers" and c[1] in (3, 6) for c in calls):  # nothing injected
        assert b"".join(pieces) + data[len(data) - pending :] == data


def test_hold_mode_walks_whole_chunks_in_c() -> None:
    """A chunk of whole fast-path frames is handed back as the chunk itself (no copy), or cut
    around a re-emitted HEADERS frame when the sink appends to its block."""

    chunk = frame(frames.HEADERS, frames.FLAG_END_HEADERS, 1, b"\x82") + frame(
        frames.DATA, frames.FLAG_END_STREAM, 1, b"abc"
    )
    scanner = FrameScanner(HoldingSink(), client_side=False, hold=True)
    (piece,) = scanner.process(chunk)
    assert piece is chunk
    headers = frame(frames.HEADERS, frames.FLAG_END_HEADERS, 3, b"\x82")
    tail = frame(frames.DATA, 0, 3, b"xyz")
    pieces = scanner.process(chunk + headers + tail)
    extra = b"\x00\x01a\x01b"
    injected = frame(frames.HEADERS, frames.FLAG_END_HEADERS, 3, b"\x82" + extra)
    assert pieces == [chunk, injected, tail]


class CountingWalk:
    """The C walk, recording where each call started and stopped."""

    def __init__(self) -> None:
        self.walk = frames.native_walk
        self.spans: list[tuple[int, int]] = []

    def __call__(self, sink: Any, data: bytes, start: int, *rest: Any) -> int:
        assert self.walk is not None
        stop = self.walk(sink, data, start, *rest)
        self.spans.append((start, stop))
        return stop


@pytest.mark.parametrize("hold", [False, True])
def test_after_a_split_frame_ends_the_rest_of_the_chunk_is_walked_in_c(hold: bool) -> None:
    """A large body comes in reads that end inside a frame: the read after one finishes that
    frame in Python, then hands the rest back to the walk at the next frame boundary (not one
    Python step per frame until the read ends), and the calls are the Python scanner's."""
    body = [frame(frames.DATA, 0, 1, bytes([i]) * 1000) for i in range(8)]
    data = b"".join(body) + frame(frames.DATA, frames.FLAG_END_STREAM, 1, b"end")
    cut = len(body[0]) // 2  # the first read ends inside the first frame
    counting = CountingWalk()
    if hold:
        assert process_all(data, [cut], counting, 16384, None) == process_all(
            data, [cut], None, 16384, None
        )
    else:
        assert observe_all(data, [cut], counting) == observe_all(data, [cut], None)
    # the first read: the walk stops at once (a split frame); the second: Python ends that
    # frame, and the walk takes every frame after it, to the read's end
    rest = len(data) - cut
    assert counting.spans == [(0, 0), (len(body[0]) - cut, rest)]


# The fields of a stream's record (`streams._PyStream`; `_framewalk.Stream` has the same), and
# those that are times (compared as whether they are set: the two runs differ in when).
STREAM_FIELDS = [f.name for f in dataclasses.fields(streams._PyStream)]
STREAM_TIMES = frozenset({"start", "start_ns", "request_end", "response_start"})


def snapshot(tracker: ConnectionTracker) -> list[tuple[Any, ...]]:
    """Every open stream's record, field by field (an inference stream's table by presence)."""
    out = []
    for sid, record in tracker.streams.items():
        values: list[Any] = [sid]
        for name in STREAM_FIELDS:
            value = getattr(record, name)
            if name in STREAM_TIMES:
                value = bool(value)
            elif name == "inferences":
                value = value is not None
            elif isinstance(value, bytearray):  # head, body: grown in place later
                value = bytes(value)
            values.append(value)
        out.append(tuple(values))
    return out


# The sink calls the C walk makes only for what it does not do itself (`_framewalk.c`).
DATA_CALLS = frozenset({"on_data", "on_data_payload", "on_end_stream"})


class Recorder:
    """Wraps a real sink: records each call the scanner makes, with its arguments and result."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            result = method(*args)
            self.calls.append((name, *args, result))
            return result

        return call


class Sampler:
    """An observer that samples streams 1, 5, 9, ... (a traceparent, the body captured) and
    only captures the body of streams 3, 11, 19, ..."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def on_request_headers(self, start: RequestStart) -> HeaderDecision | None:
        self.seen.append(("start", start.stream_id, start.path, start.raw_headers))
        if start.stream_id % 4 == 1:
            tp = f"00-{start.stream_id:032x}-{start.stream_id:016x}-01"
            return HeaderDecision(extra_headers=[("traceparent", tp)], capture_body=True)
        return HeaderDecision(capture_body=True) if start.stream_id % 8 == 3 else None

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        self.seen.append(("body", stream_id, model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.seen.append(("end", *untimed(end)))


def untimed(end: StreamEnd) -> StreamEnd:
    """A StreamEnd with its times replaced by whether each is known."""
    return end._replace(
        start_ns=0, duration_s=0.0, request_end_s=end.request_end_s is not None,
        response_start_s=end.response_start_s is not None,
    )  # fmt: skip


@st.composite
def grpc_exchanges(draw: st.DrawFn) -> bytes:
    """A client's side of a gRPC connection: ModelInfer calls (small, multi-frame, headers
    only; padded, prioritised, split header blocks now and then) and control frames."""
    conv = Conversation()
    for sid in range(1, 2 * draw(st.integers(1, 6)), 2):
        size = draw(st.sampled_from([0, 4, 300, 6000]))
        body = None if draw(st.integers(0, 5)) == 0 else infer_request("add_sub", size)
        unusual = draw(st.integers(0, 4)) == 0  # padding, priority and CONTINUATION
        conv.request(
            sid, INFER, body, metadata=[("x-n", str(draw(st.integers(0, 3))))],
            pad=3 if unusual else 0, priority=unusual, split=7 if unusual else 0,
            data_pad=2 if unusual else 0,
        )  # fmt: skip
        extra = draw(st.sampled_from([b"", window_update(0), window_update(sid), b"ping"]))
        conv.client += ping_frame(b"12345678") if extra == b"ping" else extra
    if draw(st.booleans()):
        conv.client += rst_stream(1)
    return bytes(conv.client)


def boundaries(data: bytes) -> list[int]:
    """Where each frame of a client's bytes (after the preface) ends."""
    pos, out = len(frames.PREFACE), []
    while pos + 9 <= len(data):
        pos += 9 + int.from_bytes(data[pos : pos + 3], "big")
        out.append(pos)
    return out


def relay_all(data: bytes, cuts: list[int], walker: Any) -> tuple[Any, ...]:
    saved = frames.native_walk
    frames.native_walk = walker
    try:
        observer = Sampler()
        tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=observer)
        scanner = tracker.request_scanner
        scanner.sink = recorder = Recorder(scanner.sink)
        edges = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
        pieces: list[bytes] = []
        records = []
        for a, b in itertools.pairwise(edges):
            pieces += scanner.process(data[a:b])
            records.append(snapshot(tracker))
        failed, pending = scanner.failed, scanner.pending_bytes()
        tracker.close("CANCELLED")
        calls = [c for c in recorder.calls if c[0] not in DATA_CALLS]
        return calls, pieces, observer.seen, failed, pending, records
    finally:
        frames.native_walk = saved


@settings(max_examples=examples(150), deadline=None)
@given(grpc_exchanges(), st.lists(st.integers(0, 30000), max_size=4), st.data())
def test_real_exchanges_in_hold_mode_make_the_same_calls_and_pieces(
    data: bytes, cuts: list[int], draw: st.DataObject
) -> None:
    """Chunks cut anywhere, and at frame boundaries (where the C walk takes a chunk): always
    after the connection's preface and SETTINGS, as clients send them. The sink's DATA calls
    are not compared (the C walk does most of their work itself): what they do is, in every
    stream's record after each chunk and in what the observer is given."""
    ends = boundaries(data)
    cuts += [ends[0], *draw.draw(st.lists(st.sampled_from(ends), max_size=6))]
    walked: list[int] = []
    walk = frames.native_walk
    assert walk is not None

    def counting(*args: Any) -> int:
        walked.append(args[2])
        return walk(*args)

    with_c = relay_all(data, cuts, counting)
    assert walked  # the C walk took the chunks that start at a frame boundary
    assert with_c == relay_all(data, cuts, None)
    assert not with_c[3]  # never failed
    assert with_c[4] == 0  # nothing held at the end


def test_a_c_stream_record_has_every_field_of_the_python_one_each_settable() -> None:
    """`_framewalk.Stream` stands in for `streams._PyStream`: the same fields, each read and
    written as on the dataclass (Python code sets them on either)."""
    native = streams._NativeStream
    if native is None:
        pytest.skip("the C stream record is not built here")
    py = streams._PyStream(7, "/p", "M", (1,), 1.5)
    c = native(7, "/p", "M", (1,), 1.5)
    for name in STREAM_FIELDS:
        assert getattr(c, name) == getattr(py, name), name
        value = getattr(py, name)
        setattr(c, name, value)  # raises where a member is read-only
        assert getattr(c, name) == value, name


def c_stream() -> Any:
    native = streams._NativeStream
    if native is None:
        pytest.skip("the C stream record is not built here")
    return native(1, "/p", "M", (1,), 1.5)


class Marker:
    pass


def test_a_freed_c_stream_record_releases_its_members_and_memory() -> None:
    """A record dropped releases what it holds, leaves the cycle collector before (a member's
    `__del__` may run a collection: it must not find the record being freed) and returns its
    memory."""
    st = c_stream()
    held = Marker()
    gone = weakref.ref(held)
    st.model = held
    del held
    tracked: list[bool] = []

    class Collecting:
        def __del__(self) -> None:
            gc.collect()
            tracked.append(any(id(o) == freed for o in gc.get_objects()))

    st.body = Collecting()
    freed = id(st)
    del st
    assert gone() is None and tracked == [False]
    tracemalloc.start()
    try:
        for _ in range(4):
            c_stream()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            c_stream()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 16 * 1024, grown


def test_calls_walked_in_c_leave_no_memory_behind() -> None:
    """Unary calls whose records the walk updates in place (the head read for the model
    name and replaced, the response's statuses) keep nothing once they have ended."""
    if frames.native_walk is None or streams._NativeStream is None:
        pytest.skip("the C walk is not built here")
    conv = Conversation()
    prefaces = bytes(conv.client), bytes(conv.server)
    calls: list[tuple[bytes, bytes]] = []
    for sid in range(1, 2 * 700, 2):
        client_at, server_at = len(conv.client), len(conv.server)
        conv.request(sid, INFER, infer_request("m" * 40, n=80))  # past 256 bytes each way:
        conv.response(sid, b"\0" * 300)  # the byte counts are no small ints CPython keeps
        calls.append((bytes(conv.client[client_at:]), bytes(conv.server[server_at:])))
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    tracker.request_scanner.observe(prefaces[0])
    tracker.response_scanner.observe(prefaces[1])

    def run(some: list[tuple[bytes, bytes]]) -> None:
        for request, response in some:
            tracker.request_scanner.observe(request)
            tracker.response_scanner.observe(response)

    run(calls[:200])
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        run(calls[200:])
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert tracker.in_flight == 0 and not tracker.failed
    # 348 bytes here over 500 calls; one object a call kept (a head, a count, a duration: 24
    # bytes or more) is 12 KiB or more
    assert grown < 4 * 1024, grown


def test_the_walk_takes_only_the_arguments_it_documents() -> None:
    """`walk(sink, data: bytes, start, hold=None, streams: dict | None = None, request=False,
    header_cache: dict | None = None, tracker=None)`: three to eight, of those kinds; a start
    outside the data is refused; anything else is a TypeError, before any byte is read."""
    walk = frames.native_walk
    assert walk is not None
    data = frame(frames.DATA, 0, 1, b"x")
    sink = RecordingSink()
    assert walk(sink, data, 0) == len(data)  # three: the least
    assert walk(sink, data, 0, None, {}, False, {}, None) == len(data)  # eight: the most
    for bad in [
        (sink, data), (sink, data, 0, None, {}, False, {}, None, None),
        (sink, bytearray(data), 0), (sink, data.decode("latin-1"), 0),
        (sink, data, 0, None, UserDict()), (sink, data, 0, None, {}, False, UserDict()),
    ]:  # fmt: skip
        with pytest.raises(TypeError):
            walk(*bad)
    for start in (-1, len(data) + 1):
        with pytest.raises(ValueError):
            walk(sink, data, start)
    with pytest.raises(OverflowError):
        walk(sink, data, 2**70)
    with pytest.raises(TypeError):
        walk(sink, data, "0")
    assert walk(sink, data, len(data)) == len(data)  # at the end: nothing to read
    assert sink.calls == [("data", 1, 1), ("payload", 1, b"x")]  # (an empty table: no stream)
    for n in range(3, 9):  # each count, the rest left to their defaults
        assert walk(RecordingSink(), data, 0, *(None, None, False, None, None)[: n - 3]) == 9 + 1
    if streams._NativeStream is not None:  # five: a stream table, its record counted in C
        record = streams._NativeStream(1, b"/p", "M", None, 1.5)
        quiet = RecordingSink()
        assert walk(quiet, data, 0, None, {1: record}) == len(data)
        assert record.response_bytes == 1 and quiet.calls == []
        for args in [(True,), (True, None), (True, None, None)]:  # six to eight: the direction
            record = streams._NativeStream(1, b"/p", "M", None, 1.5)
            assert walk(quiet, data, 0, None, {1: record}, *args) == len(data)
            assert (record.request_bytes, record.response_bytes) == (1, 0)
            assert quiet.calls == []
    block = frame(frames.HEADERS, frames.FLAG_END_HEADERS, 1, b"\x82\x86")
    answering = AnsweringSink()  # no hold given: an answer is never injected
    assert walk(answering, block, 0) == len(block)
    assert [c[0] for c in answering.calls] == ["headers"]
    plain = RecordingSink()  # a stream table but no header cache: every block is the sink's
    assert walk(plain, block, 0, None, {}, False, None) == len(block)
    assert [c[0] for c in plain.calls] == ["headers"]


def test_a_frame_past_64_kib_is_read_to_its_length() -> None:
    """A length's three bytes, the top one included (frames past 16 KiB where the peer
    allowed them)."""
    walk = frames.native_walk
    assert walk is not None
    for size in (65535, 65536, 70000, (1 << 24) - 1):
        data = frame(frames.DATA, 0, 1, b"x" * size)
        sink = RecordingSink()
        assert walk(sink, data, 0) == len(data)
        assert [c[:3] for c in sink.calls] == [("data", 1, size), ("payload", 1, b"x" * size)]


def test_a_response_block_in_the_cache_is_read_in_c_without_a_tracker() -> None:
    """The response direction reads its header cache with a stream table alone (observe
    mode, no tracker): a cached block that does not end the stream marks the record's response
    start and statuses, and the sink is not called."""
    if streams._NativeStream is None:
        pytest.skip("the C stream record is not built here")
    walk = frames.native_walk
    assert walk is not None
    block = b"\x88\x89"
    data = frame(frames.HEADERS, frames.FLAG_END_HEADERS, 1, block)
    for args in [(), (None,)]:  # seven arguments, or eight with no tracker
        record = streams._NativeStream(1, b"/p", "M", None, 1.5)
        sink = RecordingSink()
        cache = {block: ([(b":status", b"200")], (None, b"", b"200"))}
        assert walk(sink, data, 0, None, {1: record}, False, cache, *args) == len(data)
        assert sink.calls == [] and record.http_status == b"200" and record.response_start > 0


def test_a_stream_id_is_read_from_all_four_bytes_without_the_reserved_bit() -> None:
    walk = frames.native_walk
    assert walk is not None
    for sid in (1, 0x100, 0x10000, 0x1000000, 0x12345678, 0x7FFFFFFF):
        for reserved in (0, 0x80000000):
            wire_id = (sid | reserved).to_bytes(4, "big")  # frame_header masks the bit
            data = (1).to_bytes(3, "big") + bytes([frames.DATA, 0]) + wire_id + b"x"
            sink = RecordingSink()
            assert walk(sink, data, 0) == len(data)
            assert sink.calls[0] == ("data", sid, 1), (hex(sid), reserved)


def test_the_walk_goes_on_past_frames_it_skips_and_takes_blocks_up_to_the_limit() -> None:
    """PRIORITY and WINDOW_UPDATE frames are stepped over, the walk going on with the next
    frame; a HEADERS frame is taken up to `MAX_HEADER_BLOCK` bytes, one past it is left to the
    Python scanner (which stops observing)."""
    walk = frames.native_walk
    assert walk is not None
    f = frames
    data = frame(f.DATA, 0, 1, b"x")
    for skipped in (frame(f.WINDOW_UPDATE, 0, 0, b"\0\0\1\0"), frame(f.PRIORITY, 0, 1, b"\0" * 5)):
        sink = RecordingSink()
        assert walk(sink, skipped + data, 0) == len(skipped) + len(data)
        assert sink.calls[0] == ("data", 1, 1)
    for size, taken in ((f.MAX_HEADER_BLOCK, True), (f.MAX_HEADER_BLOCK + 1, False)):
        block = frame(f.HEADERS, f.FLAG_END_HEADERS, 1, b"\x82" * size)
        sink = RecordingSink()
        assert walk(sink, block, 0) == (len(block) if taken else 0)
        assert len(sink.calls) == taken
