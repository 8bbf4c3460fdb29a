"""A call's end in C (`ending_ready`, `end_call` in `_framewalk.c`), read as carefully as
network bytes.

Where the response direction's HPACK cache holds a call's trailers and the hook wants nothing
at its end (no hook, or a `QuietEnd`), the walk ends the call itself: the in-flight count, the
call's counters and histogram in `ProxyMetrics`, the `QuietEnd`'s counts. What it reads (the
tracker's quiet ends, the metrics' label sets and tables, the `QuietEnd` and its counters) may
be anything the Python allows. Each case must give one of three outcomes: ended in C, handed
to the sink (which ends it as without the C walk), or observation stopped with every byte
still forwarded; the counts of a call ended either way are the same.
"""

from __future__ import annotations

import gc
import sys
from collections import UserDict
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.proxy import frames, streams
from sidecar.proxy.metrics import DURATION_BUCKETS, ProxyMetrics
from sidecar.proxy.model_name import UNKNOWN_MODEL
from sidecar.proxy.streams import ConnectionTracker, QuietEnd, RequestStart, StreamEnd
from tests.proxy.faults import RAISES, READ_ONLY, Collides, Faulty, Injected, NoBool, PropertyFault
from tests.proxy.proxy_h2build import Conversation
from tests.proxy.test_framewalk import Recorder
from tests.proxy.test_framewalk_quick import entries_as, failure_reasons
from tests.proxy.test_framewalk_streams import INFER

pytestmark = pytest.mark.skipif(
    frames.native_walk is None or streams._NativeStream is None,
    reason="the C frame walker is not built here",
)


class Hook:
    """Answers every request with `answer` (a `QuietEnd` counted in `ended[1]` by model
    label, unless a case changes it); records the ends it is given."""

    def __init__(self) -> None:
        self.ended = [0, 0]
        self.per_model: dict[str, int] = {}
        self.answer: Any = QuietEnd(self.ended, 1, self.per_model)
        self.ends: list[StreamEnd] = []

    def on_request_headers(self, start: RequestStart) -> Any:
        return self.answer

    def on_request_body(self, stream_id: int, model: str | None, body: bytes) -> None:
        raise AssertionError("no body is asked for")

    def on_stream_end(self, end: StreamEnd) -> None:
        self.ends.append(end)


def calls(message: bytes) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    """Three unary calls (stream ids 1, 3, 5) of `message`, each answered OK."""
    conv = Conversation()
    start, server_start = bytes(conv.client), bytes(conv.server)
    out = []
    for sid in (1, 3, 5):
        client, server = len(conv.client), len(conv.server)
        conv.request(sid, INFER, message)
        conv.response(sid, b"\x0a\x03out")
        out.append((bytes(conv.client[client:]), bytes(conv.server[server:])))
    return start, server_start, out


ADD_SUB = b"\x0a\x07add_sub"  # ModelInferRequest.model_name = "add_sub"


class ReadOnce:
    """Makes one attribute of an object readable once more, then raising."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, obj: Any) -> None:
        value, reads = getattr(obj, self.name), [0]

        def once(_: Any) -> Any:
            reads[0] += 1
            if reads[0] > 1:
                raise Injected(f"{self.name} read twice")
            return value

        obj.__class__ = type("Broken", (type(obj),), {self.name: property(once)})


def evil_key() -> Any:
    """A key in the quiet ends that collides with stream 5's, put there before 5's (so a
    lookup of 5 meets it first), armed once 5 is in."""

    def insert(hook: Hook, tracker: ConnectionTracker) -> None:
        Collides.armed = False
        tracker.quiet_ends[Collides(5)] = None  # type: ignore[index]

    def arm(hook: Hook, tracker: ConnectionTracker) -> None:
        Collides.armed = True

    insert.at_request = True  # type: ignore[attr-defined]
    insert.then = arm  # type: ignore[attr-defined]
    return insert


def colliding_in(table: str, key: tuple[str, ...]) -> Any:
    """A key colliding with `key` in the metrics' `table` (codes or stats)."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        Collides.armed = False
        table_ = getattr(tracker.metrics, table)
        value = table_.pop(key)
        table_[Collides(key)] = None  # first in the key's probe sequence
        table_[key] = value
        Collides.armed = True

    return apply


