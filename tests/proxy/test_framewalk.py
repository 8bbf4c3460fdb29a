"""The C frame walker against the pure-Python scanner it accelerates.

The walker must make exactly the sink calls the Python scanner makes, in the same order, and
leave everything it does not handle to it. Checked on random frame sequences (every frame
type, padding, priority, header blocks split into CONTINUATION frames, chunks cut anywhere).
"""

from __future__ import annotations

import itertools
import shutil
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.proxy import frames
from sidecar.proxy.frames import FrameScanner, frame_header

pytestmark = pytest.mark.skipif(
    frames.native_walk is None, reason="the C frame walker is not built here"
)


class RecordingSink:
    """Records every call; wants the payload of odd stream ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_header_block(self, stream_id: int, end_stream: bool, block: bytes, ftype: int) -> None:
        self.calls.append(("headers", stream_id, end_stream, block, ftype))

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


@settings(max_examples=300, deadline=None)
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
    assert walk(sink, whole, 0) == len(whole)
    assert sink.calls == [("data", 1, 3), ("payload", 1, b"abc"), ("end", 1)]
    assert walk(sink, whole + padded, 0) == len(whole)  # padding: left to Python
    assert walk(sink, whole + whole[:10], 0) == len(whole)  # split frame: left to Python
    assert walk(sink, frame(frames.DATA, 0, 0, b"x"), 0) == 0  # stream 0: Python reports it
    with pytest.raises(ValueError):
        walk(sink, whole, len(whole) + 1)


def test_a_sink_exception_propagates() -> None:
    class Failing(RecordingSink):
        def on_end_stream(self, stream_id: int) -> None:
            raise KeyError(stream_id)

    walk = frames.native_walk
    assert walk is not None
    with pytest.raises(KeyError):
        walk(Failing(), frame(frames.DATA, frames.FLAG_END_STREAM, 1, b""), 0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_install_built_the_walker_where_a_compiler_exists() -> None:
    """`pip install` (scripts/setup.sh, CI, the image) builds it; the fallback is for no cc."""
    assert frames.native_walk is not None
