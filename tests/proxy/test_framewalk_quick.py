"""The relay's own decisions in C (`QuickDecisions`), read as carefully as network bytes.

Where the request direction's HPACK cache holds a new request's block, the C walk reads the
hook's `quick` (its sets of methods, its coin, its force header, its `QuietEnd`s) and answers
an unpicked request itself (`quick_answer`, `cached_request_start` in `_framewalk.c`). Those
objects are the hook's, and may be anything: an attribute that raises, a set that is a list,
a coin that answers a string, a cached header list of another shape. Each must give one of
three outcomes, as its case says: decided in C, handed to the hook (as without the C walk), or
observation stopped with every byte still forwarded; never a crash. And whatever the walk
reads, over many calls decided and ended in C, it releases: no reference count grows.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections import UserDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.proxy import frames, streams
from sidecar.proxy.frames import ScanError
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import (
    ConnectionTracker,
    QuickDecisions,
    QuietEnd,
    RequestStart,
    StreamEnd,
)
from tests.proxy.faults import (
    RAISES,
    READ_ONLY,
    Collides,
    Faulty,
    Injected,
    NoBool,
    NoFloat,
    PropertyFault,
    RaisingCounts,
    raising_rand,
)
from tests.proxy.proxy_h2build import Conversation
from tests.proxy.test_framewalk_streams import unary_connection

pytestmark = pytest.mark.skipif(
    frames.native_walk is None or streams._NativeStream is None,
    reason="the C frame walker is not built here",
)


def failure_reasons(tracker: ConnectionTracker) -> set[str]:
    """The reasons observation stopped for, as counted on /metrics."""
    return {
        sample.labels["reason"]
        for family in tracker.metrics.observation_failures.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value
    }


def never_picks() -> float:
    return 0.5


class Hook:
    """Answers every request `quick.unpicked` (1 added to `quick.started[0]` first), as a
    sampling hook with a coin that does not pick would; counts the requests it is asked."""

    def __init__(self, per_call: frozenset[str], replayable: frozenset[str]) -> None:
        self.ended = [0, 0]
        self.per_model: dict[str, int] = {}
        self.hot = SimpleNamespace(pick_rate=float("0.25"), force_header=b"x-force")
        self.coin = SimpleNamespace(hot=self.hot, rand=never_picks)
        self.unpicked = QuietEnd(self.ended, 1, self.per_model)
        self.not_replayable = QuietEnd(self.ended, 0)
        self.started = [0]
        self.quick = QuickDecisions(
            self.coin, per_call, replayable, self.started, self.unpicked, self.not_replayable
        )  # fmt: skip
        self.asked = 0

    def on_request_headers(self, start: RequestStart) -> QuietEnd:
        self.asked += 1
        self.quick.started[0] += 1
        return self.quick.unpicked if start.method in self.quick.replayable else (
            self.quick.not_replayable
        )  # fmt: skip

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        raise AssertionError("an unpicked request's body is never given")

    def on_stream_end(self, end: StreamEnd) -> None:
        raise AssertionError("a quiet request's end is never given")


def connected(hook: Hook, count: int = 3) -> tuple[ConnectionTracker, list[tuple[bytes, bytes]]]:
    """A tracker with `hook` on a fresh connection, its prefaces passed, and `count` unary
    calls to send (`unary_connection`)."""
    start, server_start, calls, _ = unary_connection(count)
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
    tracker.request_scanner.process(start)
    tracker.response_scanner.observe(server_start)
    return tracker, calls


COIN = (frozenset({"ModelInfer"}), frozenset({"ModelInfer"}))  # decided by a coin flip
NEVER: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())  # a method never replayed


def on_tracker(change: Callable[[ConnectionTracker], Any]) -> Callable[[Hook, Any], None]:
    return lambda hook, tracker: change(tracker)


class Labels(list):  # type: ignore[type-arg]
    """A label set that is not a set (a list that `add`s)."""

    def add(self, name: str) -> None:
        self.append(name)


def info_as(faults: dict[str, Any]) -> Callable[[Hook, Any], None]:
    """The cached requests' MethodInfo made `Faulty`."""
    return entries_as(lambda e: (e[0], (*e[1][:2], Faulty(e[1][2], faults))))


