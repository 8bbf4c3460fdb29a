"""The counters the C walk bumps itself, against the Python sinks' `counts[index] += 1`.

Where the relay decides a request (`QuickDecisions`) or ends a quiet one (`QuietEnd`) in C, it
adds 1 to the hook's counters: `quick.started[0]`, `quiet.ended[quiet.index]`. The sampling
hook's counters are shared memory (a ctypes array, buffer format "<q"): those the walk bumps in
place, with no Python call (`count_one` in `_framewalk.c`); any other container, format, shape
or index goes through `seq[key] += 1` as Python would. A third unary call on a connection is
decided and ended in C (its header blocks cached by the first two); it is run with the C walk
and with the Python sinks, with the same counters, and must leave the same counts, the same
failures, and the in-place bump only where it applies (containers that record their Python
item calls tell which path ran).
"""

from __future__ import annotations

import array
import ctypes
import gc
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sidecar.proxy import frames, streams
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import (
    ConnectionTracker,
    QuietEnd,
)
from tests.proxy.test_framewalk_quick import COIN, Hook
from tests.proxy.test_framewalk_streams import unary_connection

pytestmark = pytest.mark.skipif(
    frames.native_walk is None or streams._NativeStream is None,
    reason="the C frame walker is not built here",
)


class Watched:
    """Mixed into a container: records each `seq[key] = value` made through Python once
    `watched` is called (ctypes' constructor sets items too)."""

    python_sets: list[Any] | None = None

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.python_sets is not None:
            self.python_sets.append(key)
        super().__setitem__(key, value)  # type: ignore[misc]


def watched(container: Any) -> Any:
    container.python_sets = []
    return container


class WatchedList(Watched, list):
    pass


class WatchedArray(Watched, array.array):
    pass


class WatchedShared(Watched, ctypes.c_longlong * 2):  # type: ignore[misc]
    """The sampling hook's kind: native 64-bit ints, format "<q"."""


class WatchedBigEndian(Watched, ctypes.c_longlong.__ctype_be__ * 2):  # type: ignore[misc]
    pass


class WatchedUnsigned(Watched, ctypes.c_ulonglong * 2):  # type: ignore[misc]
    pass


class WatchedNumpy(Watched, np.ndarray):
    pass


