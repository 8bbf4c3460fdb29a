"""The HTTP relay's C client `data_received` (`_httppump.c`) against the Python one.

Whole random request streams (pipelined, keep-alive, cut anywhere, with chunked bodies,
refusals, upgrades, Connection: close and malformed pieces) go through two client protocols
that differ only in the pump, with no observer and with a sampling hook whose `quick` the pump
answers; after every chunk the bytes forwarded, our answers to the client, the calls booked and
the reader's state must be the same, and at the end the /metrics text and the hook's records.
Then reference counts, and a real relay whose steady keep-alive calls never reach Python's
`data_received`.
"""

from __future__ import annotations

import gc
import itertools
import random
import re
import socket
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.endpoint import Endpoint
from sidecar.proxy.http import relay as http_relay
from sidecar.proxy.http.calls import Call
from sidecar.proxy.http.limits import HttpLimits
from sidecar.proxy.http.relay import RELAYING, HttpRelay, _ClientProtocol
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import HeaderDecision, QuickDecisions, QuietEnd
from tests.proxy.http_harness import TritonRoutesStandIn
from tests.proxy.wire_strategies import examples

Pump = http_relay.native_http_pump
pytestmark = pytest.mark.skipif(Pump is None, reason="_httppump not built (or XSP_NATIVE=off)")

LIMITS = HttpLimits(header_bytes=400, body_bytes=300)


class Transport:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False
        self.eof = False
        self.broken = False  # write raises RuntimeError (uvloop: closed)
        self.error: Callable[[], Exception] | None = None  # write raises what this makes

    def write(self, data: Any) -> None:
        if self.broken:
            raise RuntimeError("closed")
        if self.error is not None:
            raise self.error()
        self.out += data

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.write(piece)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def set_write_buffer_limits(self, high: int, low: int) -> None: ...

    def get_extra_info(self, name: str) -> None:
        return None


class Loop:
    """What a client protocol asks of its loop, done nowhere."""

    def create_task(self, coro: Any) -> None:
        coro.close()

    def call_later(self, delay: float, callback: Any) -> Any:
        return type("Timer", (), {"cancel": lambda self: None})()


class Coin:
    """A sampler's coin: `hot` settings and a seeded `rand`."""

    def __init__(self, seed: int, rate: float) -> None:
        self.random = random.Random(seed)
        self.hot = type("Hot", (), {})()
        self.hot.pick_rate = rate
        self.hot.force_header = b"x-force"

    def rand(self) -> float:
        return self.random.random()


class Hook:
    """A sampling hook with a `quick`: what reaches it is kept."""

    def __init__(self, seed: int, rate: float) -> None:
        self.quick = QuickDecisions(
            coin=Coin(seed, rate),
            per_call=frozenset({"ModelInfer"}),
            replayable=frozenset({"ModelInfer", "ModelReady"}),
            started=[0],
            unpicked=QuietEnd([0, 0], 0, {}),
            not_replayable=QuietEnd([0, 0], 1, {}),
        )
        self.seen: list[Any] = []

    def on_request_headers(self, start: Any) -> Any:
        self.seen.append(("start", start.stream_id, start.path, start.method, start.raw_headers))
        if start.method == "ModelReady":
            return QuietEnd([0], 0)
        return HeaderDecision(extra_headers=[("traceparent", "00-1")], capture_body=True)

    def on_request_body(self, sid: int, model: Any, body: bytes) -> None:
        self.seen.append(("body", sid, model, body))

    def on_stream_end(self, end: Any) -> None:
        timeless = end._replace(start_ns=0, duration_s=0.0, request_end_s=None,
                                response_start_s=None)  # fmt: skip
        self.seen.append(("end", timeless, end.request_end_s is not None))