def colliding_model(metrics: ProxyMetrics) -> None:
    """The model label set with a key that add_sub's lookup meets first, raising once."""
    Collides.armed = False
    metrics.models.discard("add_sub")
    metrics.models.add(Collides("add_sub"))  # type: ignore[arg-type]
    metrics.models.add("add_sub")
    Collides.armed = True


class Name(str):
    """A model name that is a str, but not exactly one."""


def model_of_a_str_subclass(hook: Hook, tracker: ConnectionTracker) -> None:
    record = tracker.streams[5]
    record.model = Name(record.model)


class Labels(list):  # type: ignore[type-arg]
    """A label set that is not a set (ProxyMetrics' `models` as a list)."""

    def add(self, name: str) -> None:
        self.append(name)


class PerModel(UserDict):  # type: ignore[type-arg]
    """A QuietEnd's per-model counts in a mapping that is not a dict."""


def on_tracker(change: Callable[[ConnectionTracker], None]) -> Any:
    return lambda hook, tracker: change(tracker)


def on_metrics(change: Callable[[ProxyMetrics], None]) -> Any:
    return lambda hook, tracker: change(tracker.metrics)


def answer(make: Callable[[Hook], Any]) -> Any:
    """The hook's answer to the third request (made before it: every other change is made
    between the third request and its response)."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        hook.answer = make(hook)

    apply.at_request = True  # type: ignore[attr-defined]
    return apply


def quiet_end(change: Callable[[QuietEnd], Any]) -> Any:
    """The third call's QuietEnd, as the tracker keeps it for its end, replaced."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        tracker.quiet_ends[5] = change(tracker.quiet_ends[5])

    return apply


