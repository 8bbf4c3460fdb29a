"""Values made once per key, whichever thread asks first (the report runs its analyses two
at a time: `TraceAnalysis.prefetch`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class OncePerKey(Generic[K, V]):
    """`get(key, build)`: the value `build()` made for `key`, made by the first caller while
    the others asking for that key wait for it (not a second `build()` beside it). A build
    that raises keeps nothing: the next caller builds again."""

    def __init__(self) -> None:
        self._values: dict[K, V] = {}
        self._locks: dict[K, threading.Lock] = {}
        self._guard = threading.Lock()  # (over `_locks`)

    def get(self, key: K, build: Callable[[], V]) -> V:
        if key in self._values:
            return self._values[key]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                self._values[key] = build()
        return self._values[key]
