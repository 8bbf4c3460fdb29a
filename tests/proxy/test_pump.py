"""The relay's C `data_received` (`_pump.Pump`) against the Python one it stands in for.

Whole random connections (test_framewalk_streams' strategy: unary calls of every kind,
inference streams, unknown methods, resets, GOAWAY), chunked at random and at frame
boundaries, go through a pump per direction routed to a real `ConnectionTracker`'s scanners,
and through the scanners' pure-Python `observe` (the reference): every stream record, the last
stream id and in-flight count after every chunk, the /metrics text and the bytes forwarded must
be the same. Then the pump's own rules (its fallback while disarmed, a closed peer, a walk that
raises, a stopped scanner, its references) and, through a real gRPC server and client, that the
relay's steady unary calls never reach its Python `data_received` and leave /metrics as the
Python relay does.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar.endpoint import Endpoint
from sidecar.proxy import frames, relay, streams
from sidecar.proxy.frames import ScanError
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionTracker
from tests.proxy.native_lifetimes import memory_kept_by, tracked_while_freed
from tests.proxy.proxy_h2build import Conversation
from tests.proxy.proxy_harness import RelayThread, grpc_backend, unary
from tests.proxy.test_framewalk_streams import (
    Hook,
    QuickHook,
    connections,
    cut_at_random,
    fed,
    hook_records,
    untimed_metrics,
)
from tests.proxy.test_proxy_relay import INFER, echo, infer_bytes
from tests.proxy.wire_strategies import examples

pytestmark = pytest.mark.skipif(
    relay.native_pump is None or frames.native_walk is None or streams._NativeStream is None,
    reason="the relay's C extensions are not built here",
)
Pump: Any = relay.native_pump
Steps = list[tuple[bool, bytes, list[int]]]


def never_lost() -> None:
    raise AssertionError("the other side was never closed")


class Peer:
    """The other side's transport: keeps what is written, or raises `error` once set."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.calls: list[tuple[str, int]] = []  # ("write" / "writelines", pieces)
        self.error: BaseException | None = None

    def write(self, data: bytes) -> None:
        self._keep("write", [data])

    def writelines(self, pieces: list[bytes]) -> None:
        self._keep("writelines", pieces)

    def _keep(self, how: str, pieces: list[bytes]) -> None:
        if self.error is not None:
            raise self.error
        if pieces == [b""]:  # nothing, as a transport's write(b"") does
            return
        self.calls.append((how, len(pieces)))
        self.chunks += pieces


def observed(
    steps: Steps,
    pumped: bool,
    limit: int | None = None,
    quick: tuple[int, float] | None = None,
    fallback: bool = False,
) -> tuple[Any, ...]:
    """Feed the chunks to a fresh tracker, sampling on where `limit` is given (a `Hook`; with
    `quick`, (seed, pick rate), a `QuickHook`): through a routed pump per direction, or with the
    C walk off as the relay's Python `data_received` does (`observe`, or `process` and its pieces
    written as it writes them). Every result the sinks and the hook are left with, whether each
    scanner failed, and the pieces forwarded each way and how (`write`, `writelines`).

    A pump whose scanner stops disarms and hands later chunks to its fallback: with `fallback`
    the relay's Python `data_received` (the fuzz target's inputs may stop a scanner), without it
    a failure of the test."""
    saved = frames.native_walk
    if not pumped:
        frames.native_walk = None
    try:
        registry = CollectorRegistry()
        hook: Hook | QuickHook | None = None
        if limit is not None:
            hook = Hook(limit) if quick is None else QuickHook(limit, *quick)
        tracker = ConnectionTracker(ProxyMetrics(registry), observer=hook)
        peers = {True: Peer(), False: Peer()}
        scanners = {True: tracker.request_scanner, False: tracker.response_scanner}

        def python(client: bool, chunk: bytes) -> None:
            scanner = scanners[client]
            if scanner.hold:
                pieces = scanner.process(chunk)
                if len(pieces) == 1:
                    peers[client].write(pieces[0])
                elif pieces:
                    peers[client].writelines(pieces)
            else:
                peers[client].write(chunk)
                scanner.observe(chunk)

        def disarmed(client: bool) -> Callable[[bytes], None]:
            if fallback:
                return lambda data: python(client, data)
            return lambda data: pytest.fail("disarmed")

        pumps = {}
        if pumped:
            for client, scanner in scanners.items():
                pump = Pump(disarmed(client), never_lost)
                pump.route(peers[client], scanner, frames.native_walk)
                scanner.pump = pump
                pump.armed = True
                pumps[client] = pump
        records = fed(
            tracker, steps, (lambda client, chunk: pumps[client](chunk)) if pumped else python
        )
        failed = (tracker.request_scanner.failed, tracker.response_scanner.failed)
        tracker.close("CANCELLED")
        forwarded = {side: (peer.chunks, peer.calls) for side, peer in peers.items()}
        return records, hook_records(hook), untimed_metrics(registry), failed, forwarded
    finally:
        frames.native_walk = saved


