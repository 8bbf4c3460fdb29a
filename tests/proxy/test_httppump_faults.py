"""The HTTP relay's C pump (`_httppump.c`) where the property tests (test_httppump.py) do not
reach: faults in what it reads, its limits, and what it holds and releases.

On every request the pump reads Python objects: the reader, the book, the route cache, the
route, the metrics and the hook's `quick`. They are the relay's and the hook's, and may be
anything. Observation can fail; forwarding must not. Each fault here (an attribute that
raises, a value of another type, a write or an append that fails) goes through a client
protocol with the pump and one without: both forward every byte, stop observing at the same
chunk and count it once, and book the same before it; only the backend's own write failing
raises, in both. The faults only the C path can meet (its route cache, the objects `route()`
hands it) leave the connection to Python's reader, which goes on as without the pump, or,
where the pump had forwarded part of the chunk, stop its observation. Then each path's
references, counted over many rounds: nothing the pump reads or makes is kept.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import sys
import time
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.proxy.http.calls import Call
from sidecar.proxy.http.limits import HttpLimits
from sidecar.proxy.http.relay import _ClientProtocol
from sidecar.proxy.streams import QuickDecisions
from tests.proxy.faults import RAISES, READ_ONLY, Faulty, Injected, NoBool, raising_rand
from tests.proxy.native_lifetimes import memory_kept_by, tracked_while_freed
from tests.proxy.test_httppump import (
    BODY,
    HEADER,
    INFER,
    Hook,
    Pump,
    Transport,
    client,
    run_both,
    state,
)

pytestmark = pytest.mark.skipif(Pump is None, reason="_httppump not built (or XSP_NATIVE=off)")

LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: h\r\n\r\n"  # never replayed: `not_replayable`
READY = b"GET /v2/models/m/ready HTTP/1.1\r\nHost: h\r\n\r\n"  # replayable: the hook's
CHUNKED = (
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n"
)  # handed on to Python's reader
# every path of a request's start: unpicked, not replayable, the hook's, a block whose body
# follows, and a chunk that is one taken request and one the pump hands on
CHUNKS = [INFER, LIVE, READY, HEADER, BODY, INFER + LIVE, INFER * 2 + LIVE]

Side = tuple[Any, Transport, Transport]


class RaisingSet(frozenset):  # type: ignore[type-arg]
    """A method set whose `in` raises."""

    def __contains__(self, item: object) -> bool:
        raise Injected("no membership")


class RaisingDeque(deque):  # type: ignore[type-arg]
    """The book's FIFO, but an append raises."""

    def append(self, item: Any) -> None:
        raise Injected("no append")


class Tally:
    """A count whose sum is a new Tally; every live one is in `Tally.live`, so a sum the pump
    made and did not drop shows there."""

    live = 0

    def __init__(self) -> None:
        Tally.live += 1

    def __del__(self) -> None:
        Tally.live -= 1

    def __add__(self, other: object) -> Tally:
        return Tally()


class UnwritableCounts(list):  # type: ignore[type-arg]
    """`quick.started`, but [0] holds a Tally and cannot be written."""

    def __init__(self) -> None:
        super().__init__([Tally()])

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Injected("no count")


def raising(*args: Any) -> Any:
    raise Injected("no answer")


# -- faults both paths meet --------------------------------------------------------------------


