"""Freed memory handed back to the operating system.

glibc's allocator keeps the pages of freed small and mid-sized blocks (the pieces of a frame
being joined, an analysis's temporaries) in its heap, where a later large array, which it maps
afresh, cannot use them: the process's resident memory then grows by what it has already
let go. `trim()` asks glibc to return the free pages (`malloc_trim`); elsewhere (another C
library) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None
    return trim


def trim() -> None:
    """Return the heap's free pages to the operating system, where glibc can."""
    if (malloc_trim := _malloc_trim()) is not None:
        malloc_trim(0)
