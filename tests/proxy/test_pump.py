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
import itertools
import weakref
from collections import Counter
from collections.abc import Iterator
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
from tests.proxy.proxy_h2build import Conversation
from tests.proxy.proxy_harness import RelayThread, grpc_backend, unary
from tests.proxy.test_framewalk import snapshot
from tests.proxy.test_framewalk_streams import connections, cut_at_random, untimed_metrics
from tests.proxy.test_proxy_relay import INFER, echo, infer_bytes

pytestmark = pytest.mark.skipif(
    relay.native_pump is None or frames.native_walk is None or streams._NativeStream is None,
    reason="the relay's C extensions are not built here",
)
Pump: Any = relay.native_pump
Steps = list[tuple[bool, bytes, list[int]]]


def never_lost() -> None:
    raise AssertionError("the peer was never closed")


def observed(steps: Steps, pumped: bool) -> tuple[Any, ...]:
    """Feed the chunks to a fresh tracker (observe mode): through a routed pump per direction,
    or with the C walk off through `observe`. Every result the sinks leave, and the bytes each
    pump wrote."""
    saved = frames.native_walk
    if not pumped:
        frames.native_walk = None
    try:
        registry = CollectorRegistry()
        tracker = ConnectionTracker(ProxyMetrics(registry))
        written: dict[bool, list[bytes]] = {True: [], False: []}
        feed = {
            True: tracker.request_scanner.observe,
            False: tracker.response_scanner.observe,
        }
        if pumped:
            for client, scanner in (
                (True, tracker.request_scanner),
                (False, tracker.response_scanner),
            ):
                pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
                pump.route(written[client].append, scanner, frames.native_walk)
                scanner.pump = pump
                pump.armed = True
                feed[client] = pump
        records = []
        for client, data, cuts in steps:
            edges = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
            for a, b in itertools.pairwise(edges):
                feed[client](data[a:b])
                records.append(
                    (snapshot(tracker), tracker.last_stream_id, tracker.metrics.open_streams)
                )
        failed = (tracker.request_scanner.failed, tracker.response_scanner.failed)
        tracker.close("CANCELLED")
        forwarded = {side: b"".join(chunks) for side, chunks in written.items()}
        return records, untimed_metrics(registry), failed, forwarded
    finally:
        frames.native_walk = saved


@settings(max_examples=200, deadline=None)
@given(connections(), st.data())
def test_every_result_is_the_same_through_the_pump_and_through_python(
    steps: list[tuple[bool, bytes]], draw: st.DataObject
) -> None:
    cut_steps = cut_at_random(steps, draw)
    pumped = observed(cut_steps, pumped=True)
    reference = observed(cut_steps, pumped=False)
    assert pumped[:3] == reference[:3]
    assert pumped[2] == (False, False)  # observation never stopped
    for client in (True, False):  # every byte written, in order
        assert pumped[3][client] == b"".join(data for side, data in steps if side == client)
    calls = sum(v for (name, _), v in pumped[1].items() if name == "xsp_requests_total")
    assert calls > 0


# -- the pump's own rules --------------------------------------------------------------------


class Peer:
    """A peer transport's `write`: keeps the chunks, or raises `error` once set."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.error: BaseException | None = None

    def write(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.chunks.append(data)


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
    pump.route(peer.write, scanner, frames.native_walk)
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


@pytest.mark.parametrize("walkable", [False, True], ids=["python observes", "c walks"])
@pytest.mark.parametrize(
    ("error", "reason"), [(ScanError("bad_frame", "x"), "bad_frame"), (KeyError("k"), "internal")]
)
def test_an_exception_while_observing_stops_observing_as_observe_does(
    error: Exception, reason: str, walkable: bool
) -> None:
    """Raised in the C walk (`_walk_failed`) or in the Python scanner (`_observe_step`)."""
    peer = Peer()
    scanner = ConnectionTracker(ProxyMetrics(CollectorRegistry())).response_scanner
    sink = Exploding(scanner.sink)
    scanner.sink = sink
    pump = Pump(lambda data: pytest.fail("disarmed"), never_lost)
    pump.route(peer.write, scanner, frames.native_walk)
    scanner.pump = pump
    pump.armed = True
    ping = frames.ping_frame(b"12345678")
    if walkable:
        pump(ping)  # through _observe_step: from here the next chunk starts in the C walk
    sink.error = error
    pump(ping)
    assert scanner.failed and scanner.failure_reason == reason and not pump.armed
    assert peer.chunks == [ping] * (1 + walkable)  # forwarding never broke


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
    pump.route(Peer().write, tracker.response_scanner, frames.native_walk)
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


def relayed_calls(port: int, calls: int) -> tuple[Counter[str], dict[Any, float]]:
    """`calls` unary calls on one connection through a relay; how often each Python
    `data_received` ran, and the relay's untimed /metrics."""
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
    side = RelayThread(Endpoint("127.0.0.1", port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{side.endpoint.port}") as channel:
            call = channel.unary_unary(INFER, None, None)
            for _ in range(calls):
                call(infer_bytes("add_sub"))
        return ran, untimed_metrics(side.registry)
    finally:
        side.run(side.relay.shutdown(1.0))
        side.stop()
        relay._ClientProtocol.data_received, relay._BackendProtocol.data_received = saved  # type: ignore[method-assign]


def test_steady_unary_calls_never_reach_pythons_data_received(
    backend: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pumped, pumped_metrics = relayed_calls(backend, 60)
    monkeypatch.setattr(relay, "native_pump", None)
    python, python_metrics = relayed_calls(backend, 60)
    # the pump: at most the chunks that came before the backend connected
    assert pumped["client"] <= 2 and pumped["backend"] == 0, pumped
    assert python["client"] >= 60 and python["backend"] >= 60, python
    assert pumped_metrics == python_metrics
    requests = {k: v for k, v in pumped_metrics.items() if k[0] == "xsp_requests_total"}
    assert sum(requests.values()) == 60
