"""Fuzz target: the relay's C `data_received` (`_pump.Pump`, one per direction, routed to a
real `ConnectionTracker`'s scanners) against the Python relay's (the scanners' `observe` /
`process` with the C walk off), as test_pump compares them, on a whole connection: every
stream record, the last stream id and in-flight count after every chunk, what a sampling hook
is given, the /metrics text, whether each scanner failed, and the bytes forwarded each way
(which must be all of them, in order, whenever nothing was injected).

Unlike test_pump, the input may stop a scanner: the pump then disarms and hands every later
chunk to its fallback, which does what the relay's Python `data_received` does (forward; the
failed scanner ignores the rest).

Input: [options: 1 byte: bits 0-1 sampling (off, on with a 60-byte capture limit, on with
1 MiB, off), bits 2-3 the hook (deciding every request, or letting the relay flip a seeded coin
at rate 0, 0.5, 1)] then steps, each [1 byte: bit 0 the client's direction] [length: 2 bytes]
[cuts] [that many bytes].
"""

from __future__ import annotations

from tests.fuzz.common import Reader, instrumented, main, outcome

with instrumented(__name__ == "__main__"):
    from sidecar.proxy import frames, relay, streams
    from tests.proxy.test_pump import observed

Steps = list[tuple[bool, bytes, list[int]]]
LIMITS = [None, 60, 1 << 20, None]
QUICK: list[tuple[int, float] | None] = [None, (7, 0.0), (11, 0.5), (13, 1.0)]


def steps_of(reader: Reader) -> Steps:
    steps: Steps = []
    while not reader.done:
        client = bool(reader.uint(1) & 1)
        size = reader.uint(2)
        cuts = reader.cuts()
        steps.append((client, reader.take(size), cuts))
    return steps


def check(data: bytes) -> None:
    assert relay.native_pump is not None and frames.native_walk is not None
    assert streams._NativeStream is not None, "the relay's C extensions are not built"
    reader = Reader(data)
    options = reader.uint(1)
    limit, quick = LIMITS[options & 3], QUICK[options >> 2 & 3]
    steps = steps_of(reader)
    pumped = outcome(lambda: observed(steps, True, limit, quick, fallback=True))
    reference = outcome(lambda: observed(steps, False, limit, quick, fallback=True))
    assert pumped == reference, (pumped, reference)
    if pumped[0] == "returned" and limit is None:  # observe mode: every byte forwarded as is
        for client in (True, False):
            sent = b"".join(d for side, d, _ in steps if side == client)
            assert b"".join(pumped[1][4][client][0]) == sent


if __name__ == "__main__":
    main(check)
