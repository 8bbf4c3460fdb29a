"""Fuzz target: HPACK header handling, the C walk (which answers a header block from the
direction's `HeaderDecoder.cache` itself: a request's start, a call's end from its cached
trailers) against the Python sinks (every block through `HeaderDecoder` and `hpack`), on a
connection whose header blocks come from the input, framed as HEADERS (+ CONTINUATION) frames,
some requests followed by a ModelInfer body. Compared as test_framewalk_streams does: every
stream record and the in-flight count after each step, what the observer is given, the
/metrics text and the bytes forwarded in hold mode, whether a scanner failed.

Input: [options: 1 byte: bits 0-1 sampling (off, a 60-byte capture limit, 1 MiB, off), bit 2
a `QuickHook` (the relay flips a seeded coin) instead of a deciding one, bit 3 each step cut
at its frame ends] then blocks, each [1 byte: bit 0 the server's direction, bit 1 END_STREAM,
bit 2 split into CONTINUATION frames of 7 bytes, bit 3 then a ModelInfer body] [stream id:
1 byte, made odd] [length: 2 bytes] [the HPACK block].
"""

from __future__ import annotations

from typing import Any

from tests.fuzz.common import Reader, instrumented, main, outcome

with instrumented(__name__ == "__main__"):
    from sidecar.proxy import frames, streams
    from tests.proxy.proxy_h2build import Conversation, data_frames, grpc_message, headers_frames
    from tests.proxy.test_framewalk_streams import frame_ends, run
    from tests.proxy.test_proxy_frames import infer_request

LIMITS = [None, 60, 1 << 20, None]
BODY = grpc_message(infer_request("add_sub", 40))


def steps_of(reader: Reader, cut: bool) -> list[tuple[bool, bytes, list[int]]]:
    conv = Conversation()  # the prefaces and SETTINGS both ways
    steps: list[tuple[bool, bytes, list[int]]] = [(True, bytes(conv.client), [])]
    steps.append((False, bytes(conv.server), []))
    while not reader.done:
        how = reader.uint(1)
        sid = reader.uint(1) | 1
        block = reader.take(reader.uint(2))
        out = headers_frames(block, sid, end_stream=bool(how & 2), split=7 if how & 4 else 0)
        if how & 8:
            out += data_frames(BODY, sid, end_stream=True)
        steps.append((not how & 1, out, frame_ends(out) if cut else []))
    return steps


def check(data: bytes) -> None:
    walk = frames.native_walk
    assert walk is not None and streams._NativeStream is not None, "the C walk is not built"
    reader = Reader(data)
    options = reader.uint(1)
    limit = LIMITS[options & 3]
    quick: Any = (options, 0.5) if options & 4 and limit is not None else None
    steps = steps_of(reader, bool(options & 8))
    c = outcome(lambda: run(steps, limit, walk, quick)[:5])
    python = outcome(lambda: run(steps, limit, None, quick)[:5])
    assert c == python, (c, python)


if __name__ == "__main__":
    main(check)