class ReadOnlyBuffer(WatchedNumpy):
    """Its buffer read-only (no writable view of it can be had), its items still settable."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.flags.writeable = True
        try:
            super().__setitem__(key, value)
        finally:
            self.flags.writeable = False


def read_only_counts() -> ReadOnlyBuffer:
    out = watched(np.array([5, 7], dtype=np.longlong).view(ReadOnlyBuffer))
    out.flags.writeable = False
    return out


def numpy_counts(shape: tuple[int, ...]) -> WatchedNumpy:
    out = np.arange(5, 5 + int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return watched(out.view(WatchedNumpy))


# name -> (a fresh container holding 5 and 7 (or rows from 5 on), whether its format is the
# native 64-bit int the walk bumps in place)
CONTAINERS: dict[str, tuple[Callable[[], Any], bool]] = {
    "list": (lambda: watched(WatchedList([5, 7])), False),
    "array q": (lambda: watched(WatchedArray("q", [5, 7])), True),  # format "q"
    "shared <q": (lambda: watched(WatchedShared(5, 7)), True),
    "big-endian >q": (lambda: watched(WatchedBigEndian(5, 7)), False),
    "unsigned <Q": (lambda: watched(WatchedUnsigned(5, 7)), False),
    "array i (4 bytes)": (lambda: watched(WatchedArray("i", [5, 7])), False),
    "array d (8-byte floats)": (lambda: watched(WatchedArray("d", [5.0, 7.0])), False),
    "array I at a carry": (lambda: watched(WatchedArray("I", [2**32 - 1, 2**32 - 1])), False),
    "numpy int64 (format l)": (lambda: numpy_counts((2,)), False),
    "numpy 2x2": (lambda: numpy_counts((2, 2)), False),
    "read-only buffer, format q": (read_only_counts, False),
}
INDEXES = [0, 1, 2, -1, -2, -3, True, 2**70]


def values(container: Any) -> Any:
    if isinstance(container, np.ndarray):
        return np.asarray(container).tolist()
    return list(container)


def third_call(walker: Any, started: Any, ended: Any, index: Any) -> tuple[Any, ...]:
    """Three unary calls on one connection with sampling on, the third counted in `started`
    (its start) and `ended[index]` (its end). What the counters, the hook and the scanners
    are left with."""
    saved = frames.native_walk
    frames.native_walk = walker
    try:
        start, server_start, calls, _ = unary_connection()
        hook = Hook(*COIN)  # a coin that does not pick: every request unpicked
        tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()), observer=hook)
        tracker.request_scanner.process(start)
        tracker.response_scanner.observe(server_start)
        for i, (request, response) in enumerate(calls):
            if i == 2:
                hook.quick.started = started
                hook.quick.unpicked = QuietEnd(ended, index, hook.per_model)
            tracker.request_scanner.process(request)
            tracker.response_scanner.observe(response)
        failed = (tracker.request_scanner.failed, tracker.response_scanner.failed)
        return values(started), values(ended), dict(hook.per_model), failed, hook.asked
    finally:
        frames.native_walk = saved


@pytest.mark.parametrize("index", INDEXES, ids=repr)
@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_a_quiet_ends_count_is_the_sinks_in_any_container(kind: str, index: Any) -> None:
    make, native = CONTAINERS[kind]
    with_c = third_call(frames.native_walk, WatchedList([0]), c_ended := make(), index)
    without = third_call(None, WatchedList([0]), make(), index)
    assert with_c[:4] == without[:4]
    assert with_c[4] == 2 and without[4] == 3  # the third call was decided in C
    length = len(values(c_ended))
    in_range = -length <= index < length
    if in_range and "carry" not in kind:  # past 2**32 - 1, "I" overflows as Python raises
        assert with_c[3] == (False, False)
        assert with_c[2] == {"add_sub": 3}
    in_place = native and in_range and index >= 0 and type(index) is int
    python_sets = [] if in_place or not in_range else [index]
    assert c_ended.python_sets == python_sets
    if isinstance(c_ended, array.array):  # no view of its buffer left behind: it can grow
        c_ended.append(0)


@pytest.mark.parametrize("kind", [k for k in CONTAINERS if "carry" not in k])
def test_a_request_decided_in_c_counts_its_start_as_the_hook_would(kind: str) -> None:
    """(Not at a carry: there the relay's count fails where the hook's own would raise in the
    hook, which the relay logs and survives: no longer the same request.)"""
    make, native = CONTAINERS[kind]
    with_c = third_call(frames.native_walk, c_started := make(), WatchedList([0, 0]), 1)
    without = third_call(None, make(), WatchedList([0, 0]), 1)
    assert with_c[:4] == without[:4] and with_c[3] == (False, False)
    assert (with_c[4], without[4]) == (2, 3)
    assert c_started.python_sets == ([] if native else [0])
    if isinstance(c_started, array.array):
        c_started.append(0)


class Wrapping(WatchedArray):
    """Native 64-bit ints whose own item methods take any index (modulo its length)."""

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(key % len(self))

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key % len(self), value)


def test_an_index_past_a_machine_word_reaches_the_containers_own_methods() -> None:
    """An index no `Py_ssize_t` holds is no in-place bump: the container's own `seq[key] += 1`
    gets it, with nothing left over from the failed conversion."""
    with_c = third_call(frames.native_walk, [0], c_ended := watched(Wrapping("q", [5, 7])), 2**70)
    without = third_call(None, [0], watched(Wrapping("q", [5, 7])), 2**70)
    assert with_c[:4] == without[:4] == ([1], [6, 7], {"add_sub": 3}, (False, False))
    assert with_c[4] == 2 and c_ended.python_sets == [0]


def test_a_quiet_ends_index_is_released_after_each_count() -> None:
    """An index past the small ints CPython shares (into a container whose own item methods
    take it): the walk's reads of it leave it held by the QuietEnd and the test alone."""
    index = 10**12
    before = sys.getrefcount(index)
    with_c = third_call(frames.native_walk, [0], c_ended := watched(Wrapping("q", [5, 7])), index)
    gc.collect()  # the connection's objects hold each other
    after = sys.getrefcount(index)
    assert with_c[1] == [6, 7] and with_c[4] == 2 and c_ended.python_sets == [0]
    assert after == before