def sent(steps: list[tuple[bool, bytes]], client: bool) -> bytes:
    return b"".join(data for side, data in steps if side == client)


@settings(max_examples=examples(200), deadline=None)
@given(connections(), st.data())
def test_every_result_is_the_same_through_the_pump_and_through_python(
    steps: list[tuple[bool, bytes]], draw: st.DataObject
) -> None:
    """Sampling off: both directions in observe mode (written, then walked)."""
    cut_steps = cut_at_random(steps, draw)
    pumped = observed(cut_steps, pumped=True)
    reference = observed(cut_steps, pumped=False)
    assert pumped[:4] == reference[:4]
    assert pumped[3] == (False, False)  # observation never stopped
    for client in (True, False):  # every byte written, in order
        assert pumped[4][client] == reference[4][client]  # the same pieces, written alike
        assert b"".join(pumped[4][client][0]) == sent(steps, client)
    calls = sum(v for (name, _), v in pumped[2].items() if name == "xsp_requests_total")
    assert calls > 0


@settings(max_examples=examples(200), deadline=None)
@given(
    connections(),
    st.sampled_from([60, 1 << 20]),
    st.sampled_from([None, (7, 0.0), (11, 0.5), (13, 1.0)]),
    st.data(),
)
def test_sampling_on_every_result_is_the_same_through_the_pump_and_through_python(
    steps: list[tuple[bool, bytes]],
    limit: int,
    quick: tuple[int, float] | None,
    draw: st.DataObject,
) -> None:
    """Sampling on: the client's direction in hold mode (walked, then written: a sampled
    request's header block with its traceparent appended), with a hook that decides every
    request or one that lets the relay decide the unpicked ones (`QuickDecisions`)."""
    cut_steps = cut_at_random(steps, draw)
    pumped = observed(cut_steps, pumped=True, limit=limit, quick=quick)
    reference = observed(cut_steps, pumped=False, limit=limit, quick=quick)
    assert pumped[:4] == reference[:4]
    assert pumped[3] == (False, False)
    assert pumped[4] == reference[4]
    assert b"".join(pumped[4][False][0]) == sent(steps, False)


# -- the pump's own rules --------------------------------------------------------------------


def one_call() -> tuple[bytes, bytes]:
    """A client's preface and settings, then one unary request (headers and a DATA frame)."""
    conv = Conversation()
    preface = bytes(conv.client)
    conv.request(1, INFER, infer_bytes("m"))
    return preface, bytes(conv.client[len(preface) :])