def broken(where: str, faults: dict[str, Any]) -> Callable[[Hook, Any], None]:
    """A change to the hook's `quick` graph: the object at `where` made `Faulty`."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        if where == "quick":
            tracker.quick = Faulty(hook.quick, faults)  # type: ignore[assignment]
        elif where == "coin":
            hook.quick.coin = Faulty(hook.coin, faults)
        else:
            hook.coin.hot = Faulty(hook.hot, faults)

    return apply


def headers_as(shape: Callable[[list[Any]], Any]) -> Callable[[Hook, Any], None]:
    """A change to the request direction's cached header lists (only C reads them there)."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        cache = tracker.request.decoder.cache
        for block, (headers, summary) in list(cache.items()):
            cache[block] = (shape(headers), summary)

    return apply


def entries_as(
    shape: Callable[[tuple[Any, Any]], Any], direction: str = "request"
) -> Callable[[Any, Any], None]:
    """A direction's cached entries reshaped (the request's: (headers, (path, timeout,
    MethodInfo)); the response's: (headers, (grpc-status, grpc-message, :status))): the walk
    takes only the exact shape, the sink's Python unpacks any sequence of the right lengths."""

    def apply(hook: Any, tracker: ConnectionTracker) -> None:
        cache = getattr(tracker, direction).decoder.cache
        for block, entry in list(cache.items()):
            cache[block] = shape(entry)

    return apply


def force(name: Any) -> Callable[[Hook, Any], None]:
    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        hook.hot.force_header = name

    return apply


def rate(value: float) -> Callable[[Hook, Any], None]:
    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        hook.hot.pick_rate = value

    return apply


def first_name(hook: Hook, tracker: ConnectionTracker) -> None:
    """The force header is the block's first field (":method")."""
    headers, _ = next(iter(tracker.request.decoder.cache.values()))
    hook.hot.force_header = headers[0][0]


class NoReset(QuickDecisions):
    """A QuickDecisions whose coin, once picked, cannot be freed (`coin_picked = False`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "coin_picked" and value is False and getattr(self, "coin_picked", False):
            raise Injected("the coin stays picked")
        super().__setattr__(name, value)


def picked_and_never_reset(hook: Hook, tracker: ConnectionTracker) -> None:
    rate(0.75)(hook, tracker)
    q = hook.quick
    tracker.quick = NoReset(
        q.coin, q.per_call, q.replayable, q.started, q.unpicked, q.not_replayable
    )  # fmt: skip


def picked_but_unwritable(hook: Hook, tracker: ConnectionTracker) -> None:
    rate(0.75)(hook, tracker)
    broken("quick", {"coin_picked": READ_ONLY})(hook, tracker)


def names_as_str(headers: list[Any]) -> list[Any]:
    return [(name.decode(), value) for name, value in headers]


def armed(change: Callable[[Hook, Any], None]) -> Callable[[Hook, Any], None]:
    """`change`, then the `Collides` keys it put in place armed."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        change(hook, tracker)
        Collides.armed = True

    return apply


def colliding_method(hook: Hook, tracker: ConnectionTracker) -> None:
    """The metrics' method label set with a key that ModelInfer's lookup meets first."""
    methods = tracker.metrics.methods
    Collides.armed = False
    methods.discard("ModelInfer")
    methods.add(Collides("ModelInfer"))  # type: ignore[arg-type]
    methods.add("ModelInfer")
    Collides.armed = True


