"""What a C object of the relay does when it is freed: it leaves the cycle collector before it
drops its references, and gives its memory back (the pumps' and the walkers' tests share these)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import Any


def tracked_while_freed(make: Callable[[Callable[..., None]], Any]) -> list[bool]:
    """Free the object `make(callback)` builds: for each time its `callback` was freed with it,
    whether the object was still among the collector's objects then (a `__del__` there may run
    the collector, which would free a tracked object a second time)."""
    seen: list[bool] = []
    freed = [0]

    class Watcher:
        def __call__(self, *args: Any) -> None:
            return None

        def __del__(self) -> None:
            seen.append(any(id(o) == freed[0] for o in gc.get_objects()))

    made = make(Watcher())
    freed[0] = id(made)
    del made
    return seen


def memory_kept_by(make: Callable[[], Any], count: int = 2000) -> int:
    """Bytes still traced after `count` objects `make()` builds are made and dropped."""
    tracemalloc.start()
    try:
        for _ in range(4):
            make()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(count):
            make()
        return int(tracemalloc.get_traced_memory()[0] - start)
    finally:
        tracemalloc.stop()
