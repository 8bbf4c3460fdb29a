"""Fuzz target: the HTTP relay's C client `data_received` (`_httppump.Pump`) against the
Python one (`RequestReader` through `_ClientProtocol.data_received`), as test_httppump compares
them: two client protocols, one with the pump, fed the same chunks; after every chunk the
bytes forwarded, our answers to the client, the calls booked and the reader's state, at the
end the /metrics text and what a sampling hook was given.

Input: [options: 1 byte: bits 0-1 the hook (none; a hook whose `quick` the relay answers, its
coin seeded, at rate 0, 0.5, 1)] [cuts] [the client's bytes].
"""

from __future__ import annotations

from tests.fuzz.common import Reader, instrumented, main

with instrumented(__name__ == "__main__"):
    from sidecar.proxy.http import relay
    from tests.proxy.test_httppump import run_both

RATES: list[float | None] = [None, 0.0, 0.5, 1.0]


def check(data: bytes) -> None:
    assert relay.native_http_pump is not None, "the relay's C extensions are not built"
    reader = Reader(data)
    rate = RATES[reader.uint(1) & 3]
    cuts = reader.cuts()
    stream = reader.rest()
    cuts = sorted({cut for cut in cuts if 0 < cut < len(stream)})
    if rate is None:
        run_both(stream, cuts, hook_seed=None)
    else:
        run_both(stream, cuts, hook_seed=17, rate=rate)


if __name__ == "__main__":
    main(check)
