"""The HTTP relay's bounds on what a client may send (`HttpLimits`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds of one request; a request past one is refused (`refusals.py`).

    `header_bytes`: a request's header block (request line to blank line) longer than this is
    answered 431. `body_bytes`: a body longer than this is answered 413 (at its headers where
    Content-Length says so, else when the chunks pass it). `header_timeout_s`: a header block
    begun and not complete this long after its first byte (a slowloris trickle) is answered
    408. `idle_timeout_s`: a keep-alive connection with no request in flight and no byte
    either way this long is closed (None: never).
    """

    header_bytes: int = 64 << 10
    body_bytes: int = 256 << 20
    header_timeout_s: float = 10.0
    idle_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        if self.header_bytes < 64 or self.body_bytes < 0:
            raise ValueError("header_bytes must be at least 64 and body_bytes not negative")
        if not self.header_timeout_s > 0:
            raise ValueError("header_timeout_s must be a positive number of seconds")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError("idle_timeout_s must be a positive number of seconds or None")