def client(pump: bool, hook: Hook | None) -> tuple[_ClientProtocol, Transport, Transport]:
    """A client protocol relaying to a fake backend, with the C pump or without."""
    registry = CollectorRegistry()
    relay = HttpRelay(
        Endpoint("127.0.0.1", 1), TritonRoutesStandIn(), ProxyMetrics(registry),
        None if hook is None else (lambda info: hook), LIMITS,
    )  # fmt: skip
    relay.loop = Loop()  # type: ignore[assignment]
    saved = http_relay.native_http_pump
    http_relay.native_http_pump = Pump if pump else None
    try:
        proto = _ClientProtocol(relay)
    finally:
        http_relay.native_http_pump = saved
    front, back = Transport(), Transport()
    proto.connection_made(front)  # type: ignore[arg-type]
    proto.relaying(back)  # type: ignore[arg-type]
    proto.registry = registry  # type: ignore[attr-defined]
    return proto, front, back


def calls(proto: _ClientProtocol) -> list[tuple[Any, ...]]:
    return [
        (c.sid, c.method, c.model, c.head, c.path, c.request_bytes, c.request_end > 0,
         c.response_bytes, c.status, c.body, c.capture_limit, c.sampled,
         None if c.quiet is None else c.quiet.index)
        for c in proto.book.open
    ]  # fmt: skip


def state(proto: _ClientProtocol) -> tuple[Any, ...]:
    r = proto.requests
    refused = None if r.refused is None else r.refused.reason
    return (
        proto.state, calls(proto), proto.book.count, proto.book.drawn, r.body_left,
        r.closing, refused, r.head, r.call is not None, r.chunked is not None,
    )  # fmt: skip


# -- random request streams --------------------------------------------------------------------

TARGETS = (
    b"/v2/models/m/infer", b"/v2/models/m/ready", b"/v2/health/live", b"/v2/models/a%20b/infer",
    b"/v2/models/m/versions/2/infer?x=1", b"/nowhere", b"HTTP/x",
)  # fmt: skip


@st.composite
def request(draw: st.DrawFn) -> bytes:
    verb = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT"]))
    target = draw(st.sampled_from(TARGETS))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 8 + [b"HTTP/1.0"]))
    fields = [b"Host: h"]
    body = draw(st.sampled_from([b"", b"", b"{}", b'{"inputs": []}'] * 3 + [b"x" * 350]))
    kind = draw(st.sampled_from(["length"] * 20 + ["none", "chunked", "both", "two", "odd"]))
    if kind == "length":
        name = draw(st.sampled_from([b"Content-Length", b"content-length", b"CONTENT-LENGTH"]))
        space = draw(st.sampled_from([b"", b" ", b"  ", b"\t"]))
        if body or draw(st.booleans()):
            fields.append(name + b":" + space + str(len(body)).encode() + space)
    elif kind == "chunked":
        fields.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif kind == "both":
        fields += [b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked"]
    elif kind == "two":
        fields += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif kind == "odd":
        fields.append(draw(st.sampled_from(
            [b"Content-Length: +%d" % len(body), b"Content-Length: 0x1", b"Content-Length:",
             b"Content-Length: %d0" % len(body)]
        )))  # fmt: skip
    extra = draw(st.lists(st.sampled_from([
        b"Connection: close", b"Connection: keep-alive", b"X-Force: 1", b"x-forced: 1",
        b"Connection: upgrade\r\nUpgrade: h2c", b"Bad Header: x", b"X-Big: " + b"b" * 380,
        b"X-Fold: a\r\n b", *[b"Accept: */*"] * 12,
    ]), max_size=2))  # fmt: skip
    fields += extra
    lead = draw(st.sampled_from([b""] * 8 + [b"\r\n"]))
    # llhttp takes one space or more around the target: the reader's target then runs from
    # past the first to the first " HTTP/" (so it may hold spaces)
    spaces = draw(st.sampled_from([(b" ", b" ")] * 12 + [(b"  ", b" "), (b" ", b"  ")]))
    return (
        lead
        + verb
        + spaces[0]
        + target
        + spaces[1]
        + version
        + b"\r\n"
        + b"\r\n".join(fields)
        + (b"\r\n\r\n" + body)
    )


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    data = b"".join(draw(st.lists(request(), min_size=1, max_size=6)))
    if draw(st.integers(0, 4)) == 0:
        data += draw(st.binary(max_size=20))  # a trailing piece, maybe garbage
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=3))))
    if draw(st.booleans()):  # cut at each request's end, as clients send
        ends = {i + 4 for i in range(len(data)) if data[i : i + 4] == b"\r\n\r\n"}
        cuts = sorted(set(cuts) | ends)
    return data, cuts


