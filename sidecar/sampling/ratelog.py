"""A log line at most once per interval per key, with a count of the ones held back.

A failure that repeats on every sample (a full disk, a broken model) must not turn the log
into its own outage: the first occurrence is logged, later ones within `interval_s` are only
counted, and the next line says how many were suppressed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """`log(key, level, msg, *args)` logs at most once per `interval_s` for each `key`."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 64,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, key: str, level: int, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log now or count it as suppressed; True if it was logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            if last is None and len(self._last) >= self._max_keys:
                self._last.clear()  # bounded: forget old keys rather than grow
                self._suppressed.clear()
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += " (%d more like this suppressed since the last report)"
            args = (*args, suppressed)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
