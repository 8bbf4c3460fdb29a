"""Run `xsp-sidecar serve` with per-call CPU accounting (used by `relay_breakdown.py`).

Wraps the relay's C `data_received` (`_pump.Pump`: a chunk it takes is timed whole, its walk
and its write together), the two Python `data_received` callbacks (the chunks the pump hands
them, or every chunk with `XSP_BREAKDOWN_PYTHON_RELAY=1`, which turns the pump off),
`FrameScanner.observe` and (sampling on)
`FrameScanner.process`, the request direction's header blocks handed to Python
(`_RequestSide.on_header_block`) and the sampling hook's `on_request_headers` with thread-CPU
clocks, times the garbage collector, and keeps the first chunks of each client connection
for replay. Everything is written as JSON to `$XSP_BREAKDOWN_OUT` when the process exits.
Instrumentation costs ~0.5 µs per clock read; the breakdown says so beside its numbers.

    XSP_BREAKDOWN_OUT=stats.json python bench/relay_shim.py serve --backend HOST:PORT ...
"""

from __future__ import annotations

import atexit
import base64
import collections
import gc
import json
import os
import sys
import time
import weakref
from typing import Any

from sidecar.proxy import relay
from sidecar.proxy.frames import FrameScanner
from sidecar.proxy.streams import ConnectionTracker, _RequestSide
from sidecar.sampling.observer import SamplingObserver

RECORD_LIMIT = 10_000  # chunks kept per connection for replay

totals: collections.Counter[str] = collections.Counter()
chunks: dict[int, list[tuple[str, bytes]]] = collections.defaultdict(list)
_clock = time.thread_time_ns
_client_received = relay._ClientProtocol.data_received
_backend_received = relay._BackendProtocol.data_received
_observe = FrameScanner.observe
_process = FrameScanner.process
_request_block = _RequestSide.on_header_block
_hook = SamplingObserver.on_request_headers
_close = ConnectionTracker.close
_gc_start = [0]
_last_chunk_ns = [0]  # when the relay last received a chunk: GC counts only under load
UNDER_LOAD_NS = 200_000_000
closed: weakref.WeakSet[ConnectionTracker] = weakref.WeakSet()


def _record(connection_id: int, direction: str, data: bytes) -> None:
    kept = chunks[connection_id]
    if len(kept) < RECORD_LIMIT:
        kept.append((direction, data))


def client_received(self: Any, data: bytes) -> None:
    if self.pending is None:  # else held until the backend connects, then passed here again
        _record(self.connection_id, "request", data)
    t0 = _clock()
    _client_received(self, data)
    totals["request_chunks"] += 1
    totals["request_ns"] += _clock() - t0
    _last_chunk_ns[0] = time.perf_counter_ns()


class TimedPump:
    """A `_pump.Pump` whose armed chunks are timed (the rest go to its fallback, which the
    wrappers above time): counted as `data_received` and as `pump`."""

    def __init__(self, fallback: Any, lost: Any) -> None:
        self.pump = _Pump(fallback, lost)
        owner = fallback.__self__
        self.request = isinstance(owner, relay._ClientProtocol)
        self.client = owner if self.request else owner.client

    def __call__(self, data: bytes) -> None:
        pump = self.pump
        if not pump.armed:
            pump(data)
            return
        direction = "request" if self.request else "response"
        _record(self.client.connection_id, direction, data)
        t0 = _clock()
        pump(data)
        spent = _clock() - t0
        totals[f"{direction}_chunks"] += 1
        totals[f"{direction}_ns"] += spent
        totals["pump_chunks"] += 1
        totals["pump_ns"] += spent
        if self.request:
            _last_chunk_ns[0] = time.perf_counter_ns()

    @property
    def armed(self) -> bool:
        return self.pump.armed

    @armed.setter
    def armed(self, value: bool) -> None:
        self.pump.armed = value

    def route(self, transport: Any, scanner: Any, walk: Any) -> None:
        self.pump.route(transport, scanner, walk)

    def release(self) -> None:
        self.pump.release()


def backend_received(self: Any, data: bytes) -> None:
    _record(self.client.connection_id, "response", data)
    t0 = _clock()
    _backend_received(self, data)
    totals["response_chunks"] += 1
    totals["response_ns"] += _clock() - t0


def observe(self: FrameScanner, data: bytes) -> None:
    t0 = _clock()
    _observe(self, data)
    spent = _clock() - t0
    totals["observe_ns"] += spent
    if self.client_side:
        totals["observe_request_ns"] += spent


def process(self: FrameScanner, data: bytes) -> list[bytes]:
    t0 = _clock()
    out = _process(self, data)
    totals["hold_ns"] += _clock() - t0
    return out


def request_block(self: _RequestSide, *args: Any) -> bytes | None:
    t0 = _clock()
    out = _request_block(self, *args)
    totals["request_blocks"] += 1
    totals["request_block_ns"] += _clock() - t0
    return out


def hook(self: SamplingObserver, start: Any) -> Any:
    t0 = _clock()
    out = _hook(self, start)
    totals["hook_ns"] += _clock() - t0
    return out


def close(self: ConnectionTracker, code: str) -> None:
    # a connection's calls: its client-initiated (odd) stream ids, counted at its first close
    # (the relay may close a tracker twice); the C walk ends most calls without
    # ConnectionTracker.end (docs/benchmarks.md, issue 24)
    if self not in closed:
        closed.add(self)
        totals["calls"] += (self.last_stream_id + 1) // 2
    _close(self, code)


def on_gc(phase: str, info: dict[str, int]) -> None:
    """Collections while calls flow (a chunk came in the last 0.2 s): those of start-up
    (imports) and shutdown are not the relay's per-call cost."""
    if phase == "start":
        _gc_start[0] = time.perf_counter_ns()
    elif _gc_start[0] - _last_chunk_ns[0] < UNDER_LOAD_NS:
        took = time.perf_counter_ns() - _gc_start[0]
        totals[f"gc{info['generation']}_collections"] += 1
        totals[f"gc{info['generation']}_ns"] += took
        totals["gc_ns"] += took


def dump() -> None:
    out = {
        "totals": dict(totals),
        "connections": [
            [(d, base64.b64encode(b).decode()) for d, b in kept] for kept in chunks.values()
        ],
    }
    with open(os.environ["XSP_BREAKDOWN_OUT"], "w") as fh:
        json.dump(out, fh)


_Pump: Any = relay.native_pump
if os.environ.get("XSP_BREAKDOWN_PYTHON_RELAY") == "1" or _Pump is None:
    relay.native_pump = None
else:
    relay.native_pump = TimedPump  # type: ignore[assignment]
relay._ClientProtocol.data_received = client_received  # type: ignore[method-assign]
relay._BackendProtocol.data_received = backend_received  # type: ignore[method-assign]
FrameScanner.observe = observe  # type: ignore[method-assign]
FrameScanner.process = process  # type: ignore[method-assign]
_RequestSide.on_header_block = request_block  # type: ignore[method-assign]
SamplingObserver.on_request_headers = hook  # type: ignore[method-assign]
ConnectionTracker.close = close  # type: ignore[method-assign]
gc.callbacks.append(on_gc)
atexit.register(dump)

if __name__ == "__main__":
    from sidecar.cli import main

    sys.exit(main(sys.argv[1:]))