def chunks_of(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def run_both(data: bytes, cuts: list[int], hook_seed: int | None, rate: float = 0.5) -> None:
    hooks = [None, None] if hook_seed is None else [Hook(hook_seed, rate), Hook(hook_seed, rate)]
    c_side, p_side = client(True, hooks[0]), client(False, hooks[1])
    assert c_side[0].pump is not None and p_side[0].pump is None
    for chunk in chunks_of(data, cuts):
        for proto, _, _ in (c_side, p_side):
            proto.data_received(chunk)
        assert bytes(c_side[2].out) == bytes(p_side[2].out)  # forwarded
        assert bytes(c_side[1].out) == bytes(p_side[1].out)  # our answers
        assert state(c_side[0]) == state(p_side[0])
    for proto, _, _ in (c_side, p_side):
        proto.arm()  # (as the relay does on each change; here: nothing changes)
        proto.connection_lost(None)
    text = [generate_latest(p.registry).decode() for p, _, _ in (c_side, p_side)]  # type: ignore[attr-defined]
    assert _timeless(text[0]) == _timeless(text[1])
    if hooks[0] is not None and hooks[1] is not None:
        assert hooks[0].seen == hooks[1].seen
        q0, q1 = hooks[0].quick, hooks[1].quick
        assert q0.started == q1.started
        assert (q0.unpicked, q0.not_replayable) == (q1.unpicked, q1.not_replayable)


def _timeless(text: str) -> list[str]:
    """/metrics lines but for durations (the bucket a call's time falls in may differ)."""
    return [
        line for line in text.splitlines()
        if "seconds" not in line and "_created" not in line
    ]  # fmt: skip


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(streams())
def test_the_pump_forwards_and_books_what_python_does(stream: tuple[bytes, list[int]]) -> None:
    run_both(*stream, hook_seed=None)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(streams(), st.integers(0, 2**32), st.sampled_from([0.0, 0.3, 1.0]))
def test_with_a_sampling_hook_the_pump_answers_as_python_does(
    stream: tuple[bytes, list[int]], seed: int, rate: float
) -> None:
    run_both(*stream, hook_seed=seed, rate=rate)


# -- the cases by name -------------------------------------------------------------------------

INFER = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}"
HEADER, BODY = INFER[:-2], INFER[-2:]


@pytest.mark.parametrize(
    "chunks",
    [
        [INFER],
        [INFER * 3],
        [HEADER, BODY],
        [HEADER, BODY + INFER],
        [HEADER, BODY[:1], BODY[1:]],  # a body in pieces: the reader's, after adopt
        [INFER + HEADER, BODY],
        [INFER + b"\r\n" + INFER],
        [INFER + b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + INFER],
        [INFER.replace(b"2\r\n", b"2\r\nContent-Length: 2\r\n") + INFER],
        # spaces: two before the target, two after it (the reader's target ends in one), a
        # target that is the first " HTTP/" (the reader's target is empty)
        [INFER.replace(b"POST ", b"POST  ") + INFER],
        [INFER.replace(b" HTTP/1.1", b"  HTTP/1.1") + INFER],
        [b"GET HTTP/x HTTP/1.1\r\nHost: h\r\n\r\n" + INFER],
    ],
)
def test_named_streams(chunks: list[bytes]) -> None:
    data = b"".join(chunks)
    cuts = list(_cumulative(chunks))
    run_both(data, cuts, hook_seed=None)
    run_both(data, cuts, hook_seed=7)


def _cumulative(chunks: list[bytes]) -> list[int]:
    out, at = [], 0
    for chunk in chunks[:-1]:
        at += len(chunk)
        out.append(at)
    return out


