"""Fuzz target: the HTTP/2 frame walk, the C walk (`_framewalk.walk`) against the Python
scanner (`frames.FrameScanner` with `native_walk` off), with test_framewalk's sinks:

- observe mode (a recording sink): the same sink calls in the same order, the same failure;
- hold mode (a sink that appends HPACK bytes to some blocks, may raise at its n-th call): the
  same calls, the same pieces forwarded, the same failure and bytes still held;
- a client's side through a real `ConnectionTracker` with a sampling observer, in hold mode:
  the same sink calls (but the DATA ones the walk does itself), pieces, observer records,
  every stream record after each chunk.

Input: [options: 1 byte: bits 0-1 the mode (observe, hold, tracker, tracker), bit 2 a 40-byte
max frame size (hold), bits 3-7 the hold sink's failing call (0: never)] [cuts] [the bytes of
one direction: for the tracker, a client's, from its preface].
"""

from __future__ import annotations

from typing import Any

from tests.fuzz.common import Reader, instrumented, main, outcome

with instrumented(__name__ == "__main__"):
    from sidecar.proxy import frames
    from tests.proxy.test_framewalk import observe_all, process_all, relay_all


def check(data: bytes) -> None:
    walk = frames.native_walk
    assert walk is not None, "the C frame walker is not built"
    reader = Reader(data)
    options = reader.uint(1)
    cuts = reader.cuts()
    body = reader.rest()
    mode = options & 3
    max_frame = 40 if options & 4 else 16384
    fail_at = (options >> 3) - 1 if options >> 3 else None

    def scan(walker: Any) -> Any:
        if mode == 0:
            return observe_all(body, cuts, walker)
        if mode == 1:
            return process_all(body, cuts, walker, max_frame, fail_at)
        return relay_all(body, cuts, walker)

    c = outcome(lambda: scan(walk))
    python = outcome(lambda: scan(None))
    assert c == python, (c, python)


if __name__ == "__main__":
    main(check)