def routed(peer: Peer, lost: Any = never_lost) -> tuple[Any, ConnectionTracker, list[Any]]:
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    fallback: list[Any] = []
    pump = Pump(fallback.append, lost)
    scanner = tracker.request_scanner
    pump.route(peer, scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    return pump, tracker, fallback


def test_a_disarmed_pump_hands_every_chunk_to_its_fallback() -> None:
    peer = Peer()
    pump, tracker, fallback = routed(peer)
    preface, request = one_call()
    pump(preface)
    pump.armed = False
    pump(request)
    assert fallback == [request] and peer.chunks == [preface]
    assert tracker.last_stream_id == 0  # the fallback did not scan it either
    pump.armed = True
    pump(bytearray(request))  # not bytes: the fallback's
    assert fallback == [request, bytearray(request)]


def test_an_armed_pump_writes_then_observes() -> None:
    peer = Peer()
    pump, tracker, fallback = routed(peer)
    preface, request = one_call()
    pump(preface)
    pump(request)
    assert peer.chunks == [preface, request] and not fallback
    assert tracker.last_stream_id == 1 and tracker.in_flight == 1
    assert tracker.request_scanner.at_frame_boundary()


def test_a_closed_peer_calls_lost_and_disarms() -> None:
    peer, lost = Peer(), Counter[str]()
    pump, tracker, _ = routed(peer, lambda: lost.update(["lost"]))
    preface, request = one_call()
    peer.error = RuntimeError("closed")
    pump(preface)
    assert lost == {"lost": 1} and not pump.armed and tracker.last_stream_id == 0
    peer.error = ValueError("not a closed transport")
    pump.armed = True
    with pytest.raises(ValueError):
        pump(request)


class Exploding:
    """A scanner's sink that delegates to the real one until `error` is set, then raises it
    from every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            if self.error is not None:
                raise self.error
            return method(*args)

        return call


@pytest.mark.parametrize("hold", [False, True], ids=["observe mode", "hold mode"])
@pytest.mark.parametrize("walkable", [False, True], ids=["python scans", "c walks"])
@pytest.mark.parametrize(
    ("error", "reason"), [(ScanError("bad_frame", "x"), "bad_frame"), (KeyError("k"), "internal")]
)
def test_an_exception_while_observing_stops_observing_as_python_does(
    error: Exception, reason: str, walkable: bool, hold: bool
) -> None:
    """Raised in the C walk (`walk_failed`, `hold_failed`) or in the scanner's Python
    (`observe_step`, `process_step`); in hold mode (the client's direction, sampling on)
    the chunk is released whole."""
    peer = Peer()
    tracker = ConnectionTracker(
        ProxyMetrics(CollectorRegistry()), observer=Hook(60) if hold else None
    )
    scanner = tracker.request_scanner if hold else tracker.response_scanner
    sink = Exploding(scanner.sink)
    scanner.sink = sink
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(peer, scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    assert pump.hold is hold
    ping = frames.ping_frame(b"12345678")
    first = one_call()[0] if hold else ping  # the client's preface and settings
    if walkable:
        pump(first)  # scanned in Python: from here the next chunk starts in the C walk
        sink.error = error
        pump(ping)
    else:
        sink.error = error
        pump(first + ping)
    assert scanner.failed and scanner.failure_reason == reason and not pump.armed
    assert b"".join(peer.chunks) == first + ping  # forwarding never broke


def test_a_stopped_scanner_disarms_its_pump_and_an_unrouted_one_cannot_be_armed() -> None:
    pump, tracker, _ = routed(Peer())
    tracker.close("CANCELLED")
    assert not pump.armed
    fresh = Pump(lambda data: None, never_lost)
    with pytest.raises(ValueError, match="routed"):
        fresh.armed = True


def test_a_pump_and_its_protocol_are_collected() -> None:
    class Protocol:
        def data_received(self, data: bytes) -> None:
            pass

    proto = Protocol()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    pump = Pump(proto.data_received, never_lost)
    pump.route(Peer(), tracker.response_scanner, frames.native_walk)
    vars(proto)["data_received"] = pump  # the cycle the relay makes
    gone = weakref.ref(proto)
    scanner_gone = weakref.ref(tracker.response_scanner)
    del proto, pump, tracker
    gc.collect()
    assert gone() is None and scanner_gone() is None


def test_release_drops_every_reference() -> None:
    pump, tracker, _ = routed(Peer())
    scanner = weakref.ref(tracker.request_scanner)
    tracker.request_scanner.pump = None
    pump.release()
    del tracker
    gc.collect()  # the tracker and its scanners hold each other; the live pump holds neither
    assert scanner() is None and not pump.armed
    assert pump(b"bytes after the connection is gone") is None


# -- through the relay ------------------------------------------------------------------------


@pytest.fixture
def backend() -> Iterator[int]:
    server, port = grpc_backend({"ModelInfer": unary(echo)})
    yield port
    server.stop(0)


def relayed_calls(
    port: int, calls: int, hook: Hook | None = None
) -> tuple[Counter[str], dict[Any, float]]:
    """`calls` unary calls on one connection through a relay (sampling on with `hook`); how
    often each Python `data_received` ran, and the relay's untimed /metrics."""
    ran: Counter[str] = Counter()
    saved = relay._ClientProtocol.data_received, relay._BackendProtocol.data_received

    def counted(cls: type, name: str) -> Any:
        inner = cls.data_received  # type: ignore[attr-defined]

        def data_received(self: Any, data: bytes) -> None:
            ran[name] += 1
            inner(self, data)

        return data_received

    relay._ClientProtocol.data_received = counted(relay._ClientProtocol, "client")  # type: ignore[method-assign]
    relay._BackendProtocol.data_received = counted(relay._BackendProtocol, "backend")  # type: ignore[method-assign]
    factory = None if hook is None else (lambda info: hook)
    side = RelayThread(Endpoint("127.0.0.1", port), observer_factory=factory)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{side.endpoint.port}") as channel:
            call = channel.unary_unary(INFER, None, None)
            for _ in range(calls):
                call(infer_bytes("add_sub"))
        # the channel is closed; the relay counts the connection's end when it reads the close
        # (under ASan that read once came after the snapshot)
        deadline = time.monotonic() + 10.0
        while side.registry.get_sample_value("xsp_connections_active") and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
        return ran, untimed_metrics(side.registry)
    finally:
        side.run(side.relay.shutdown(1.0))
        side.stop()
        relay._ClientProtocol.data_received, relay._BackendProtocol.data_received = saved  # type: ignore[method-assign]


def without_authority(seen: list[Any]) -> list[Any]:
    """A hook's records with each request's `:authority` left out."""
    out = []
    for entry in seen:
        if entry[0] == "start":
            headers = [h for h in entry[5] if h[0] != b":authority"]
            entry = (*entry[:5], headers, *entry[6:])
        out.append(entry)
    return out


@pytest.mark.parametrize("sampling", [False, True], ids=["sampling off", "sampling on"])
def test_steady_unary_calls_never_reach_pythons_data_received(
    backend: int, sampling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling on: a hook that samples every third call (a traceparent appended to its header
    block, its body kept), lets the relay end another third (a `QuietEnd`) and is asked of the
    rest; it must see the same either way."""
    hooks = (Hook(1 << 20), Hook(1 << 20)) if sampling else (None, None)
    pumped, pumped_metrics = relayed_calls(backend, 60, hooks[0])
    monkeypatch.setattr(relay, "native_pump", None)
    python, python_metrics = relayed_calls(backend, 60, hooks[1])
    # the pump: at most the chunks that came before the backend connected
    assert pumped["client"] <= 2 and pumped["backend"] == 0, pumped
    assert python["client"] >= 60 and python["backend"] >= 60, python
    assert pumped_metrics == python_metrics
    requests = {k: v for k, v in pumped_metrics.items() if k[0] == "xsp_requests_total"}
    assert sum(requests.values()) == 60
    if sampling:
        assert hooks[0] is not None and hooks[1] is not None
        seen = [without_authority(hook.seen) for hook in hooks]  # two relays, two ports
        assert seen[0] == seen[1] and hooks[0].ended == hooks[1].ended
        bodies = [seen for seen in hooks[0].seen if seen[0] == "body"]
        assert len(bodies) == 20  # streams 1, 7, 13, ...: every third call sampled


# -- which side runs each chunk ---------------------------------------------------------------


def entered_from_pump(pump: Any, chunk: bytes) -> Counter[str]:
    """The modules whose Python the pump itself called while it took `chunk` (the scanner's,
    frames.py; the sink's, streams.py; the peer's): Python called by Python is not counted."""
    here = sys._getframe()
    seen = Counter[str]()

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_back is here:
            seen[frame.f_code.co_filename.rsplit("/", 1)[-1]] += 1

    sys.setprofile(profile)
    try:
        pump(chunk)
    finally:
        sys.setprofile(None)
    return seen


def frame_aligned_calls(calls: int) -> list[bytes]:
    """A client's preface and settings, then `calls` unary requests, one chunk each."""
    conv = Conversation()
    out = [bytes(conv.client)]
    for sid in range(1, 2 * calls, 2):
        start = len(conv.client)
        conv.request(sid, INFER, infer_bytes("m"))
        out.append(bytes(conv.client[start:]))
    return out


def test_chunks_at_frame_boundaries_are_walked_in_c() -> None:
    """Observe mode: the first chunk is the scanner's Python's (the pump has not seen where it
    stands), every later one ending at a frame boundary the C walk's alone; re-arming, or a
    chunk handed to the fallback, sends the next one to Python again."""
    peer = Peer()
    pump, tracker, fallback = routed(peer)
    first, *rest = frame_aligned_calls(6)
    assert entered_from_pump(pump, first)["frames.py"] == 1
    for chunk in rest[:3]:
        assert entered_from_pump(pump, chunk)["frames.py"] == 0
    pump.armed = True
    assert entered_from_pump(pump, rest[3])["frames.py"] == 1
    assert entered_from_pump(pump, rest[4])["frames.py"] == 0
    pump(bytearray())  # not bytes: to the fallback, which may scan
    assert fallback == [bytearray()]
    assert entered_from_pump(pump, rest[5])["frames.py"] == 1
    assert peer.calls == [("write", 1)] * 7 and b"".join(peer.chunks) == b"".join([first, *rest])
    assert tracker.last_stream_id == 11


def test_hold_mode_writes_a_chunk_whole_without_pythons_scanner() -> None:
    """Hold mode: a chunk the walk took whole with nothing to add to a header block is written
    whole, in one `write`, and the scanner's Python never runs for it; a sampled request's
    chunk goes through the scanner's Python and is written in pieces."""
    peer = Peer()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Hook(60))
    scanner = tracker.request_scanner
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(peer, scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    assert pump.hold
    for i, chunk in enumerate(frame_aligned_calls(12)):
        calls, pieces = len(peer.calls), len(peer.chunks)
        python = entered_from_pump(pump, chunk)["frames.py"]
        made = peer.calls[calls:]
        if i == 0:
            assert python == 1 and made == [("write", 1)]
        elif made == [("write", 1)] and peer.chunks[pieces:] == [chunk]:
            assert python == 0
        else:
            assert python >= 1 and made[0][0] == "writelines"
    assert ("write", 1) in peer.calls[1:] and ("writelines", 2) in peer.calls


@pytest.mark.parametrize("hold", [False, True], ids=["observe mode", "hold mode"])
def test_chunks_leak_no_references(hold: bool) -> None:
    """A chunk's references (the peer's write and writelines, `lost`, the scanner, the walk, the
    walk's arguments) are all dropped again, on every path: the walk, the scanner's Python, a
    closed peer, the fallback."""
    peer = Peer()
    tracker = ConnectionTracker(
        ProxyMetrics(CollectorRegistry()), observer=Hook(60) if hold else None
    )
    scanner = tracker.request_scanner
    lost = Counter[str]()

    def on_lost() -> None:
        lost.update(["lost"])

    # the peer's methods held as attributes: the pump gets the same objects, whose counts show
    transport = SimpleNamespace(write=peer.write, writelines=peer.writelines)
    pump = Pump(lambda data: None, on_lost)
    pump.route(transport, scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    chunks_ = frame_aligned_calls(40)
    watched = (
        peer,
        transport.write,
        transport.writelines,
        on_lost,
        scanner,
        frames.native_walk,
        scanner.sink,
        scanner.tracker,
    )
    pump(chunks_[0])
    for chunk in chunks_[1:5]:
        pump(chunk)
    gc.collect()
    before = [sys.getrefcount(x) for x in watched]
    for chunk in chunks_[5:35]:
        pump(chunk)
    pump.armed = True  # the next chunk to the scanner's Python
    pump(chunks_[35])
    pump(bytearray(chunks_[36]))  # to the fallback
    peer.error = RuntimeError("closed")
    pump(chunks_[37])
    assert lost and not pump.armed
    tracker.close("CANCELLED")
    gc.collect()
    after = [sys.getrefcount(x) for x in watched]
    assert after == before


def test_the_pumps_arguments_are_checked() -> None:
    """Pump(fallback, lost) takes two callables; route(transport, scanner, walk) three
    arguments, the last callable, and not once released; a call takes one argument; deleting
    `armed` disarms."""
    for args in ((1, never_lost), (never_lost, 1)):
        with pytest.raises(TypeError):
            Pump(*args)
    pump, tracker, fallback = routed(Peer())
    scanner = tracker.request_scanner
    for bad in ((Peer(), scanner), (Peer(), scanner, 1), (Peer(), scanner, frames.native_walk, 1)):
        with pytest.raises(TypeError):
            pump.route(*bad)
    with pytest.raises(AttributeError):  # a transport without write
        pump.route(object(), scanner, frames.native_walk)
    assert pump.armed  # a failed route changed nothing
    with pytest.raises(TypeError):
        pump()
    with pytest.raises(TypeError):
        pump(b"a", b"b")
    with pytest.raises(TypeError):
        pump(data=b"a")
    del pump.armed
    assert not pump.armed
    pump(b"x")
    assert fallback == [b"x"]
    pump.release()
    with pytest.raises(ValueError, match="released"):
        pump.route(Peer(), scanner, frames.native_walk)


def test_a_pump_leaves_the_collector_before_it_drops_its_references() -> None:
    """Code its references run when freed (a `__del__`) may run the cycle collector: the pump
    being freed must not be among the objects it tracks (it would free it a second time)."""
    assert tracked_while_freed(lambda watcher: Pump(watcher, never_lost)) == [False]


def test_a_freed_pump_returns_its_memory() -> None:
    """2,000 pumps made and dropped keep no memory (each is about 130 bytes)."""
    grown = memory_kept_by(lambda: Pump(never_lost, never_lost))
    assert grown < 16 * 1024, grown


class Boom(Exception):
    """An exception that can be watched (weak references)."""


class Marker:
    pass


@pytest.mark.parametrize("walk", ["python", "c"])
def test_the_walks_exception_reaches_the_scanner_whole_and_is_released(walk: str) -> None:
    """What the walk raised reaches `scanner.walk_failed` as the exception itself, with its
    traceback (a Python walk's frame), normalized where C raised it (`max` comparing the walk's
    arguments: a TypeError whose value C set as a string); after it the exception, its type
    and its traceback's frames are released."""
    watched: list[weakref.ref[Any]] = []

    def python_walk(*args: object) -> int:
        marker = Marker()  # kept alive by the frame, itself by the traceback
        boom = Boom()
        watched.extend([weakref.ref(marker), weakref.ref(boom)])
        raise boom

    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    scanner = tracker.response_scanner
    seen: list[tuple[type, str | None]] = []
    walk_failed = scanner.walk_failed

    def recorded(exc: BaseException) -> Marker:  # what it returns is dropped too
        tb = exc.__traceback__
        seen.append((type(exc), None if tb is None else tb.tb_frame.f_code.co_name))
        walk_failed(exc)
        answer = Marker()
        watched.append(weakref.ref(answer))
        return answer

    scanner.walk_failed = recorded  # type: ignore[method-assign,assignment]
    peer = Peer()
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(peer, scanner, python_walk if walk == "python" else max)
    scanner.pump = pump
    pump.armed = True
    ping = frames.ping_frame(b"12345678")
    pump(ping)  # the scanner's Python: from here the next chunk starts in the walk
    raised = Boom if walk == "python" else TypeError
    held = sys.getrefcount(raised)
    pump(ping)
    assert seen == [(raised, "python_walk" if walk == "python" else None)]
    assert scanner.failed and scanner.failure_reason == "internal" and not pump.armed
    seen.clear()
    gc.collect()
    assert [ref() for ref in watched] == [None] * len(watched)
    assert sys.getrefcount(raised) == held


def test_what_the_transport_returns_is_released() -> None:
    """Whatever the transport's `write` returns (None from asyncio's) is dropped."""
    returned: list[weakref.ref[Marker]] = []

    class Transport:
        def write(self, data: bytes) -> Marker:
            marker = Marker()
            returned.append(weakref.ref(marker))
            return marker

        def writelines(self, pieces: list[bytes]) -> None:
            pytest.fail("observe mode writes each chunk whole")

    pump, _tracker, _ = routed(Transport())  # type: ignore[arg-type]
    preface, request = one_call()
    pump(preface)
    pump(request)
    assert len(returned) == 2 and [ref() for ref in returned] == [None, None]


def test_what_lost_returns_is_released() -> None:
    returned: list[weakref.ref[Marker]] = []

    def lost() -> Marker:
        marker = Marker()
        returned.append(weakref.ref(marker))
        return marker

    peer = Peer()
    pump, _tracker, _ = routed(peer, lost)
    peer.error = RuntimeError("closed")
    pump(one_call()[0])
    assert len(returned) == 1 and returned[0]() is None


def walked_by(walk: Any, hold: bool) -> Any:
    """An armed pump on a request scanner (hold mode: a hook that holds), walked by `walk`."""
    tracker = ConnectionTracker(
        ProxyMetrics(CollectorRegistry()), observer=Hook(60) if hold else None
    )
    scanner = tracker.request_scanner
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(Peer(), scanner, walk)
    scanner.pump = pump
    pump.armed = True
    return pump


@pytest.mark.parametrize("hold", [False, True], ids=["observe mode", "hold mode"])
def test_where_the_walk_stopped_is_released(hold: bool) -> None:
    """The walk's answer (where it stopped: an int, one object per value here, so its count
    shows) is dropped after each chunk, the walk's whole or the scanner's Python's rest."""
    ends: dict[int, int] = {}
    walk_in_c = frames.native_walk
    assert walk_in_c is not None

    def walk(*args: Any) -> int:
        end = walk_in_c(*args)
        return ends.setdefault(end, end)

    pump = walked_by(walk, hold)
    first, *calls = frame_aligned_calls(400)
    chunks_ = [first]
    for i in range(0, len(calls), 10):  # whole chunks and chunks cut inside a frame, in turn
        chunk = b"".join(calls[i : i + 10])
        chunks_ += [chunk] if i % 20 else [chunk[:300], chunk[300:]]

    def counts() -> dict[str, int]:  # past 256: not CPython's shared small ints
        return {str(end): sys.getrefcount(obj) for end, obj in ends.items() if end > 256}

    for chunk in chunks_[:5]:
        pump(chunk)
    before = counts()
    for chunk in chunks_[5:]:
        pump(chunk)
    assert before and {end: n for end, n in counts().items() if end in before} == before


@pytest.mark.parametrize("hold", [False, True], ids=["observe mode", "hold mode"])
def test_a_walk_that_answers_no_int_fails_the_call(hold: bool) -> None:
    """Where the walk stopped must be an int: anything else raises TypeError from the pump's
    call, and the answer is dropped."""
    answers: list[weakref.ref[Marker]] = []

    def walk(*args: object) -> Marker:
        answer = Marker()
        answers.append(weakref.ref(answer))
        return answer

    pump = walked_by(walk, hold)
    first, call, *_ = frame_aligned_calls(1)
    pump(first)  # the scanner's Python: from here the next chunk starts in the walk
    with pytest.raises(TypeError) as raised:
        pump(call)
    assert str(raised.value) == "an integer is required"  # PyLong_AsSsize_t's, not later's
    del raised
    assert len(answers) == 1 and answers[0]() is None


@pytest.mark.parametrize(
    "answer", [[[], True], ([b"x"], True, 0), ((b"x",), True), ([b"x"],)], ids=repr
)
def test_a_hold_mode_answer_not_pieces_and_bool_fails_the_call(answer: object) -> None:
    """In hold mode the scanner's Python answers (list of pieces, bool); anything else is a
    TypeError from the pump's call, and the answer is dropped."""
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Hook(60))
    scanner = tracker.request_scanner
    scanner.process_step = lambda data: answer  # type: ignore[method-assign,assignment,return-value]
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(Peer(), scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    held = sys.getrefcount(answer)
    with pytest.raises(TypeError, match="without"):
        pump(one_call()[0])
    assert sys.getrefcount(answer) == held  # the answer is dropped


def test_after_the_scanners_python_raised_the_next_chunk_asks_it_again() -> None:
    """Where the scanner's Python raised (here `observe_rest`, for a chunk cut inside a frame),
    the pump does not know where it stands: the next chunk goes to the scanner's Python, not
    to the walk."""
    pump, tracker, _ = routed(Peer())
    scanner = tracker.request_scanner
    first, call, _ = frame_aligned_calls(2)
    pump(first)

    def rest(*args: object) -> None:
        raise LookupError("the scanner's Python")

    scanner.observe_rest = rest  # type: ignore[method-assign,assignment]
    with pytest.raises(LookupError):
        pump(call[:-3])
    # a PING: the walk would take it whole, with nothing to give the scanner's Python
    assert entered_from_pump(pump, frames.ping_frame(b"12345678"))["frames.py"] >= 1


def pump_on_scanner(walk: Any, hold: bool) -> tuple[Any, Any]:
    """`walked_by`'s pump and the scanner it is routed to."""
    tracker = ConnectionTracker(
        ProxyMetrics(CollectorRegistry()), observer=Hook(60) if hold else None
    )
    scanner = tracker.request_scanner
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(Peer(), scanner, walk)
    scanner.pump = pump
    pump.armed = True
    return pump, scanner


def answering(scanner: Any, name: str, answer: Callable[..., object]) -> list[tuple[Any, ...]]:
    """Replace the scanner's method `name` by one that records its arguments and returns
    `answer(*arguments)`; the record."""
    seen: list[tuple[Any, ...]] = []

    def method(*args: Any) -> object:
        seen.append(args)
        return answer(*args)

    setattr(scanner, name, method)
    return seen


@pytest.mark.parametrize("hold", [False, True], ids=["observe mode", "hold mode"])
def test_what_the_scanners_python_answers_is_released(hold: bool) -> None:
    """Where the scanner's Python says it stands (observe mode: a truth value; hold mode:
    (pieces, truth value)), from a whole chunk or from where the walk stopped, is dropped
    after the chunk: here each answer holds a fresh object, which must not outlive it."""
    made: list[weakref.ref[Marker]] = []

    def answer(*args: object) -> object:
        marker = Marker()  # truthy: the next chunk starts in the walk
        made.append(weakref.ref(marker))
        return ([b"x"], marker) if hold else marker

    pump, scanner = pump_on_scanner(frames.native_walk, hold)
    step, rest = ("process_step", "process_rest") if hold else ("observe_step", "observe_rest")
    steps, rests = answering(scanner, step, answer), answering(scanner, rest, answer)
    first, call, _ = frame_aligned_calls(2)
    pump(first)  # the scanner's Python (step) answers
    pump(call[:-3])  # the walk stops inside the last frame: the scanner's Python (rest)
    assert len(steps) == 1 and len(rests) == 1 and len(made) == 2
    gc.collect()
    assert [ref() for ref in made] == [None, None]


class Stop(BaseException):
    """Not an Exception: the scanner's Python raises it on (as it would KeyboardInterrupt)."""


@pytest.mark.parametrize(
    "failure",
    ["observe: the walk raises past the scanner", "hold: the walk raises past the scanner",
     "hold: the rest raises", "hold: the rest answers badly"],
)  # fmt: skip
def test_where_a_chunk_failed_the_next_asks_the_scanners_python(failure: str) -> None:
    """Where a chunk's walk or the scanner's Python for its rest failed and the pump stays
    armed (an exception that is not an Exception; the scanner's own Python raising or
    answering badly), the pump does not know where the scanner stands: the next chunk goes
    to the scanner's Python (step), not to the walk."""
    hold = failure.startswith("hold")
    walk_in_c = frames.native_walk
    assert walk_in_c is not None
    stop = [False]

    def walk(*args: Any) -> int:
        if stop[0]:
            stop[0] = False
            raise Stop
        return walk_in_c(*args)

    pump, scanner = pump_on_scanner(walk, hold)
    first, call, after, _ = frame_aligned_calls(3)
    pump(first)  # the real scanner's Python: the next chunk starts in the walk
    expected: type[BaseException] = Stop
    if failure.endswith("raises past the scanner"):
        stop[0] = True
    elif failure.endswith("rest raises"):

        def rest(*args: object) -> None:
            raise LookupError("the scanner's Python")

        scanner.process_rest = rest
        expected = LookupError
    else:
        scanner.process_rest = lambda *args: ([b"x"],)
        expected = TypeError
    with pytest.raises(expected):
        pump(call[:-3])  # cut inside a frame: the walk stops short, the rest to Python
    assert pump.armed
    step = "process_step" if hold else "observe_step"
    steps = answering(scanner, step, lambda *args: ([], False) if hold else False)
    pump(after)
    assert len(steps) == 1


@pytest.mark.parametrize("hold", [False, True], ids=["observe mode", "hold mode"])
def test_only_an_int_from_the_walk_reaches_the_scanners_python(hold: bool) -> None:
    """The walk's answer goes to the scanner's Python (rest) as the int it is, even one
    outside the chunk (-1 here, which is no error); an answer that is no int fails the call
    before any Python of the scanner runs."""
    answers: list[object] = [-1]

    def walk(*args: object) -> object:
        return answers[0]

    pump, scanner = pump_on_scanner(walk, hold)
    rest = "process_rest" if hold else "observe_rest"
    rests = answering(scanner, rest, lambda *args: ([], True) if hold else True)
    first, call, after, _ = frame_aligned_calls(3)
    pump(first)
    pump(call)
    assert rests == [(call, -1)]
    answers[0] = Marker()
    with pytest.raises(TypeError, match="an integer is required"):
        pump(after)
    assert len(rests) == 1


def recording_walk() -> tuple[Callable[..., int], list[tuple[bytes, int]]]:
    """The C walk, and the (chunk, start) of each call made to it."""
    walk_in_c = frames.native_walk
    assert walk_in_c is not None
    walked: list[tuple[bytes, int]] = []

    def walk(sink: Any, data: bytes, start: int, *rest: Any) -> int:
        walked.append((data, start))
        return walk_in_c(sink, data, start, *rest)

    return walk, walked


def test_after_the_fallback_took_a_chunk_the_next_asks_the_scanners_python() -> None:
    """A chunk the pump hands to its fallback (here: not bytes) is scanned by the relay's
    Python, which may leave the scanner inside a frame: the next chunk, once armed again,
    goes to the scanner's Python, not to the walk, and the call is read whole."""
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    scanner = tracker.request_scanner
    walk, walked = recording_walk()

    pump = Pump(lambda data: scanner.observe(bytes(data)), never_lost)
    pump.route(Peer(), scanner, walk)
    scanner.pump = pump
    pump.armed = True
    first, call, after = frame_aligned_calls(2)
    pump(first)  # the scanner's Python: from here the next chunk would start in the walk
    pump(bytearray(call[:12]))  # the fallback: the scanner now stands inside a frame
    assert not scanner.at_frame_boundary()
    rest = call[12:]
    pump(rest)
    assert (rest, 0) not in walked  # the scanner's Python (observe_step), from where it stood
    pump(after)
    assert tracker.last_stream_id == 3 and tracker.in_flight == 2 and not scanner.failed


class Unpicking(Hook):
    """Holds (hold mode) but picks nothing and wants no end: every request is the walk's."""

    def on_request_headers(self, start: Any) -> None:
        self.seen.append(("start", *start))


def test_hold_mode_leaks_no_reference_to_the_scanners_pieces() -> None:
    """In hold mode a chunk the walk takes whole is written as it is after the pump reads the
    scanner's `out` (empty: nothing emitted); that read's reference is dropped."""
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Unpicking(60))
    scanner = tracker.request_scanner
    assert scanner.hold
    peer = Peer()
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(peer, scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    first, *calls = frame_aligned_calls(60)
    pump(first)
    pump(calls[0])
    out = scanner.out
    held = sys.getrefcount(out)
    for call in calls[1:]:
        pump(call)
    now = sys.getrefcount(out)  # outside the assert: pytest's rewriting holds its operands
    assert scanner.out is out
    assert now == held
    assert peer.chunks[-len(calls) :] == calls  # each written whole


class Truth:
    """A truth value of its own (weakly referable, so a leaked reference shows), or one whose
    bool() raises."""

    def __init__(self, value: bool | None) -> None:
        self.value = value

    def __bool__(self) -> bool:
        if self.value is None:
            raise LookupError("no truth value")
        return self.value


class Scanned:
    """What route() reads of a scanner, each attribute settable."""

    def __init__(self, client_side: object, hold: object) -> None:
        self.sink = self.streams = self.header_cache = self.tracker = None
        self.client_side = client_side
        self.hold = hold


def test_route_releases_the_truth_values_it_reads() -> None:
    """route() reads the scanner's `client_side` and `hold` as truth values and keeps neither."""
    pump = Pump(lambda data: None, never_lost)
    side, hold = Truth(True), Truth(False)
    refs = weakref.ref(side), weakref.ref(hold)
    scanner = Scanned(side, hold)
    pump.route(Peer(), scanner, frames.native_walk)
    del side, hold
    scanner.client_side = scanner.hold = None
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


@pytest.mark.parametrize("failing", ["client_side", "hold", "a missing hold"])
def test_a_failed_route_raises_and_releases_what_it_read(failing: str) -> None:
    """Where reading the scanner fails (bool() raises, an attribute is missing), route()
    raises that error and drops every attribute it had read, the transport's first."""
    pump = Pump(lambda data: None, never_lost)
    peer = Peer()
    transport = SimpleNamespace(write=peer.write, writelines=peer.writelines)
    scanner = Scanned(Truth(True), Truth(True))
    if failing == "a missing hold":
        del scanner.hold
    else:
        setattr(scanner, failing, Truth(None))
    watched = (transport.write, transport.writelines, scanner.client_side)
    before = [sys.getrefcount(x) for x in watched]
    expected = AttributeError if failing == "a missing hold" else LookupError
    with pytest.raises(expected):
        pump.route(transport, scanner, frames.native_walk)
    after = [sys.getrefcount(x) for x in watched]
    assert after == before


def test_a_pump_routed_again_asks_the_new_scanners_python_first() -> None:
    """route() forgets where the last scanner stood: the first chunk after it goes to the new
    scanner's Python (which says where it stands), not straight to the walk."""
    walk, walked = recording_walk()

    pump, _tracker, _ = routed(Peer())
    first, call, _ = frame_aligned_calls(2)
    pump(first)
    pump(call)  # walkable: walked in C
    fresh = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    scanner = fresh.request_scanner
    pump.route(Peer(), scanner, walk)  # still armed (setting `armed` would also forget)
    scanner.pump = pump
    assert pump.armed
    pump(first)  # the new scanner's preface: only its Python knows to expect one
    assert (first, 0) not in walked
    assert fresh.request_scanner.at_frame_boundary() and not fresh.failed


def test_the_fallback_is_released_after_each_chunk_it_takes() -> None:
    """A disarmed pump hands each chunk to its fallback, holding it only for the call."""
    taken: list[bytes] = []

    def fallback(data: bytes) -> None:
        taken.append(data)

    pump = Pump(fallback, never_lost)
    held = sys.getrefcount(fallback)
    for i in range(100):
        pump(b"%d" % i)
    now = sys.getrefcount(fallback)
    assert len(taken) == 100
    assert now == held