def test_steady_chunks_are_taken_in_c() -> None:
    proto, _, back = client(True, None)
    pump = proto.pump
    assert pump is not None and pump.armed
    fallback = []
    pump_fallback = type(proto).data_received

    def spy(self: Any, data: bytes) -> None:
        fallback.append(data)
        pump_fallback(self, data)

    for _ in range(5):
        proto.data_received(HEADER)
        assert pump.owns and proto.requests.call is not None
        proto.data_received(BODY)
        assert not pump.owns and proto.requests.call is None
    assert pump.chunks == 10
    assert bytes(back.out) == INFER * 5
    assert [c[0] for c in calls(proto)] == [1, 2, 3, 4, 5]
    del spy


def test_disarmed_with_a_body_to_come_the_reader_takes_it() -> None:
    proto, _, back = client(True, None)
    pump = proto.pump
    assert pump is not None
    proto.data_received(HEADER)
    assert pump.owns
    pump.armed = False  # hands the block to the reader's parser
    assert not pump.owns
    proto.data_received(BODY + INFER)
    assert bytes(back.out) == INFER * 2
    assert proto.requests.refused is None and proto.requests.call is None


def test_a_closed_backend_closes_after_booking() -> None:
    c_side, p_side = client(True, None), client(False, None)
    for proto, front, back in (c_side, p_side):
        back.broken = True
        proto.data_received(INFER)
        assert front.closing
    assert calls(c_side[0]) == calls(p_side[0])


# -- reference counts --------------------------------------------------------------------------


def test_no_reference_leaks_on_the_steady_path() -> None:
    """Every object the C path makes is dropped: the interpreter's allocated blocks (floats and
    ints included, which the garbage collector does not track) and the references to what it
    reads stay flat over a thousand rounds, sampling on (every request answered quietly)."""
    proto, _, back = client(True, Hook(1, 0.0))
    stream = [INFER, HEADER, BODY, INFER * 3 + HEADER, BODY]
    held = (INFER, HEADER, BODY, proto.requests, proto.book, proto.relay.route_cache)

    def rounds(n: int) -> None:
        for _ in range(n):
            for chunk in stream:
                proto.data_received(chunk)
            proto.book.open.clear()
            back.out.clear()

    rounds(200)  # warm: caches, interned objects
    gc.collect()
    blocks = sys.getallocatedblocks()
    counts = [sys.getrefcount(x) for x in held]
    rounds(1000)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 200  # (a leak here is 1000s: one a round)
    assert counts == [sys.getrefcount(x) for x in held]


def test_release_drops_every_reference() -> None:
    proto, _, _ = client(True, None)
    pump = proto.pump
    assert pump is not None
    proto.data_received(HEADER)  # owns a call and its block
    reader = proto.requests
    held = sys.getrefcount(reader)
    pump.release()
    assert sys.getrefcount(reader) < held
    assert not pump.armed and not pump.owns
    pump(b"anything")  # released: nothing happens
    with pytest.raises(ValueError):
        pump.route(Transport(), reader, {}, Call)


def test_pump_arguments_are_checked() -> None:
    assert Pump is not None
    with pytest.raises(TypeError):
        Pump(1, 2, 3)  # type: ignore[arg-type]
    pump = Pump(lambda data: None, lambda: None, lambda exc, booked: None)
    with pytest.raises(ValueError):
        pump.armed = True  # not routed
    with pytest.raises(TypeError):
        pump.route(Transport(), object(), [], Call)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pump(b"a", b"b")  # type: ignore[call-arg]


# -- a real relay ------------------------------------------------------------------------------