def stats_of(change: Callable[[Any], Any]) -> Any:
    """Every CallStats of the metrics replaced by `change(stats)`."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        table = tracker.metrics.stats
        for key, value in list(table.items()):
            table[key] = change(value)

    return apply


def response_cache(shape: Callable[[tuple[Any, Any]], Any]) -> Any:
    return entries_as(shape, "response")


def models_over_the_bound(metrics: ProxyMetrics) -> None:
    metrics.models.clear()
    metrics.max_models = 0


# case -> (the request message, the change before the third call's response, outcome: "C",
# "sink" (its trailers; "sink, both blocks": its response headers too) or "fails")
CASES: dict[str, tuple[bytes, Any, str]] = {
    "as is": (ADD_SUB, lambda hook, tracker: None, "C"),
    "no model name": (b"\x12\x02xy", lambda hook, tracker: None, "C"),
    "an empty model name": (b"\x0a\x00", lambda hook, tracker: None, "C"),
    "the hook wants the end": (ADD_SUB, answer(lambda hook: None), "sink"),
    "quiet_ends unreadable": (ADD_SUB, on_tracker(PropertyFault("quiet_ends")), "fails"),
    "quiet_ends not a dict": (
        ADD_SUB,
        on_tracker(lambda t: setattr(t, "quiet_ends", UserDict(t.quiet_ends))),
        "sink",
    ),
    "quiet_ends' lookup raises": (ADD_SUB, evil_key(), "fails"),
    "metrics unreadable": (ADD_SUB, on_tracker(PropertyFault("metrics", once=True)), "fails"),
    "observer unreadable": (ADD_SUB, on_tracker(PropertyFault("observer", once=True)), "fails"),
    "the model label's lookup raises": (ADD_SUB, on_metrics(colliding_model), "fails"),
    "models unreadable": (ADD_SUB, on_metrics(PropertyFault("models")), "fails"),
    "models not a set": (
        ADD_SUB,
        on_metrics(lambda m: setattr(m, "models", Labels(m.models))),
        "sink",
    ),
    "a model past the label bound": (ADD_SUB, on_metrics(models_over_the_bound), "sink"),
    "codes unreadable": (ADD_SUB, on_metrics(PropertyFault("codes")), "fails"),
    "stats unreadable": (ADD_SUB, on_metrics(PropertyFault("stats")), "fails"),
    "codes not a dict": (
        ADD_SUB,
        on_metrics(lambda m: setattr(m, "codes", UserDict(m.codes))),
        "sink",
    ),
    "stats not a dict": (
        ADD_SUB,
        on_metrics(lambda m: setattr(m, "stats", UserDict(m.stats))),
        "sink",
    ),
    "a cached entry a list": (ADD_SUB, response_cache(list), "sink, both blocks"),
    "a cached summary a list": (
        ADD_SUB,
        response_cache(lambda e: (e[0], list(e[1]))),
        "sink, both blocks",
    ),
    "a cached entry of three": (ADD_SUB, response_cache(lambda e: (*e, None)), "fails"),
    "a cached summary of four": (
        ADD_SUB,
        response_cache(lambda e: (e[0], (*e[1], None))),
        "fails",
    ),
    "open_streams unreadable": (ADD_SUB, on_metrics(PropertyFault("open_streams")), "fails"),
    "codes read once": (ADD_SUB, on_metrics(ReadOnce("codes")), "fails"),
    "a count not a number": (
        ADD_SUB,
        on_metrics(lambda m: m.codes.update(dict.fromkeys(m.codes, "3"))),
        "fails",
    ),
    "buckets a tuple": (ADD_SUB, stats_of(lambda s: Faulty(s, {"buckets": (0,) * 20})), "fails"),
    "per_model's count not a number": (
        ADD_SUB,
        answer(lambda h: QuietEnd(h.ended, 1, {"add_sub": "2"})),
        "fails",
    ),
    "per_model read-only": (
        ADD_SUB,
        answer(lambda h: QuietEnd(h.ended, 1, MappingProxyType(h.per_model))),
        "fails",
    ),
    "codes' lookup raises": (
        ADD_SUB,
        colliding_in("codes", ("ModelInfer", "add_sub", "OK")),
        "fails",
    ),
    "stats' lookup raises": (ADD_SUB, colliding_in("stats", ("ModelInfer", "add_sub")), "fails"),
    "a model name of a str subclass": (ADD_SUB, model_of_a_str_subclass, "sink"),
    "a cached :status whose truth raises": (  # the trailers' (after the end is looked up)
        ADD_SUB,
        response_cache(lambda e: (e[0], (*e[1][:2], NoBool())) if e[1][0] is not None else e),
        "fails",
    ),
    "a label set's first call": (ADD_SUB, on_metrics(lambda m: m.codes.clear()), "sink"),
    "a label pair's first call": (ADD_SUB, on_metrics(lambda m: m.stats.clear()), "sink"),
    "per_model not a dict": (
        ADD_SUB,
        answer(lambda h: QuietEnd(h.ended, 1, PerModel(h.per_model))),
        "C",
    ),
    "per_model's get raises": (
        ADD_SUB,
        answer(lambda h: QuietEnd(h.ended, 1, Faulty(PerModel(), {"get": RAISES}))),
        "fails",
    ),
    "no per_model": (ADD_SUB, answer(lambda h: QuietEnd(h.ended, 1)), "C"),
    "ended unreadable": (
        ADD_SUB,
        quiet_end(lambda q: Faulty(q, {"ended": RAISES})),
        "fails",
    ),
    "index unreadable": (
        ADD_SUB,
        quiet_end(lambda q: Faulty(q, {"index": RAISES})),
        "fails",
    ),
    "per_model unreadable": (
        ADD_SUB,
        quiet_end(lambda q: Faulty(q, {"per_model": RAISES})),
        "fails",
    ),
    "buckets unreadable": (ADD_SUB, stats_of(lambda s: Faulty(s, {"buckets": RAISES})), "fails"),
    "count not writable": (ADD_SUB, stats_of(lambda s: Faulty(s, {"count": READ_ONLY})), "fails"),
    "sum not writable": (ADD_SUB, stats_of(lambda s: Faulty(s, {"sum": READ_ONLY})), "fails"),
    "request_bytes not writable": (
        ADD_SUB,
        stats_of(lambda s: Faulty(s, {"request_bytes": READ_ONLY})),
        "fails",
    ),
    "response_bytes not writable": (
        ADD_SUB,
        stats_of(lambda s: Faulty(s, {"response_bytes": READ_ONLY})),
        "fails",
    ),
}


def counted(hook: Hook, tracker: ConnectionTracker) -> tuple[Any, ...]:
    """What the three calls' ends leave counted (the metrics read through `ProxyMetrics`'s
    own tables, whatever their kind)."""
    metrics = tracker.metrics
    codes = {k: v for k, v in dict(metrics.codes).items() if v}
    stats = {
        k: (s.count, s.request_bytes, s.response_bytes, sum(s.buckets))
        for k, s in dict(metrics.stats).items()
    }
    return hook.ended, dict(hook.per_model), len(hook.ends), codes, stats, metrics.open_streams


def run(message: bytes, change: Any) -> tuple[Hook, ConnectionTracker, Recorder, bytes, bytes]:
    """The three calls with sampling on, `change` made before the third call's response (or
    its request): the hook, the tracker, the response sink's record, what was forwarded and
    what should have been."""
    start, server_start, exchanges = calls(message)
    hook = Hook()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
    forwarded = tracker.request_scanner.process(start)
    tracker.response_scanner.observe(server_start)
    received = tracker.response_scanner.sink = Recorder(tracker.response)
    at_request = getattr(change, "at_request", False)
    for i, (request, response) in enumerate(exchanges):
        if i == 2 and at_request:
            change(hook, tracker)
        forwarded += tracker.request_scanner.process(request)
        after = getattr(change, "then", None) if at_request else change
        if i == 2 and after is not None:
            after(hook, tracker)
        tracker.response_scanner.observe(response)
    sent = start + b"".join(request for request, _ in exchanges)
    return hook, tracker, received, b"".join(forwarded), sent


def by_sink(received: Recorder) -> list[int]:
    """The stream ids of the response blocks the sink was given."""
    return [c[1] for c in received.calls if c[0] == "on_header_block"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_walk_ends_a_call_hands_it_over_or_stops_observing_never_worse(case: str) -> None:
    message, change, outcome = CASES[case]
    hook, tracker, received, forwarded, sent = run(message, change)
    assert forwarded == sent
    if outcome == "fails":
        assert tracker.response_scanner.failed
        injected = any(w in case for w in ("unreadable", "raises", "writable", "read once"))
        assert failure_reasons(tracker) == ({"injected"} if injected else {"internal"})
        return
    assert not tracker.request_scanner.failed and not tracker.response_scanner.failed
    expected = {"C": [1, 1, 3, 3], "sink": [1, 1, 3, 3, 5], "sink, both blocks": [1, 1, 3, 3, 5, 5]}
    assert by_sink(received) == expected[outcome]  # "sink": its trailers
    assert not tracker.streams and tracker.in_flight == 0
    ended, _, ends, codes, stats, _ = counted(hook, tracker)
    assert sum(ended) + ends == 3
    cleared = case in ("a label set's first call", "a label pair's first call")  # counts anew
    assert sum(codes.values()) == (1 if "label set" in case else 3)
    assert sum(s[0] for s in stats.values()) == sum(s[3] for s in stats.values())
    assert sum(s[0] for s in stats.values()) == (1 if "label pair" in case else 3)
    per_model = hook.answer.per_model if isinstance(hook.answer, QuietEnd) else None
    if per_model is not None and message == ADD_SUB and not cleared:
        bound = case == "a model past the label bound"  # the third call under "_other"
        assert dict(per_model) == ({"add_sub": 2, "_other": 1} if bound else {"add_sub": 3})


@pytest.fixture
def configure() -> Iterator[Callable[..., None]]:
    """`_framewalk.configure`, its constants restored after the test."""
    module = streams._framewalk
    yield module.configure
    module.configure(streams._STATUS_NAMES, UNKNOWN_MODEL, DURATION_BUCKETS)


def test_configure_takes_only_the_constants_of_a_calls_end(configure: Any) -> None:
    names, bounds = streams._STATUS_NAMES, DURATION_BUCKETS
    for bad in [
        (), (names, UNKNOWN_MODEL), (names, UNKNOWN_MODEL, bounds, None),
        (UserDict(names), UNKNOWN_MODEL, bounds), (names, None, bounds),
        (names, UNKNOWN_MODEL, list(bounds)), (names, UNKNOWN_MODEL, (0.0,) * 65),
        (names, UNKNOWN_MODEL, (0.0, "1")),
    ]:  # fmt: skip
        with pytest.raises(TypeError):
            configure(*bad)
    configure(names, UNKNOWN_MODEL, (0.0,) * 64)  # at the bound
    configure(names, UNKNOWN_MODEL, (1, 2.0))  # ints are numbers too
    configure(names, UNKNOWN_MODEL, (-1.0, 0.0))  # -1.0 is a bound, not an error


@pytest.mark.parametrize(
    ("bounds", "bucket"), [((0.0, 0.0, 0.0), 3), ((1e9,), 0), ((0.0, 1e9, 1e9), 1), ((), 0)]
)
def test_a_call_ended_in_c_lands_in_the_bucket_its_bounds_give(
    configure: Any, bounds: tuple[float, ...], bucket: int
) -> None:
    """`bisect_left(bounds, duration)`, as `ProxyMetrics.record` does with the bounds
    `configure` gave (every duration is above 0 and below 1e9 s)."""
    before: list[int] = []

    def snapshot(hook: Hook, tracker: ConnectionTracker) -> None:
        (stats,) = tracker.metrics.stats.values()
        before.extend(stats.buckets)

    configure(streams._STATUS_NAMES, UNKNOWN_MODEL, (0.0,) * 64)  # past the bounds: zeros
    configure(streams._STATUS_NAMES, UNKNOWN_MODEL, bounds)
    _, tracker, received, _, _ = run(ADD_SUB, snapshot)
    (stats,) = tracker.metrics.stats.values()
    assert by_sink(received) == [1, 1, 3, 3]  # the third call ended in C
    grew = [b - a for a, b in zip(before, stats.buckets, strict=True)]
    assert grew == [0] * bucket + [1] + [0] * (len(grew) - bucket - 1)


def labelled(model: str, code: str = "OK") -> Any:
    """The third call's label set made beforehand (its counters exist: the walk may end it)."""

    def apply(hook: Hook, tracker: ConnectionTracker) -> None:
        tracker.metrics.call_stats("ModelInfer", model)
        tracker.metrics.codes[("ModelInfer", model, code)] = 0

    return apply


