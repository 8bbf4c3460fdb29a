"""The last sampled request message per model: what an admin profile without inputs replays."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

LAST_REQUESTS_MAX_BYTES = 64 << 20
LAST_REQUEST_MAX_MESSAGE_BYTES = 16 << 20


class LastRequests:
    """The last sampled request message per known model, within a byte budget.

    Only models `known` accepts are kept (those of the model repository), so a client cannot
    fill memory by sending made-up model names; a message over `max_message_bytes` is not
    kept, and the least recently stored are evicted to stay within `max_total_bytes`.
    """

    def __init__(
        self,
        known: Callable[[str], bool] = lambda model: True,
        *,
        max_total_bytes: int = LAST_REQUESTS_MAX_BYTES,
        max_message_bytes: int = LAST_REQUEST_MAX_MESSAGE_BYTES,
    ) -> None:
        self._known = known
        self.max_total_bytes = max_total_bytes
        self.max_message_bytes = min(max_message_bytes, max_total_bytes)
        self._lock = threading.Lock()
        self._messages: collections.OrderedDict[str, tuple[str, bytes]] = collections.OrderedDict()
        self.total_bytes = 0

    def remember(self, model: str, method: str, message: bytes) -> bool:
        """Keep `message` as the model's last request; False if it is not kept."""
        if len(message) > self.max_message_bytes or not self._known(model):
            return False
        with self._lock:
            old = self._messages.pop(model, None)
            if old is not None:
                self.total_bytes -= len(old[1])
            while self._messages and self.total_bytes + len(message) > self.max_total_bytes:
                _, (_, evicted) = self._messages.popitem(last=False)
                self.total_bytes -= len(evicted)
            self._messages[model] = (method, message)
            self.total_bytes += len(message)
        return True

    def get(self, model: str) -> tuple[str, bytes] | None:
        with self._lock:
            return self._messages.get(model)

    def __len__(self) -> int:
        return len(self._messages)
