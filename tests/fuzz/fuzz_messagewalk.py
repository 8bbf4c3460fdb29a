"""Fuzz target: an inference stream's messages, the C walkers (`_messagewalk.RequestWalker`,
`ResponseWalker`) against the Python readers (`stream_messages.RequestReader`,
`ResponseReader`): the same reads after every chunk, and the same `mid_message` and `copying`,
and the same sizes asked of a `pick` hook.

Input: [options: 1 byte: bit 0 the response direction, bit 1 a pick hook] [capture limit:
2 bytes] [pick answers: 1 byte] [cuts] [the stream's bytes: gRPC-framed messages].
"""

from __future__ import annotations

from typing import Any

from tests.fuzz.common import Reader, instrumented, main

with instrumented(__name__ == "__main__"):
    from sidecar.proxy import stream_messages
    from sidecar.proxy.stream_messages import RequestReader, ResponseReader
    from tests.proxy.test_messagewalk import Pick, read_all

native = stream_messages.native_readers
TOKENS: list[Any] = ["tok", None, 7]


def answers(bits: int) -> list[tuple[object, bool] | None]:
    """Up to four pick answers from a byte: each None, or (a token, keep whole or not)."""
    out: list[tuple[object, bool] | None] = []
    for i in range(1 + (bits & 3)):
        code = (bits >> (2 + 2 * i)) & 3 if i < 3 else bits >> 7
        out.append(None if code == 0 else (TOKENS[code - 1], bool(bits >> i & 1)))
    return out


def check(data: bytes) -> None:
    assert native is not None, "the C message walker is not built"
    reader = Reader(data)
    options = reader.uint(1)
    limit = reader.uint(2)
    picks = answers(reader.uint(1))
    cuts = [cut % 700 + 1 for cut in reader.cuts()]
    wire = reader.rest()
    response = bool(options & 1)
    readers: list[Any] = (
        [ResponseReader(), native[1]()] if response else [RequestReader(), native[0]()]
    )
    hooks = []
    for r in readers:
        r.capture_limit = limit
        if options & 2:
            hook = Pick(picks)
            hooks.append(hook)
            r.pick = hook
    python, c = (read_all(r, wire, cuts) for r in readers)
    assert c == python, (c, python)
    if hooks:
        assert hooks[0].asked == hooks[1].asked


if __name__ == "__main__":
    main(check)