def test_the_constants_configure_gave_name_a_calls_end(configure: Any) -> None:
    """The model label of a call with no model name, and the code names of grpc-status
    values; a status the names lack is the sink's to count."""
    configure(streams._STATUS_NAMES, "unnamed", DURATION_BUCKETS)
    _, tracker, received, _, _ = run(b"", labelled("unnamed"))
    assert by_sink(received) == [1, 1, 3, 3]
    assert tracker.metrics.codes[("ModelInfer", "unnamed", "OK")] == 1  # the third, in C
    configure({b"0": "ZERO"}, UNKNOWN_MODEL, DURATION_BUCKETS)
    _, tracker, received, _, _ = run(ADD_SUB, labelled("add_sub", "ZERO"))
    assert by_sink(received) == [1, 1, 3, 3]
    assert tracker.metrics.codes[("ModelInfer", "add_sub", "ZERO")] == 1
    configure({}, UNKNOWN_MODEL, DURATION_BUCKETS)
    _, tracker, received, _, _ = run(ADD_SUB, lambda hook, tracker: None)
    assert by_sink(received) == [1, 1, 3, 3, 5]


def test_calls_handed_to_the_sink_at_their_end_release_what_the_walk_read() -> None:
    """Each call's end is looked up in C (the tracker's quiet ends, its metrics, the label
    set's count), then handed to the sink (its label pair's counters are made anew each
    time): what the walk read for it is released."""
    conv = Conversation()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Hook())
    tracker.request_scanner.process(bytes(conv.client))
    tracker.response_scanner.observe(bytes(conv.server))
    received = tracker.response_scanner.sink = Recorder(tracker.response)
    metrics, quiet_ends = tracker.metrics, tracker.quiet_ends
    counts = []
    for sid in range(1, 80, 2):
        at, server_at = len(conv.client), len(conv.server)
        conv.request(sid, INFER, ADD_SUB)
        conv.response(sid, b"\x0a\x03out")
        tracker.request_scanner.process(bytes(conv.client[at:]))
        metrics.stats.clear()  # the label pair's first call: the sink's
        tracker.response_scanner.observe(bytes(conv.server[server_at:]))
        if sid in (5, 79):
            counts.append((sys.getrefcount(metrics), sys.getrefcount(quiet_ends)))
    assert by_sink(received)[-1] == 79 and not tracker.response_scanner.failed
    assert counts[0] == counts[1]