def test_steady_keep_alive_calls_never_reach_pythons_data_received(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.proxy.http_harness import HttpRelayThread, connect

    reached: list[int] = []
    python = _ClientProtocol.data_received

    def counted(self: _ClientProtocol, data: bytes) -> None:
        reached.append(len(data))
        python(self, data)

    monkeypatch.setattr(_ClientProtocol, "data_received", counted)
    backend = socket.socket()
    backend.bind(("127.0.0.1", 0))
    backend.listen(1)
    port = backend.getsockname()[1]
    relay = HttpRelayThread(f"127.0.0.1:{port}")
    try:
        cli = connect(relay.address)
        server, _ = backend.accept()
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
        for i in range(21):
            if i == 1:  # the first may come while the backend connection opens: Python's
                reached.clear()
            cli.sendall(HEADER)
            _wait_for(server, len(HEADER))
            cli.sendall(BODY)
            _wait_for(server, 2)
            server.sendall(answer)
            assert _wait_for(cli, len(answer)) == answer
        assert reached == []
        text = generate_latest(relay.registry).decode()
        assert "xsp_http_requests_total{" in text or "ModelInfer" in text
        cli.close()
        server.close()
    finally:
        relay.close()
        backend.close()


def _wait_for(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(5)
    got = b""
    while len(got) < n:
        more = sock.recv(n - len(got))
        assert more
        got += more
    return got


def test_route_cache_holds_each_request_line_once() -> None:
    proto, _, _ = client(True, None)
    proto.data_received(INFER * 3 + b"GET /v2/health/live HTTP/1.1\r\n\r\n")
    cache = proto.relay.route_cache
    assert cache == {
        b"POST /v2/models/m/infer": ("ModelInfer", "m"),
        b"GET /v2/health/live": ("ServerLive", None),
    }
    assert RELAYING is proto.state


# -- the real sampling hook ----------------------------------------------------------------------


def _through_real_hook(pump: bool) -> tuple[bytes, dict[str, float], Any]:
    """The bench's kind of traffic (header block and body in two reads, a health check, a
    forced request) through a client protocol whose hook is the real `HttpSamplingObserver`
    (its `quick` from the hub, its coin seeded), answered by the backend each time."""
    from sidecar.backends import TRITON
    from sidecar.proxy.http.relay import _BackendProtocol
    from tests.sampling.test_http_observer import BINARY, JSON, HttpSetup

    s = HttpSetup(rate=0.3)
    s.sampler.rand = random.Random(7).random
    proto, _, back = client(pump, s.observer)  # type: ignore[arg-type]
    proto.relay.routes = TRITON
    proto.requests.routes = TRITON
    backend = _BackendProtocol(proto)
    body = JSON + BINARY
    infer = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n" + (
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n" % (len(JSON), len(body))
    )
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    for i in range(300):
        head = infer + (b"X-Xsp-Profile: 1\r\n" if i % 37 == 0 else b"") + b"\r\n"
        chunks = [head + body] if i % 2 else [head, body]
        if i % 11 == 0:
            chunks = [b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"]
        for chunk in chunks:
            proto.data_received(chunk)
        backend.data_received(answer)
    assert not proto.book.open
    forwarded = re.sub(rb"traceparent: [^\r]*", b"traceparent: (new ids)", bytes(back.out))
    counted = {
        f"{m.name}{sorted(x.labels.items())}": x.value
        for registry in (s.registry, proto.registry)  # type: ignore[attr-defined]
        for m in registry.collect() for x in m.samples
        if not x.name.endswith("_created") and "seconds" not in x.name
    }  # fmt: skip
    return forwarded, counted, s


def test_the_real_hooks_quick_answers_are_made_in_c_as_in_python() -> None:
    """With the real hook, the pump answers unpicked and not replayable requests itself and
    hands picked and forced ones to Python: the same requests carry a traceparent, and the
    hook's and the relay's counters agree."""
    fast, fast_counts, c_setup = _through_real_hook(True)
    slow, slow_counts, p_setup = _through_real_hook(False)
    assert fast == slow
    assert sum(b"traceparent" in line for line in fast.split(b"\r\n")) > 10
    assert fast_counts == slow_counts
    assert list(c_setup.hub.pressure.counts) == list(p_setup.hub.pressure.counts)
    assert len(c_setup.handler.picked) == len(p_setup.handler.picked) > 0