def quick(**faults: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        hook.quick = Faulty(hook.quick, faults)  # type: ignore[assignment]

    return apply


def coin(**faults: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        hook.quick.coin = Faulty(hook.quick.coin, faults)

    return apply


def hot(**faults: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        hook.quick.coin.hot = Faulty(hook.quick.coin.hot, faults)

    return apply


def on_quick(name: str, value: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        setattr(hook.quick, name, value() if callable(value) else value)

    return apply


def on_book(name: str, value: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        setattr(side[0].book, name, value() if callable(value) else value)

    return apply


def on_metrics(name: str, value: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        setattr(side[0].book.metrics, name, value)

    return apply


def quick_unreadable(side: Side, hook: Hook) -> None:
    type(hook).quick = property(raising)  # type: ignore[assignment]


def quick_absent(side: Side, hook: Hook) -> None:
    def absent(_: Any) -> Any:
        raise AttributeError("quick")

    type(hook).quick = property(absent)  # type: ignore[assignment]


def quick_absent_then_none(side: Side, hook: Hook) -> None:
    """Reads of `quick` alternate: AttributeError, None. Where the C pump meets the first and
    hands the chunk on, Python's reader meets the second: an error the pump left set would
    meet no read that replaces it, and would surface."""
    reads = itertools.count()

    def flips(_: Any) -> Any:
        if next(reads) % 2 == 0:
            raise AttributeError("quick")
        return None

    type(hook).quick = property(flips)  # type: ignore[assignment]


class FaultyRoutes:
    """The reader's routes, but each route has `faults` (or `http_route` itself raises)."""

    def __init__(self, inner: Any, faults: dict[str, Any]) -> None:
        self.inner, self.faults = inner, faults

    def http_route(self, verb: bytes, target: bytes) -> Any:
        if self.faults.get("http_route") is RAISES:
            raise Injected("no route")
        return Faulty(self.inner.http_route(verb, target), self.faults)


def routes(**faults: Any) -> Any:
    def apply(side: Side, hook: Hook) -> None:
        reader = side[0].requests
        reader.routes = FaultyRoutes(reader.routes, faults)

    return apply


def backend_write_raises(side: Side, hook: Hook) -> None:
    side[2].error = lambda: Injected("no write")


# fault -> (what it does to a side and its hook, the error both raise: None for none, rate)
BOTH: dict[str, tuple[Any, type[BaseException] | None, float]] = {
    "quick unreadable": (quick_unreadable, Injected, 0.0),
    "quick absent (AttributeError): the hook's": (quick_absent, None, 0.0),
    "quick None: the hook's": (lambda side, hook: setattr(hook, "quick", None), None, 0.0),
    "quick absent, then None: the hook's": (quick_absent_then_none, None, 0.0),
    "per_call unreadable": (quick(per_call=RAISES), Injected, 0.0),
    "per_call's in raises": (on_quick("per_call", RaisingSet({"ModelInfer"})), Injected, 0.0),
    "replayable unreadable": (quick(replayable=RAISES), Injected, 0.0),
    "replayable's in raises": (on_quick("replayable", RaisingSet()), Injected, 0.0),
    "not_replayable unreadable": (quick(not_replayable=RAISES), Injected, 0.0),
    "unpicked unreadable": (quick(unpicked=RAISES), Injected, 0.0),
    "started unreadable": (quick(started=RAISES), Injected, 0.0),
    "started a tuple": (on_quick("started", (0,)), TypeError, 0.0),
    "started's count no number": (on_quick("started", lambda: ["x"]), TypeError, 0.0),
    "started unwritable": (on_quick("started", UnwritableCounts), Injected, 0.0),
    "coin unreadable": (quick(coin=RAISES), Injected, 0.0),
    "hot unreadable": (coin(hot=RAISES), Injected, 0.0),
    "force_header unreadable": (hot(force_header=RAISES), Injected, 0.0),
    "force_header a str": (hot(force_header="x-force"), TypeError, 0.0),
    "force_header None: the coin decides": (hot(force_header=None), None, 0.0),
    "pick_rate unreadable": (hot(pick_rate=RAISES), Injected, 0.0),
    "pick_rate no number": (hot(pick_rate="x"), TypeError, 0.0),
    "rand unreadable": (coin(rand=RAISES), Injected, 0.0),
    "rand raises": (coin(rand=raising_rand), Injected, 0.0),
    "rand answers no number": (coin(rand=lambda: "x"), TypeError, 0.0),
    "picked, rand raises": (coin(rand=raising_rand), Injected, 1.0),
    "a draw at the rate: unpicked": (coin(rand=lambda: 0.25), None, 0.25),
    "a draw under the rate: picked": (coin(rand=lambda: 0.2499), None, 0.25),
    # -1.0 is also a float's error return in C: here a number, and no error
    "a draw of -1.0: picked": (coin(rand=lambda: -1.0), None, 0.25),
    "a rate of -1.0: unpicked": (hot(pick_rate=-1.0), None, 0.0),
    "no http_route": (routes(http_route=RAISES), Injected, 0.0),
    "route's method unreadable": (routes(method=RAISES), Injected, 0.0),
    "route's model unreadable": (routes(model=RAISES), Injected, 0.0),
    "method_label raises": (on_metrics("method_label", raising), Injected, 0.0),
    "http_open no number": (on_metrics("http_open", "x"), TypeError, 0.0),
    "the book's count no number": (on_book("count", "x"), TypeError, 0.0),
    "the book's FIFO refuses": (on_book("open", RaisingDeque), Injected, 0.0),
    "the backend's write raises": (backend_write_raises, Injected, 0.0),
}


def feed(side: Side, chunk: bytes) -> type[BaseException] | None:
    try:
        side[0].data_received(chunk)
    except Exception as exc:  # the error is the outcome compared
        return type(exc)
    return None


# raised by both: the backend's write failing is forwarding's failure, not observation's
FORWARDING = {"the backend's write raises"}


def spied(side: Side) -> list[type[BaseException]]:
    """The errors that stop the side's observation (its protocol's `observation_failed`)."""
    proto, told = side[0], []
    stop = proto.observation_failed

    def observation_failed(exc: BaseException) -> None:
        told.append(type(exc))
        stop(exc)

    proto.observation_failed = observation_failed  # type: ignore[method-assign]
    return told


def native_told(monkeypatch: pytest.MonkeyPatch) -> list[tuple[BaseException, bool]]:
    """What C pumps made from now on tell `native_failed`: (error, booked)."""
    told: list[tuple[BaseException, bool]] = []
    native = _ClientProtocol.native_failed

    def native_failed(self: _ClientProtocol, exc: BaseException, booked: bool) -> None:
        told.append((exc, booked))
        native(self, exc, booked)

    monkeypatch.setattr(_ClientProtocol, "native_failed", native_failed)
    return told


def internal_failures(side: Side) -> float:
    """`xsp_observation_failures_total{reason="http_internal"}` (its counter alone: some
    faults leave the rest of the registry unscrapable)."""
    [family] = side[0].relay.metrics.observation_failures.collect()
    found = [x.value for x in family.samples
             if x.name.endswith("_total") and x.labels == {"reason": "http_internal"}]  # fmt: skip
    return found[0] if found else 0.0


def sides(fault: Any, rate: float) -> tuple[Side, Side, Hook]:
    hooks = [type("FaultHook", (Hook,), {})(5, rate) for _ in range(2)]
    made = client(True, hooks[0]), client(False, hooks[1])
    for side, hook in zip(made, hooks, strict=True):
        fault(side, hook)
    return made[0], made[1], hooks[0]


@pytest.mark.parametrize("name", list(BOTH))
def test_a_fault_stops_observation_as_it_stops_in_python(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk that meets the fault and every later one are forwarded as they are, the
    connection unobserved from then on and counted once, as in Python (the C pump steps back
    to Python's reader, or writes the rest itself where it had booked part of the chunk).
    What is no fault (`quick` absent or None: the hook's; a draw at the rate) the pump takes
    as Python does, and never tells as its own failure."""
    fault, error, rate = BOTH[name]
    native = native_told(monkeypatch)
    c_side, p_side, _ = sides(fault, rate)
    told = spied(c_side), spied(p_side)
    failed_at, sent = None, 0
    for at, chunk in enumerate(CHUNKS):
        outcomes = feed(c_side, chunk), feed(p_side, chunk)
        assert outcomes[0] == outcomes[1], chunk
        if outcomes[0] is not None:  # forwarding failed: raised, as Python raises it
            assert name in FORWARDING and outcomes[0] is error
            return
        assert bytes(c_side[2].out) == bytes(p_side[2].out)  # forwarded
        assert bytes(c_side[1].out) == bytes(p_side[1].out)  # our answers
        assert state(c_side[0]) == state(p_side[0])
        if failed_at is None and p_side[0].responses is None:
            failed_at, sent = at, len(p_side[2].out)
    assert name not in FORWARDING
    if error is None:
        assert failed_at is None and told == ([], []) and native == []
        return
    assert failed_at is not None
    # the C pump meets each of these first: it told the fault's own error, once
    assert [type(exc) for exc, _ in native] == [error], native
    assert bytes(p_side[2].out)[sent:] == b"".join(CHUNKS[failed_at + 1 :])  # as they are
    for side in (c_side, p_side):
        assert side[0].responses is None and internal_failures(side) == 1
        assert side[0].book.open == deque()  # every call ended: none left open
    assert told == ([error], [error])


def quick_objects(q: Any) -> list[Any]:
    """The hook's `quick` and what the pump reads of it (none where it is no QuickDecisions;
    `hot` and its force header unless a fault made them unreadable)."""
    if not isinstance(q, QuickDecisions):
        return []
    found = [q, q.started, q.unpicked, q.not_replayable, q.coin, q.per_call, q.replayable]
    with contextlib.suppress(Exception):
        found += [q.coin.hot, q.coin.hot.force_header]
    return found


def held_by(side: Side, hook: Hook) -> list[Any]:
    """What the pump reads and must not keep: the hook's answers and counts, the labels and
    models in the route cache, the reader, the book and its metrics."""
    proto = side[0]
    found = [proto.requests, proto.requests.routes, proto.book, proto.book.metrics, Call]
    found.append(proto.relay.route_cache)
    found += [x for value in proto.relay.route_cache.values() for x in value]
    q = vars(hook).get("quick")  # (a fault may have made the attribute raise)
    found += quick_objects(q)
    return found


def rounds_leave(
    side: Side, hook: Hook, chunks: list[bytes], n: int, misses: bool = False
) -> tuple[int, list[int]]:
    """Feed `chunks` n times (errors ignored; the book's calls and the hook's records dropped
    each round; `misses`: the route cache emptied before each): the allocated blocks and the
    reference counts of `held_by` after."""
    cache = side[0].relay.route_cache
    for _ in range(n):
        if misses:
            cache.clear()
        for chunk in chunks:
            feed(side, chunk)
        side[0].book.open.clear()
        side[2].out.clear()
        side[1].out.clear()
        hook.seen.clear()
    gc.collect()
    held = held_by(side, hook)
    counts = [sys.getrefcount(x) for x in held]
    del held
    return sys.getallocatedblocks(), counts


@contextlib.contextmanager
def quiet_relay_log() -> Iterator[None]:
    """The relay's log records of each failure (kept by pytest's capture) off."""
    loggers = [logging.getLogger(f"sidecar.proxy.http.{m}") for m in ("relay", "calls")]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger in loggers:
            logger.disabled = False


def failing_rounds(make: Any, chunks: list[bytes], n: int) -> int:
    """`chunks` fed n times, each round to a fresh side made by `make()` (a connection whose
    observation fails, then dropped): the allocated blocks after."""
    with quiet_relay_log():
        for _ in range(n):
            side = make()
            for chunk in chunks:
                feed(side, chunk)
            del side
        gc.collect()
    return sys.getallocatedblocks()


# the faults of BOTH made on the side (the rest are the hook's)
ON_THE_SIDE = {
    "no http_route", "route's method unreadable", "route's model unreadable",
    "method_label raises", "http_open no number", "the book's count no number",
    "the book's FIFO refuses", "the backend's write raises",
}  # fmt: skip


@pytest.mark.parametrize("name", [n for n in BOTH if BOTH[n][1] is not None])
def test_a_fault_leaks_nothing(name: str) -> None:
    """Connection after connection meeting the fault: no block or reference is left by it."""
    fault, _, rate = BOTH[name]
    hook = type("FaultHook", (Hook,), {})(5, rate)
    fault(client(True, hook), hook)  # the hook's faults, once: every side shares the hook

    def make() -> Side:
        hook.seen.clear()  # (what the last round's connection told it)
        side = client(True, hook)
        if name in ON_THE_SIDE:
            fault(side, hook)
        return side

    failing = next(chunk for chunk in CHUNKS if failed_by(make(), chunk))
    before = failing_rounds(make, [failing], 50)
    counts = [sys.getrefcount(x) for x in shared_by(hook)]
    after = failing_rounds(make, [failing], 500)
    assert after - before < 250  # (a leak here is 500s: one a round)
    assert [sys.getrefcount(x) for x in shared_by(hook)] == counts


def failed_by(side: Side, chunk: bytes) -> bool:
    """Whether `chunk` stops the side's observation (or raises)."""
    with quiet_relay_log():
        return feed(side, chunk) is not None or side[0].responses is None


def shared_by(hook: Hook) -> list[Any]:
    """What every round's side reads of the hook and must not keep (and the error's class,
    which each failure's error refers to)."""
    found: list[Any] = [Call, hook, Injected, TypeError]
    q = vars(hook).get("quick")
    found += quick_objects(q)
    return found


def test_a_failed_count_drops_its_sum() -> None:
    """`quick.started[0] += 1` whose write fails: the sum made is dropped (C and Python)."""
    for pump in (True, False):
        hook = Hook(5, 0.0)
        hook.quick.started = UnwritableCounts()
        side = client(pump, hook)
        assert Tally.live == 1
        with quiet_relay_log():
            assert feed(side, INFER) is None
        assert side[0].responses is None  # observation stopped
        gc.collect()
        assert Tally.live == 1
        del hook, side
        gc.collect()


class Stop(BaseException):
    """Not an Exception (as KeyboardInterrupt is not): raised through, never a fault."""


class StopsIn(frozenset):  # type: ignore[type-arg]
    def __contains__(self, item: object) -> bool:
        raise Stop


class StoppingCounts(list):  # type: ignore[type-arg]
    def __setitem__(self, key: Any, value: Any) -> None:
        raise Stop


@pytest.mark.parametrize("booked", [False, True])
@pytest.mark.parametrize("pump", [True, False])
def test_an_error_that_is_no_exception_is_raised_through(booked: bool, pump: bool) -> None:
    """Raised before the chunk is forwarded (`per_call`'s `in`) or after (`started`'s
    count, booked in C after the write): both paths let it through."""
    hook = Hook(5, 0.0)
    if booked:
        hook.quick.started = StoppingCounts([0])
    else:
        hook.quick.per_call = StopsIn({"ModelInfer"})
    side = client(pump, hook)
    with pytest.raises(Stop):
        side[0].data_received(INFER)
    assert side[0].responses is not None  # not taken for a fault of observation


# -- faults only the C path meets --------------------------------------------------------------


def routed(side: Side, reader: Any = None, cache: Any = None, call: Any = Call) -> None:
    """Route the side's pump again, to other objects than its protocol's."""
    proto = side[0]
    proto.pump.route(side[2], reader or proto.requests, cache or proto.relay.route_cache, call)
    proto.pump.armed = True


def reader_with(**faults: Any) -> Any:
    def apply(side: Side) -> None:
        routed(side, reader=Faulty(side[0].requests, faults))

    return apply


def book_with(**faults: Any) -> Any:
    def apply(side: Side) -> None:
        reader = side[0].requests
        reader.book = Faulty(reader.book, faults)

    return apply


class UnreadableBytes(Call):
    """A Call whose request_bytes cannot be read back."""

    __slots__ = ()

    @property  # type: ignore[override]
    def request_bytes(self) -> Any:
        raise Injected("no request_bytes")

    @request_bytes.setter
    def request_bytes(self, value: Any) -> None:
        pass


class UnwritableQuiet(Call):
    """A Call whose `quiet` cannot be set."""

    __slots__ = ()

    @property  # type: ignore[override]
    def quiet(self) -> Any:
        return None

    @quiet.setter
    def quiet(self, value: Any) -> None:
        raise Injected("no quiet")


def call_type(cls: type) -> Any:
    return lambda side: routed(side, call=cls)


class CollidesLater:
    """Hashed as `twin`; every `n`th comparison raises the injected fault (a route cache's
    lookup compares once, and the insert after it again)."""

    def __init__(self, twin: object, n: int) -> None:
        self.twin, self.n, self.left = twin, n, n

    def __hash__(self) -> int:
        return hash(self.twin)

    def __eq__(self, other: object) -> bool:
        self.left -= 1
        if self.left == 0:
            self.left = self.n
            raise Injected("no comparison")
        return False


def colliding_cache(nth: int) -> Any:
    def apply(side: Side) -> None:
        side[0].relay.route_cache[CollidesLater(b"POST /v2/models/m/infer", nth)] = ("x", "y")

    return apply


# fault -> (what it does to the C side, the rate, the chunks, whether the last chunk's fault
# comes after the pump forwarded or booked part of it)
C_ONLY: dict[str, tuple[Any, float, list[bytes], bool]] = {
    "the route cache's lookup raises": (colliding_cache(1), 0.0, [INFER], False),
    "the route cache's insert raises": (colliding_cache(2), 0.0, [INFER], False),
    "reader.call unreadable": (reader_with(call=RAISES), 0.0, [INFER], False),
    "reader.head unreadable": (reader_with(head=RAISES), 0.0, [INFER], False),
    "reader.refused unreadable": (reader_with(refused=RAISES), 0.0, [INFER], False),
    "reader.closing unreadable": (reader_with(closing=RAISES), 0.0, [INFER], False),
    "reader.book unreadable": (reader_with(book=RAISES), 0.0, [INFER], False),
    "reader.routes unreadable": (reader_with(routes=RAISES), 0.0, [INFER], False),
    "reader.call unwritable": (reader_with(call=READ_ONLY), 0.0, [INFER, HEADER], True),
    "reader.body_left unwritable": (reader_with(body_left=READ_ONLY), 0.0, [HEADER], True),
    "reader.adopt raises": (reader_with(adopt=RAISES), 0.0, [HEADER, BODY[:1]], True),
    "book.metrics unreadable": (book_with(metrics=RAISES), 0.0, [INFER], False),
    "book.observer unreadable": (book_with(observer=RAISES), 0.0, [INFER], False),
    "book.open unreadable": (book_with(open=RAISES), 0.0, [INFER], True),
    "book.drawn unwritable (picked)": (book_with(drawn=READ_ONLY), 1.0, [INFER], False),
    "a call's request_bytes unreadable": (call_type(UnreadableBytes), 0.0, [INFER], True),
    "a call's quiet unwritable": (call_type(UnwritableQuiet), 0.0, [INFER], True),
    # the rest of the chunk, handed on by the pump, is written as it is after the fault
    "book.open unreadable, a request after": (book_with(open=RAISES), 0.0, [INFER + CHUNKED], True),
}
AFTER = [INFER, LIVE]  # the connection goes on


@pytest.mark.parametrize("name", list(C_ONLY))
def test_a_fault_only_c_meets_leaves_the_connection_to_python(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pump tells `native_failed` of its own fault once and takes no chunk again; nothing
    is raised. Met before the pump forwarded or booked any of the chunk, Python's reader takes
    the chunk and the connection on as a relay without the pump does (the same bytes, the same
    calls); met after, the rest of the chunk goes out as it is and observation stops."""
    fault, rate, chunks, booked = C_ONLY[name]
    told = native_told(monkeypatch)
    side, reference = client(True, Hook(5, rate)), client(False, Hook(5, rate))
    fault(side)
    asked: list[bytes] = []
    routes = side[0].requests.routes
    side[0].requests.routes = SimpleNamespace(
        http_route=lambda verb, target: asked.append(target) or routes.http_route(verb, target)
    )
    *before, last = chunks
    for chunk in before:
        assert feed(side, chunk) is None and feed(reference, chunk) is None
    proto = side[0]
    cached = dict(proto.relay.route_cache)
    with quiet_relay_log():
        for chunk in [last, *AFTER]:
            assert feed(side, chunk) is None and feed(reference, chunk) is None
    assert [(type(exc), was) for exc, was in told] == [(Injected, booked)]
    # raised in Python code: told with where it was raised, for the log
    assert told[0][0].__traceback__ is not None
    proto.arm()
    assert proto.pump.armed is False  # (never again)
    if booked:
        assert proto.responses is None and internal_failures(side) == 1
        assert bytes(side[2].out) == b"".join([*chunks, *AFTER])
    else:
        assert proto.responses is not None and internal_failures(side) == 0
        assert bytes(side[2].out) == bytes(reference[2].out)
        assert bytes(side[1].out) == bytes(reference[1].out)
        assert state(proto) == state(reference[0])
    if "cache" in name:
        assert proto.relay.route_cache == cached
    if name == "the route cache's lookup raises":  # no route asked after the failed lookup:
        assert asked == [b"/v2/models/m/infer", b"/v2/models/m/infer", b"/v2/health/live"]


@pytest.mark.parametrize("name", ["reader.call unreadable", "book.open unreadable"])
def test_a_pump_that_told_a_fault_takes_no_chunk_again(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unbooked or booked, the pump disarms itself and stays so, whatever `failed` does (here:
    nothing) and whoever arms it after."""
    monkeypatch.setattr(_ClientProtocol, "native_failed", lambda self, exc, booked: None)
    fault, rate, chunks, _ = C_ONLY[name]
    side = client(True, Hook(5, rate))
    fault(side)
    with quiet_relay_log():
        for chunk in chunks:
            assert feed(side, chunk) is None
    pump = side[0].pump
    assert pump.armed is False
    pump.armed = True
    assert pump.armed is False
    taken = pump.chunks
    assert feed(side, INFER) is None
    assert pump.chunks == taken  # (Python's reader took it)
    assert side[0].responses is not None  # `failed` did nothing: still observed in Python


@pytest.mark.parametrize("name", ["reader.call unreadable", "book.open unreadable"])
def test_an_error_of_the_failed_callback_is_raised(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def native_failed(self: _ClientProtocol, exc: BaseException, booked: bool) -> None:
        raise Injected("no telling")

    monkeypatch.setattr(_ClientProtocol, "native_failed", native_failed)
    fault, rate, chunks, _ = C_ONLY[name]
    side = client(True, Hook(5, rate))
    fault(side)
    *before, last = chunks
    for chunk in before:
        assert feed(side, chunk) is None
    sent = bytes(side[2].out)
    with pytest.raises(Injected, match="no telling"):
        side[0].data_received(last)
    assert bytes(side[2].out) == sent + (last if name == "book.open unreadable" else b"")


class WritesThenFails(Transport):
    """A backend whose first `ok` writes go out and every later one raises `error()`."""

    def __init__(self, ok: int, error: type[Exception]) -> None:
        super().__init__()
        self.ok, self.failure = ok, error

    def write(self, data: Any) -> Any:
        if self.ok == 0:
            raise self.failure("closed" if self.failure is RuntimeError else "no write")
        self.ok -= 1
        super().write(data)
        return Tally()  # (uvloop's write answers None: an answer not dropped shows live)


def rest_side(rest_write: str, taken: int) -> tuple[Side, WritesThenFails, bytes]:
    """A side whose book cannot be booked in (`open` unreadable), its pump routed to a backend
    that takes the taken requests, then the rest as `rest_write` says; and the chunk."""
    side = client(True, Hook(5, 0.0))
    back = WritesThenFails(
        10 if rest_write == "goes out" else 1,
        Injected if rest_write == "raises" else RuntimeError,
    )
    side[0].pump.route(back, side[0].requests, side[0].relay.route_cache, Call)
    side[0].pump.armed = True
    side[0].requests.book = Faulty(side[0].requests.book, {"open": RAISES})
    return side, back, INFER * taken + CHUNKED


REST_WRITES = ["goes out", "backend closed", "raises"]


@pytest.mark.parametrize("rest_write", REST_WRITES)
@pytest.mark.parametrize("taken", [1, 3])
def test_a_booking_fault_writes_the_rest_of_its_chunk(
    rest_write: str, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken requests forwarded, then booking them fails, with a request the pump hands on
    after them in the same chunk: that rest is written as it is and observation stops (told
    once, booked). A backend closed at that write (uvloop's RuntimeError) closes the client's
    connection as a lost backend does; any other error of the write is raised, untold."""
    told = native_told(monkeypatch)
    side, back, chunk = rest_side(rest_write, taken)
    live = Tally.live
    with quiet_relay_log():
        if rest_write == "raises":
            with pytest.raises(Injected, match="no write"):
                side[0].data_received(chunk)
            assert told == [] and bytes(back.out) == INFER * taken
            return
        assert feed(side, chunk) is None
    assert [(type(exc), booked) for exc, booked in told] == [(Injected, True)]
    assert side[0].pump.armed is False and side[0].responses is None
    assert internal_failures(side) == 1
    assert Tally.live == live  # each write's answer dropped
    if rest_write == "goes out":
        assert bytes(back.out) == chunk and side[1].closing is False
        assert feed(side, LIVE) is None  # unobserved, forwarded (by the protocol, to its
        assert bytes(side[2].out) == LIVE  # own backend: the pump was routed to `back`)
    else:
        assert bytes(back.out) == INFER * taken  # the rest met the closed backend
        assert side[1].closing is True  # the client's connection closed with it


def test_a_booking_fault_with_no_rest_writes_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole chunk taken, then booking fails: no empty write follows (here one would meet
    the closed backend and close the client's connection)."""
    told = native_told(monkeypatch)
    side, back, _ = rest_side("backend closed", 1)
    with quiet_relay_log():
        assert feed(side, INFER) is None
    assert [(type(exc), booked) for exc, booked in told] == [(Injected, True)]
    assert bytes(back.out) == INFER and back.ok == 0
    assert side[1].closing is False and side[0].responses is None


@pytest.mark.parametrize("rest_write", REST_WRITES)
def test_writing_the_rest_leaks_nothing(rest_write: str) -> None:
    """Connection after connection whose chunk's rest is written after a booking fault (or
    meets a closed or failing backend there): no block or reference is left by it."""

    def rounds(n: int) -> int:
        with quiet_relay_log():
            for _ in range(n):
                side, _, chunk = rest_side(rest_write, 1)
                with contextlib.suppress(Injected):
                    side[0].data_received(chunk)
                del side
            gc.collect()
        return sys.getallocatedblocks()

    before = rounds(50)
    counts = [sys.getrefcount(x) for x in (Injected, RuntimeError, Call)]
    after = rounds(500)
    assert after - before < 250  # (a leak here is 500s: one a round)
    assert [sys.getrefcount(x) for x in (Injected, RuntimeError, Call)] == counts


ANSWER = object()  # what `failed` answers in the rounds below: not to be kept


@pytest.mark.parametrize("name", list(C_ONLY))
def test_a_fault_only_c_meets_leaks_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connection after connection meeting the fault: no block or reference is left by it."""
    native = _ClientProtocol.native_failed

    def native_failed(self: _ClientProtocol, exc: BaseException, booked: bool) -> object:
        native(self, exc, booked)
        return ANSWER

    monkeypatch.setattr(_ClientProtocol, "native_failed", native_failed)
    fault, rate, chunks, _ = C_ONLY[name]
    hook = Hook(5, rate)

    def make() -> Side:
        hook.seen.clear()
        side = client(True, hook)
        fault(side)
        return side

    before = failing_rounds(make, chunks, 50)
    counts = [sys.getrefcount(x) for x in [*shared_by(hook), ANSWER]]
    after = failing_rounds(make, chunks, 500)
    assert after - before < 250  # (as above)
    assert [sys.getrefcount(x) for x in [*shared_by(hook), ANSWER]] == counts


# -- the route cache ---------------------------------------------------------------------------

KEY = b"POST /v2/models/m/infer"


@pytest.mark.parametrize(
    ("entry", "booked"),
    [
        (("Other", "o"), ("Other", "o")),  # a 2-tuple is the route, as cached
        (["Other", "o"], ("ModelInfer", "m")),  # anything else: the route is asked again
        (("Other", "o", "x"), ("ModelInfer", "m")),
        (("Other",), ("ModelInfer", "m")),
    ],
)
def test_a_cached_route_is_a_pair(entry: Any, booked: tuple[str, str]) -> None:
    side = client(True, None)
    cache = side[0].relay.route_cache
    cache[KEY] = entry
    side[0].data_received(INFER + INFER)
    assert [(c.method, c.model) for c in side[0].book.open] == [booked, booked]
    assert cache[KEY] == (entry if booked == ("Other", "o") else booked)


def test_the_route_cache_stops_growing_at_its_bound() -> None:
    side = client(True, None)
    cache = side[0].relay.route_cache
    cache.update({b"GET /%d" % i: ("_unknown", None) for i in range(4095)})
    side[0].data_received(INFER + LIVE)
    assert len(cache) == 4096 and cache[KEY] == ("ModelInfer", "m")
    assert [c.method for c in side[0].book.open] == ["ModelInfer", "ServerLive"]


# -- limits ------------------------------------------------------------------------------------


def head_with_length(digits: str) -> bytes:
    return b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: %s\r\n\r\n" % digits.encode()


@pytest.mark.parametrize(
    ("digits", "owned"),
    [("9" * 15, True), ("1" + "0" * 16, True), ("1" + "0" * 16 + "1", False), ("9" * 30, False)],
)
def test_a_content_length_is_read_as_llhttp_reads_it(digits: str, owned: bool) -> None:
    """Any Content-Length within the body limit (10**17 here) is the owned call's body to come;
    past it, or past what llhttp reads (2**64), the reader takes the request and refuses it."""
    side = client(True, None)
    side[0].requests.limits = HttpLimits(header_bytes=400, body_bytes=10**17)
    routed(side)
    side[0].data_received(head_with_length(digits))
    assert side[0].pump.owns is owned
    if owned:
        assert side[0].requests.body_left == int(digits)
    else:
        assert side[0].requests.refused is not None


@pytest.mark.parametrize(
    "field",
    [
        b"Content-Lengtx: 2",  # as long as content-length
        b"Transfer-Encodinx: chunked",  # as long as transfer-encoding
        b"Xontent-Length: 2",
        b"Content-Length : 2",
        b"Content-Length: 2 ",
        b"Content-Length: 2\t",
        b"X-Forcf: 1",  # as long as the force header
        b"X-Force: 1",
        b"x-forc: 1",
    ],
)
def test_fields_like_the_ones_read_are_told_apart(field: bytes) -> None:
    head = b"POST /v2/models/m/infer HTTP/1.1\r\n" + field + b"\r\n"
    for body in (b"", b"{}"):
        for tail in (b"\r\n" + body, b"Content-Length: %d\r\n\r\n" % len(body) + body):
            data = (head + tail) * 2
            run_both(data, [], hook_seed=None)
            run_both(data, [len(head + tail)], hook_seed=3, rate=0.0)


@pytest.mark.parametrize(
    ("field", "taken"),
    [
        (b"Transfer-Encodinx: chunked", True),  # as long as transfer-encoding
        (b"Transfer-Encoding2: chunked", True),
        (b"X-Forcf: 1", True),  # as long as the force header
        (b"X-Forc: 1", True),
        (b"Y-Force: 1", True),
        (b"Xontent-Length: 9", True),  # before the request's own Content-Length: 2
        (b"Content-Lengtx: 9", True),
        (b"Content-Length2: 9", True),
        (b"X-Force: 1", False),  # the hook reads the force header's value
        (b"x-FORCE:1", False),
        (b"AZ-az: 1", False),  # a force header of every letter case's edges (see below)
        (b"az-AZ: 1", False),
        (b"BZ-az: 1", True),
        (b"AY-az: 1", True),
    ],
)
def test_only_the_fields_read_send_a_request_to_python(
    monkeypatch: pytest.MonkeyPatch, field: bytes, taken: bool
) -> None:
    handed = fallback_spy(monkeypatch)
    hook = Hook(3, 0.0)
    if field.lower().startswith((b"az", b"bz", b"ay")):
        hook.quick.coin.hot.force_header = b"az-az"
    side = client(True, hook)
    request = INFER.replace(b"Host: h", field)
    side[0].data_received(request)
    assert handed == ([] if taken else [request])


GET = b"GET /v2/health/live HTTP/1.1\r\n"


@pytest.mark.parametrize(
    ("request_", "taken"),
    [
        (INFER, True),
        (LIVE, True),  # no Content-Length: no body
        (GET + b"Content-Length: 0\r\n\r\n", True),
        (GET + b"Content-Length: \t 0 \t\r\n\r\n", True),
        (INFER.replace(b"Length: 2", b"Length: 02"), True),
        (INFER.replace(b"Length: 2", b"Length:2"), True),
        (INFER.replace(b"Length: 2\r\n\r\n{}", b"Length: 19\r\n\r\n" + b"9" * 19), True),
        (INFER.replace(b"Length: 2\r\n\r\n{}", b"Length: 8\r\n\r\n" + b"8" * 8), True),
        (GET + b"Content-Length: +0\r\n\r\n", False),  # not plain: the reader's
        (GET + b"Content-Length: 0x\r\n\r\n", False),
        (GET + b"Content-Length: \r\n\r\n", False),
        (GET + b"Content-Length: 0 0\r\n\r\n", False),
        (GET + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", False),
        (GET + b"Transfer-Encoding: chunked\r\n\r\n", False),  # its chunks to follow
        (HEADER + BODY[:1], False),  # a part of a body
        (GET + b"Content-Length:\t2\r\n\r\n{}", True),
        (GET + b"Transfer-Encoding: identity\r\nContent-Length: 0\r\n\r\n", False),
        (GET + b"Content-Length: 0\r\nContent-Length: 0\r\n\r\n", False),
        (GET + b"Connection: close\r\n\r\n", False),
        (b"GET /v2/health/live HTTP/1.0\r\n\r\n", False),  # not kept alive
        (b"\r\n" + LIVE, False),  # an empty line first
        (b"GET /v2/health/live\r\n\r\n", False),  # no version
    ],
)
def test_which_requests_the_pump_takes(
    monkeypatch: pytest.MonkeyPatch, request_: bytes, taken: bool
) -> None:
    handed = fallback_spy(monkeypatch)
    side = client(True, None)
    side[0].data_received(request_)
    assert handed == ([] if taken else [request_])
    if taken:
        assert bytes(side[2].out) == request_


def test_an_upgrade_request_is_left_to_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """llhttp stops at an upgrade request's block: the pump hands it on, even without a body
    (the reader relays or refuses it, and nothing after it is a request)."""
    upgrade = b"GET /v2/health/live HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: ws\r\n\r\n"
    handed = fallback_spy(monkeypatch)
    side = client(True, None)
    side[0].data_received(INFER)
    side[0].data_received(upgrade)
    assert handed == [upgrade]
    run_both(INFER + upgrade + INFER, [], hook_seed=None)
    run_both(upgrade + INFER, [len(upgrade)], hook_seed=None)


def fallback_spy(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """What reaches Python's `data_received` of client protocols made from here on."""
    handed: list[bytes] = []
    python = _ClientProtocol.data_received

    def spied(self: _ClientProtocol, data: bytes) -> None:
        handed.append(data)
        python(self, data)

    monkeypatch.setattr(_ClientProtocol, "data_received", spied)
    return handed


# -- what the pump holds -----------------------------------------------------------------------


def test_a_closed_backend_disarms_the_pump() -> None:
    side = client(True, None)
    side[2].broken = True
    side[0].data_received(INFER)
    assert side[1].closing and not side[0].pump.armed


def test_a_taken_body_leaves_nothing_held() -> None:
    """Once an owned call's body is taken, the pump holds neither the call nor its block."""
    side = client(True, None)
    pump = side[0].pump
    side[0].data_received(HEADER)
    assert any(isinstance(x, bytes) for x in gc.get_referents(pump))
    side[0].data_received(BODY)
    held = gc.get_referents(pump)
    assert not any(isinstance(x, bytes | Call) for x in held)


def test_a_pump_dropped_unreleased_drops_what_it_held() -> None:
    assert Pump is not None
    held = (lambda data: None), (lambda: None), (lambda exc, booked: None)
    counts = [sys.getrefcount(x) for x in held]
    pump = Pump(*held)
    assert all(a > b for a, b in zip([sys.getrefcount(x) for x in held], counts, strict=True))
    del pump
    assert [sys.getrefcount(x) for x in held] == counts


def test_every_path_releases_what_it_reads() -> None:
    """A thousand rounds through each path a request may take in C (route cache missed or hit,
    each quick answer, a body owned and taken or handed to the reader in pieces, the rest of a
    chunk handed on, a chunk while the reader has a call part-way): the allocated blocks and
    the references to what the pump reads stay flat."""
    chunked = b"POST /v2/models/m/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    stream = [
        INFER, LIVE, READY, HEADER, BODY, HEADER, BODY[:1], BODY[1:], INFER + LIVE,
        INFER + chunked, b"2\r\n{}\r\n", b"0\r\n\r\n",
    ]  # fmt: skip
    for rate in (0.0, 1.0):
        hook = Hook(1, rate)
        side = client(True, hook)
        for misses in (False, True):
            before = rounds_leave(side, hook, stream, 200, misses)
            after = rounds_leave(side, hook, stream, 1000, misses)
            assert after[0] - before[0] < 200  # (a leak here is 1000s: one a round)
            assert after[1] == before[1]


def test_the_small_numbers_the_pump_sets_are_released() -> None:
    """The ints and floats every call is booked with (0, 1, 0.0: shared objects, so a lost
    reference shows only in their counts)."""
    hook = Hook(1, 0.0)
    side = client(True, hook)
    stream = [INFER, LIVE, HEADER, BODY]
    rounds_leave(side, hook, stream, 100)
    counts = sys.getrefcount(0), sys.getrefcount(1), sys.getrefcount(False)
    rounds_leave(side, hook, stream, 500)
    assert (sys.getrefcount(0), sys.getrefcount(1), sys.getrefcount(False)) == counts


def test_a_pump_leaves_the_collector_before_it_drops_its_references() -> None:
    """Code its references run when freed (a `__del__`) may run the cycle collector: the pump
    being freed must not be among the objects it tracks (it would free it a second time)."""
    assert Pump is not None
    assert tracked_while_freed(lambda watcher: Pump(watcher, watcher, watcher)) == [False]


def test_a_freed_pump_returns_its_memory() -> None:
    """2,000 pumps made and dropped keep no memory (each holds an llhttp parser: ~300 B)."""
    assert Pump is not None
    grown = memory_kept_by(lambda: Pump(print, print, print))
    assert grown < 16 * 1024, grown


def test_calls_are_timed_on_perf_counters_clock() -> None:
    """A call booked in C starts and ends its request on `time.perf_counter`'s clock (the
    Python path's): between readings of it taken before and after."""
    side = client(True, None)
    for _ in range(20):
        side[0].book.open.clear()
        before = time.perf_counter()
        side[0].data_received(INFER)
        after = time.perf_counter()
        [call] = side[0].book.open
        assert before <= call.start <= call.request_end <= after


# -- the pump's own API --------------------------------------------------------------------------


def test_the_pump_is_called_with_one_positional_chunk() -> None:
    side = client(True, None)
    pump = side[0].pump
    with pytest.raises(TypeError):
        pump(INFER, INFER)
    with pytest.raises(TypeError):
        pump()
    with pytest.raises(TypeError):
        pump(INFER, data=INFER)
    with pytest.raises(TypeError):
        pump(data=INFER)
    assert bytes(side[2].out) == b""


def test_a_chunk_that_is_not_bytes_goes_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    handed = fallback_spy(monkeypatch)
    side = client(True, None)
    side[0].data_received(bytearray(INFER))  # (uvloop hands bytes)
    assert handed == [INFER]
    assert bytes(side[2].out) == INFER


@pytest.mark.parametrize(
    "args",
    [(1, print, print), (print, 2, print), (print, print, 3), (print, print)],
)
def test_a_pump_is_made_of_three_callables(args: tuple[Any, ...]) -> None:
    assert Pump is not None
    with pytest.raises(TypeError):
        Pump(*args)


def test_route_checks_its_arguments_and_reads_limits() -> None:
    side = client(True, None)
    pump, reader = side[0].pump, side[0].requests
    ok = (side[2], reader, {}, Call)
    for bad in [ok[:3], (*ok, 1), (ok[0], reader, [], Call), (ok[0], reader, {}, 1)]:
        with pytest.raises(TypeError):
            pump.route(*bad)
    with pytest.raises(AttributeError):
        pump.route(object(), reader, {}, Call)  # no write
    with pytest.raises(AttributeError):
        pump.route(side[2], object(), {}, Call)  # no limits
    for limits in [
        Faulty(reader.limits, {"body_bytes": "x"}),
        Faulty(reader.limits, {"header_bytes": None}),
    ]:
        with pytest.raises(TypeError):
            pump.route(side[2], Faulty(reader, {"limits": limits}), {}, Call)
    with pytest.raises(Injected):
        pump.route(
            side[2],
            Faulty(reader, {"limits": Faulty(reader.limits, {"body_bytes": RAISES})}),
            {},
            Call,
        )
    # none of the failed routes changed the pump: it still relays to the side's backend
    side[0].data_received(INFER)
    assert bytes(side[2].out) == INFER


def sized(block_bytes: int, body_bytes: int) -> bytes:
    """A request whose header block (request line to blank line) and body have these sizes."""
    line = b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: %d\r\nX: " % body_bytes
    return line + b"x" * (block_bytes - len(line) - 4) + b"\r\n\r\n" + b"b" * body_bytes


@pytest.mark.parametrize(
    ("block_bytes", "body_bytes", "taken"),
    [(400, 300, True), (401, 300, False), (400, 301, False), (100, 0, True)],
)
def test_requests_up_to_the_readers_limits_are_taken(
    monkeypatch: pytest.MonkeyPatch, block_bytes: int, body_bytes: int, taken: bool
) -> None:
    """The limits `route()` read (the reader's: 400 and 300 bytes here): a request at both is
    taken in C; a byte more of either goes to the reader, which refuses it."""
    handed = fallback_spy(monkeypatch)
    side = client(True, None)
    request = sized(block_bytes, body_bytes)
    side[0].data_received(request)
    assert handed == ([] if taken else [request])
    assert side[0].requests.refused is None if taken else side[0].requests.refused is not None


def test_thirty_two_requests_of_a_chunk_are_taken_and_the_rest_handed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed = fallback_spy(monkeypatch)
    side = client(True, None)
    side[0].data_received(LIVE * 40)
    assert handed == [LIVE * 8]
    assert bytes(side[2].out) == LIVE * 40 and side[0].book.count == 40


def test_the_armed_flag() -> None:
    side = client(True, None)
    pump = side[0].pump
    side[0].data_received(HEADER)
    assert pump.armed and pump.owns
    del pump.armed  # as False: the owned call's block handed to the reader
    assert not pump.armed and not pump.owns
    pump.armed = 1
    assert pump.armed is True
    with pytest.raises(Injected):
        pump.armed = NoBool()
    assert pump.armed is True


def test_a_draw_at_the_rate_is_unpicked_in_the_pump(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draw equal to the rate is not a pick (`rand() < pick_rate`): the pump answers the
    request itself, quietly, and hands Python nothing; one under it goes to the hook."""
    handed = fallback_spy(monkeypatch)
    for draw, taken in ((0.25, True), (0.2499, False)):
        handed.clear()
        hook = Hook(5, 0.25)
        hook.quick.coin.rand = lambda draw=draw: draw
        side = client(True, hook)
        side[0].data_received(INFER)
        assert handed == ([] if taken else [INFER]), draw