def test_a_response_block_of_a_stream_no_longer_tracked_is_passed_over_in_c() -> None:
    """A response's cached blocks again, for a stream that has ended: the sink would find no
    record and do nothing, so the walk calls it for nothing."""
    conv = Conversation()
    tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=Hook())
    tracker.request_scanner.process(bytes(conv.client))
    tracker.response_scanner.observe(bytes(conv.server))
    received = tracker.response_scanner.sink = Recorder(tracker.response)
    for sid in (1, 3, 5):
        at, server_at = len(conv.client), len(conv.server)
        conv.request(sid, INFER, ADD_SUB)
        conv.response(sid, b"\x0a\x03out")
        tracker.request_scanner.process(bytes(conv.client[at:]))
        tracker.response_scanner.observe(response := bytes(conv.server[server_at:]))
    tracker.response_scanner.observe(response)  # stream 5's response once more
    assert by_sink(received) == [1, 1, 3, 3] and not tracker.response_scanner.failed


@pytest.mark.parametrize(
    "fault",
    ["a cached :status whose truth raises", "codes read once", "count not writable",
     "ended unreadable", "per_model's get raises", "buckets unreadable",
     "stats' lookup raises", "models unreadable"],
)  # fmt: skip
def test_a_call_end_that_fails_in_c_releases_what_it_read(fault: str) -> None:
    """Connection after connection, one hook and one ProxyMetrics, whose third call's end
    fails in C: what the walk read for it is released each time."""
    message, change, outcome = CASES[fault]
    assert outcome == "fails"
    hook, metrics = Hook(), ProxyMetrics(CollectorRegistry())
    counts = []
    for i in range(12):
        hook.answer = QuietEnd(hook.ended, 1, hook.per_model)
        start, server_start, exchanges = calls(message)
        tracker = ConnectionTracker(metrics, observer=hook)
        tracker.request_scanner.process(start)
        tracker.response_scanner.observe(server_start)
        at_request = getattr(change, "at_request", False)
        for j, (request, response) in enumerate(exchanges):
            if j == 2 and at_request:
                change(hook, tracker)
            tracker.request_scanner.process(request)
            if j == 2 and not at_request:
                change(hook, tracker)
            tracker.response_scanner.observe(response)
        assert tracker.response_scanner.failed
        metrics.__class__ = ProxyMetrics  # a property fault undone
        Collides.armed = False
        metrics.codes = {k: v for k, v in metrics.codes.items() if type(k) is tuple}
        metrics.stats = {k: v for k, v in metrics.stats.items() if type(k) is tuple}
        metrics.stats = {k: getattr(v, "_inner", v) for k, v in metrics.stats.items()}
        del tracker
        if i in (1, 11):  # (one collection for the rounds before: the suite's heap is large)
            gc.collect()
            shared = [hook, metrics, hook.ended, hook.per_model, metrics.codes, metrics.stats,
                      metrics.models, metrics.methods, *metrics.stats.values()]  # fmt: skip
            counts.append([sys.getrefcount(x) for x in shared])
    assert counts[0] == counts[1]