# case -> (methods, the change before the third call, outcome: "C", "hook" or "fails")
CASES: dict[str, tuple[tuple[frozenset[str], frozenset[str]], Any, str]] = {
    "unpicked": (COIN, lambda hook, tracker: None, "C"),
    "never replayed": (NEVER, lambda hook, tracker: None, "C"),
    "replayable, not per call": (
        (frozenset(), frozenset({"ModelInfer"})),
        lambda hook, tracker: None,
        "hook",
    ),
    "picked": (COIN, rate(0.75), "hook"),
    "picked at a rate equal to the draw": (COIN, rate(0.5), "C"),
    "no force header": (COIN, force(None), "C"),
    "a force header of a present name": (COIN, force(b"te"), "hook"),
    "a force header first in the block": (COIN, first_name, "hook"),
    "a force header as long as a present name": (COIN, force(b":metho_"), "C"),
    "a force header not bytes": (COIN, force("te"), "hook"),
    "per_call unreadable": (COIN, broken("quick", {"per_call": RAISES}), "fails"),
    "per_call a list": (COIN, broken("quick", {"per_call": ["ModelInfer"]}), "hook"),
    "per_call's lookup raises": (
        COIN,
        armed(broken("quick", {"per_call": frozenset({Collides("ModelInfer")})})),
        "fails",
    ),
    "replayable's lookup raises": (
        NEVER,
        armed(broken("quick", {"replayable": frozenset({Collides("ModelInfer")})})),
        "fails",
    ),
    "the method label's lookup raises": (COIN, colliding_method, "fails"),
    "replayable unreadable": (NEVER, broken("quick", {"replayable": RAISES}), "fails"),
    "replayable a list": (NEVER, broken("quick", {"replayable": []}), "hook"),
    "not_replayable unreadable": (NEVER, broken("quick", {"not_replayable": RAISES}), "fails"),
    "started unreadable (never replayed)": (NEVER, broken("quick", {"started": RAISES}), "fails"),
    "coin unreadable": (COIN, broken("quick", {"coin": RAISES}), "fails"),
    "hot unreadable": (COIN, broken("coin", {"hot": RAISES}), "fails"),
    "force_header unreadable": (COIN, broken("hot", {"force_header": RAISES}), "fails"),
    "pick_rate unreadable": (COIN, broken("hot", {"pick_rate": RAISES}), "fails"),
    "pick_rate not a number": (COIN, broken("hot", {"pick_rate": "0.5"}), "fails"),
    "pick_rate's float raises": (COIN, broken("hot", {"pick_rate": NoFloat()}), "fails"),
    "a pick_rate of -1": (COIN, rate(-1.0), "C"),
    "rand's float raises": (COIN, broken("coin", {"rand": NoFloat}), "fails"),
    "rand unreadable": (COIN, broken("coin", {"rand": RAISES}), "fails"),
    "rand raises": (COIN, broken("coin", {"rand": raising_rand}), "fails"),
    "rand answers no number": (COIN, broken("coin", {"rand": lambda: "0.1"}), "fails"),
    "coin_picked not writable": (COIN, picked_but_unwritable, "fails"),
    "coin_picked not writable back": (
        COIN,
        picked_and_never_reset,
        "fails",
    ),  # after the hook's turn
    "unpicked unreadable": (COIN, broken("quick", {"unpicked": RAISES}), "fails"),
    "started unreadable": (COIN, broken("quick", {"started": RAISES}), "fails"),
    "started's count raises": (COIN, broken("quick", {"started": RaisingCounts([0])}), "fails"),
    "headers a tuple": (COIN, headers_as(tuple), "hook"),
    "draining (refuse_above set)": (
        COIN,
        on_tracker(lambda t: setattr(t, "refuse_above", 1)),
        "ignored",
    ),
    "a stream id already seen": (
        COIN,
        on_tracker(lambda t: setattr(t, "last_stream_id", 5)),
        "ignored",
    ),
    "last_stream_id -1": (COIN, on_tracker(lambda t: setattr(t, "last_stream_id", -1)), "C"),
    "last_stream_id not an int": (
        COIN,
        on_tracker(lambda t: setattr(t, "last_stream_id", 3.0)),
        "hook",
    ),
    "last_stream_id past 64 bits": (
        COIN,
        on_tracker(lambda t: setattr(t, "last_stream_id", 2**64)),
        "fails",
    ),
    "observer unreadable": (COIN, on_tracker(PropertyFault("observer", once=True)), "fails"),
    "refuse_above unreadable": (
        COIN,
        on_tracker(PropertyFault("refuse_above", once=True)),
        "fails",
    ),
    "last_stream_id unreadable": (
        COIN,
        on_tracker(PropertyFault("last_stream_id", once=True)),
        "fails",
    ),
    "quick unreadable": (COIN, on_tracker(PropertyFault("quick", once=True)), "fails"),
    "quick None": (COIN, on_tracker(lambda t: setattr(t, "quick", None)), "hook"),
    "quiet_ends not a dict": (
        COIN,
        on_tracker(lambda t: setattr(t, "quiet_ends", UserDict(t.quiet_ends))),
        "hook",
    ),
    "quiet_ends unreadable": (COIN, on_tracker(PropertyFault("quiet_ends", once=True)), "fails"),
    "metrics unreadable": (COIN, on_tracker(PropertyFault("metrics", once=True)), "fails"),
    "methods unreadable": (
        COIN,
        lambda h, t: PropertyFault("methods", once=True)(t.metrics),
        "fails",
    ),
    "open_streams unreadable": (
        COIN,
        lambda h, t: PropertyFault("open_streams", once=True)(t.metrics),
        "fails",
    ),
    "methods not a set": (
        COIN,
        lambda h, t: setattr(t.metrics, "methods", Labels(t.metrics.methods)),
        "hook",
    ),
    "a method the label set lacks": (
        COIN,
        lambda h, t: t.metrics.methods.discard("ModelInfer"),
        "hook",
    ),
    "per_message unreadable": (COIN, info_as({"per_message": RAISES}), "fails"),
    "per_message's truth raises": (COIN, info_as({"per_message": NoBool()}), "fails"),
    "name unreadable": (COIN, info_as({"name": RAISES}), "fails"),
    "model_field unreadable": (COIN, info_as({"model_field": RAISES}), "fails"),
    "a cached entry a list": (COIN, entries_as(list), "hook"),
    "a cached summary a list": (COIN, entries_as(lambda e: (e[0], list(e[1]))), "hook"),
    "a cached entry of three": (COIN, entries_as(lambda e: (*e, None)), "fails"),
    "a cached summary of four": (COIN, entries_as(lambda e: (e[0], (*e[1], None))), "fails"),
    "a header a list": (COIN, headers_as(lambda hs: [list(h) for h in hs]), "hook"),
    "a header of three": (COIN, headers_as(lambda hs: [(*h, b"") for h in hs]), "hook"),
    "a header's name a str": (COIN, headers_as(names_as_str), "hook"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_walk_decides_hands_over_or_stops_observing_never_worse(case: str) -> None:
    methods, change, outcome = CASES[case]
    start, server_start, calls, _ = unary_connection()
    hook = Hook(*methods)
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
    forwarded = tracker.request_scanner.process(start)
    tracker.response_scanner.observe(server_start)
    for i, (request, response) in enumerate(calls):
        if i == 2:
            change(hook, tracker)
        forwarded += tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
    assert b"".join(forwarded) == start + b"".join(request for request, _ in calls)
    failed = tracker.request_scanner.failed
    if outcome == "ignored":  # not a new request, as the sink's Python sees it
        assert not failed and hook.asked == 2 and hook.started == [2] and 5 not in tracker.streams
        return
    if outcome == "fails":
        assert failed and hook.asked == (3 if case == "coin_picked not writable back" else 2)
        injected = "unreadable" in case or "raises" in case or "writable" in case
        assert failure_reasons(tracker) == ({"injected"} if injected else {"internal"})
        return
    assert not failed and not tracker.response_scanner.failed
    assert hook.asked == (2 if outcome == "C" else 3)
    assert hook.started == [3] and not tracker.streams and not tracker.quiet_ends
    replayed = "ModelInfer" in hook.quick.replayable and case != "replayable a list"
    assert hook.ended == ([0, 3] if replayed else [3, 0])
    assert hook.per_model == ({"add_sub": 3} if replayed else {})
    assert hook.quick.coin_picked is False  # picked by the walk: freed after the hook's turn


def referenced(hook: Hook, tracker: ConnectionTracker) -> dict[str, Any]:
    """Every object the walk reads to decide and end a call in C (those not shared with the
    rest of the process: no small int, no None)."""
    quick, coin, hot, metrics = hook.quick, hook.coin, hook.hot, tracker.metrics
    return {
        "observer": hook, "quick": quick, "per_call": quick.per_call,
        "replayable": quick.replayable, "coin": coin, "hot": hot,
        "force_header": hot.force_header, "pick_rate": hot.pick_rate, "rand": coin.rand,
        "unpicked": quick.unpicked, "not_replayable": quick.not_replayable,
        "started": quick.started, "ended": hook.ended, "per_model": hook.per_model,
        "quiet_ends": tracker.quiet_ends, "metrics": metrics, "methods": metrics.methods,
        "models": metrics.models, "codes": metrics.codes, "stats": metrics.stats,
        "streams": tracker.streams,
        **{f"stats {k}": v for k, v in metrics.stats.items()},
        **{f"buckets {k}": v.buckets for k, v in metrics.stats.items()},
    }  # fmt: skip


@pytest.mark.parametrize("methods", [COIN, NEVER], ids=["unpicked", "never replayed"])
def test_calls_decided_and_ended_in_c_release_what_they_read(
    methods: tuple[frozenset[str], frozenset[str]],
) -> None:
    hook = Hook(*methods)
    draws: list[float] = []

    def rand() -> float:  # a fresh float each draw, kept here
        draws.append(float(f"0.{len(draws) + 50}"))
        return draws[-1]

    hook.coin.rand = rand
    tracker, calls = connected(hook, 40)
    counts: list[dict[str, int]] = []
    for i, (request, response) in enumerate(calls):
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
        if i in (2, len(calls) - 1):  # the first call decided in C, and the last
            counts.append({k: sys.getrefcount(v) for k, v in referenced(hook, tracker).items()})
    assert hook.asked == 2 and hook.started == [len(calls)]
    assert counts[0] == counts[1]
    held = {sys.getrefcount(x) for x in draws}  # the list's alone
    control = [float("0.5")]
    held_control = {sys.getrefcount(x) for x in control}
    assert held == (held_control if draws else set())
    assert len(draws) == (len(calls) - 2 if methods == COIN else 0)


def test_the_draw_is_the_hooks_own_coin() -> None:
    """The walk calls `coin.rand` once per request it decides, the value it compares."""
    draws = random.Random(7)
    made: list[float] = []

    def rand() -> float:
        made.append(draws.random())
        return made[-1]

    hook = Hook(*COIN)
    hook.coin.rand = rand
    tracker, calls = connected(hook, 30)
    for request, response in calls:
        asked = hook.asked
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
        if made and asked == hook.asked:  # decided in C: unpicked
            assert made[-1] >= hook.hot.pick_rate
        hook.quick.coin_picked = False
    picked = sum(d < hook.hot.pick_rate for d in made)
    assert len(made) == len(calls) - 2 and hook.asked == 2 + picked


def test_a_request_decided_in_c_is_stamped_as_the_sink_stamps_one() -> None:
    """Its record's wall-clock start (`time.time_ns`), monotonic start and path text, as
    `ConnectionTracker.ask_observer` sets them."""
    hook = Hook(*COIN)
    tracker, calls = connected(hook)
    for request, response in calls[:2]:
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
    wall, clock = time.time_ns(), time.perf_counter()
    tracker.request_scanner.process(calls[2][0])
    wall_after, clock_after = time.time_ns(), time.perf_counter()
    assert hook.asked == 2  # decided in C
    record = tracker.streams[5]
    assert type(record) is streams._NativeStream
    assert wall <= record.start_ns <= wall_after
    assert clock <= record.start <= record.request_end <= clock_after
    assert record.path_text == "/inference.GRPCInferenceService/ModelInfer"


class FailingSink:
    """The request direction's sink, but a header block raises `ScanError("protocol")`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def on_header_block(self, *args: Any) -> Any:
        raise ScanError("protocol", "the sink failed")


class Watched(QuickDecisions):
    """QuickDecisions whose writes run Python (and are recorded): code the walk must not run
    with an exception pending."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "coin_picked":
            # an index of -1 is an error only where an exception is pending (C's `-1 and
            # PyErr_Occurred()`): the walk must have put the sink's aside
            self.__dict__.setdefault("writes", []).append((value, False)[-1] or value)
        super().__setattr__(name, value)


def watched_quick(hook: Hook) -> Watched:
    q = hook.quick
    return Watched(q.coin, q.per_call, q.replayable, q.started, q.unpicked, q.not_replayable)


def test_a_picked_requests_sink_failure_is_the_one_reported_and_the_coin_is_freed() -> None:
    """The walk flipped the coin (picked), then the sink raised: the coin is freed for later
    requests (`coin_picked` False again, written through Python while the sink's error waits)
    and the sink's own error is the one observation stops with."""
    registry = CollectorRegistry()
    start, server_start, calls, _ = unary_connection()
    hook = Hook(*COIN)
    tracker = ConnectionTracker(ProxyMetrics(registry), observer=hook)
    forwarded = tracker.request_scanner.process(start)
    tracker.response_scanner.observe(server_start)
    for request, response in calls[:2]:
        forwarded += tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
    hook.hot.pick_rate = 0.75
    tracker.quick = quick = watched_quick(hook)
    tracker.request_scanner.sink = FailingSink(tracker.request_scanner.sink)
    forwarded += tracker.request_scanner.process(calls[2][0])
    assert b"".join(forwarded) == start + b"".join(request for request, _ in calls)
    assert tracker.request_scanner.failed and quick.__dict__["writes"] == [
        False,
        True,
        False,
    ]  # made, picked, freed
    failures = "xsp_observation_failures_total"
    assert registry.get_sample_value(failures, {"reason": "protocol"}) == 1
    assert registry.get_sample_value(failures, {"reason": "internal"}) is None


def test_picked_requests_release_what_the_walk_read() -> None:
    """Requests the walk flips the coin of and hands to the hook (picked): the QuickDecisions
    it reads again to free the coin is released each time."""
    hook = Hook(*COIN)
    tracker, calls = connected(hook, 30)
    tracker.quick = quick = watched_quick(hook)
    hook.hot.pick_rate = 0.75  # every draw (0.5) picks
    counts = []
    for i, (request, response) in enumerate(calls):
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
        if i in (2, len(calls) - 1):
            counts.append(sys.getrefcount(quick))
    assert hook.asked == len(calls)
    assert quick.__dict__["writes"] == [False] + [True, False] * (len(calls) - 2)
    assert counts[0] == counts[1]


def test_counts_made_in_c_release_the_numbers_they_replace() -> None:
    """Each count the walk adds to (the call's counters and histogram, the in-flight gauge,
    the hook's started and ended counts, its per-model counts) holds a number past the small
    ints CPython shares; once calls have been decided and ended in C, nothing but the test
    holds the numbers they replaced, and each new number is held by its container alone."""
    hook = Hook(*COIN)
    tracker, calls = connected(hook, 6)
    for request, response in calls[:3]:
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
    metrics, big = tracker.metrics, 10**12
    for stats in metrics.stats.values():
        stats.count, stats.sum = big + 1, float(big)
        stats.request_bytes, stats.response_bytes = big + 2, big + 3
        stats.buckets = [big + 10 + i for i in range(len(stats.buckets))]
    metrics.codes.update(dict.fromkeys(metrics.codes, big + 4))
    metrics.open_streams = big + 5
    hook.started[0], hook.ended[1] = big + 6, big + 7
    hook.per_model["add_sub"] = big + 8

    def numbers() -> list[Any]:
        out: list[Any] = [metrics.open_streams, hook.started[0], hook.ended[1]]
        out += [hook.per_model["add_sub"], *metrics.codes.values()]
        for stats in metrics.stats.values():
            out += [stats.count, stats.sum, stats.request_bytes, stats.response_bytes]
            out += stats.buckets
        return out

    replaced = numbers()
    for request, response in calls[3:]:
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
    assert hook.asked == 2  # all four decided and ended in C
    now = numbers()
    control = [float(big)]  # held by its list alone
    gone = [x for x in replaced if all(x is not y for y in now)]
    new = [x for x in now if all(x is not y for y in replaced)]
    # the in-flight gauge, started, ended, per model, the code's count, the call's count, sum,
    # bytes each way, one bucket (the others unchanged)
    assert len(gone) == len(new) == 10
    # (counted outside any assert: pytest's rewriting holds what an assert reads)
    held_gone = {sys.getrefcount(x) for x in gone}  # replaced, gone
    held_new = {sys.getrefcount(x) for x in new}  # its container, now, new
    held_control = {sys.getrefcount(x) for x in control}
    assert held_gone == {n + 1 for n in held_control}, held_gone
    assert held_new == {n + 2 for n in held_control}, held_new
    assert hook.started[0] == big + 9 and metrics.open_streams == big + 5


@pytest.mark.parametrize(
    "fault",
    ["coin_picked not writable", "rand raises", "started unreadable", "unpicked unreadable",
     "replayable's lookup raises", "not_replayable unreadable", "per_message unreadable",
     "quiet_ends unreadable", "open_streams unreadable"],
)  # fmt: skip
def test_a_request_start_that_fails_in_c_releases_what_it_read(fault: str) -> None:
    """Connection after connection whose third request's start fails in C, one hook: what
    the walk read of the hook's objects before it failed is released each time."""
    methods, change, outcome = CASES[fault]
    assert outcome == "fails"
    hook = Hook(*methods)
    shared = [hook, hook.quick.per_call, hook.quick.replayable, hook.coin, hook.hot,
              hook.hot.force_header, hook.quick.unpicked, hook.quick.not_replayable,
              hook.started]  # fmt: skip
    counts = []
    for i in range(12):
        hook.hot.pick_rate = 0.25
        hook.quick.coin = hook.coin
        hook.coin.hot = hook.hot
        start, server_start, calls, _ = unary_connection()
        tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
        tracker.request_scanner.process(start)
        tracker.response_scanner.observe(server_start)
        for j, (request, response) in enumerate(calls):
            if j == 2:
                change(hook, tracker)
            tracker.request_scanner.process(request)
            tracker.response_scanner.observe(response)
        assert tracker.request_scanner.failed
        del tracker
        if i in (1, 11):  # (one collection for the rounds before: the suite's heap is large)
            gc.collect()
            counts.append([sys.getrefcount(x) for x in shared])
    assert counts[0] == counts[1]


class Falsy:
    """A false value of its own (not the shared False)."""

    def __bool__(self) -> bool:
        return False


def test_a_request_started_in_c_keeps_no_reference_it_does_not_need() -> None:
    """Calls decided and ended in C on stream ids past the small ints, what the walk reads of
    the cached MethodInfo made objects of their own: each is held afterwards as before; the
    last stream id each call replaces is let go; a record holds its path text alone."""
    conv = Conversation()
    hook = Hook(*COIN)
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
    tracker.request_scanner.process(bytes(conv.client))
    tracker.response_scanner.observe(bytes(conv.server))
    per_message, name, field = Falsy(), "".join(["Model", "Infer"]), tuple([1])
    counts, paths, lasts = [], [], []
    for sid in range(1001, 1041, 2):
        at, server_at = len(conv.client), len(conv.server)
        conv.request(sid, "/inference.GRPCInferenceService/ModelInfer", b"\x0a\x01m")
        conv.response(sid, b"\x0a\x03out")
        if sid == 1005:  # the blocks are cached: from now on the walk decides
            info_as({"per_message": per_message, "name": name, "model_field": field})(hook, tracker)
        last = tracker.last_stream_id
        tracker.request_scanner.process(bytes(conv.client[at:]))
        if sid >= 1005:
            paths.append(sys.getrefcount(tracker.streams[sid].path_text))  # the record, the arg
            lasts.append(sys.getrefcount(last))  # `last`, the arg: the tracker holds `sid`
        del last
        tracker.response_scanner.observe(bytes(conv.server[server_at:]))
        if sid in (1005, 1039):
            counts.append([sys.getrefcount(x) for x in (per_message, name, field)])
    assert hook.asked == 2 and not tracker.request_scanner.failed
    assert counts[0] == counts[1] and set(paths) == {2} and set(lasts) == {2}


def test_a_draining_connections_requests_release_what_the_walk_read() -> None:
    hook = Hook(*COIN)
    tracker, calls = connected(hook, 20)
    counts = []
    for i, (request, response) in enumerate(calls):
        if i == 2:
            tracker.refuse_above = 10**12 + 1  # a number of its own, no stream refused
        tracker.request_scanner.process(request)
        tracker.response_scanner.observe(response)
        if i in (2, len(calls) - 1):
            counts.append(sys.getrefcount(tracker.refuse_above))
    assert counts[0] == counts[1] and not tracker.request_scanner.failed


@pytest.mark.parametrize("methods", [COIN, NEVER], ids=["not per call", "never replayed"])
def test_an_inference_stream_is_started_by_the_sink_never_in_c(
    methods: tuple[frozenset[str], frozenset[str]],
) -> None:
    """Its request messages are counted one by one (`inferences`), which only the sink's
    Python sets up: the walk leaves each such request to it, cached block or not."""
    conv = Conversation()
    hook = Hook(*methods)
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
    tracker.request_scanner.process(bytes(conv.client))
    tracker.response_scanner.observe(bytes(conv.server))
    for sid in (1, 3, 5):
        at = len(conv.client)
        conv.request(sid, "/inference.GRPCInferenceService/ModelStreamInfer", b"\x0a\x01m")
        tracker.request_scanner.process(bytes(conv.client[at:]))
        assert tracker.streams[sid].inferences is not None
    assert hook.asked == 3 and not tracker.request_scanner.failed
