"""Type stub of the HTTP relay's C client `data_received` (`_httppump.c`)."""

from collections.abc import Callable
from typing import Any

NAMES: tuple[str, ...]  # every Python attribute the C code reads, writes or calls (native.py)

class Pump:
    """The HTTP relay's client `data_received`: whole requests forwarded and booked in C;
    `fallback` (the protocol's Python `data_received`) takes every other chunk."""

    armed: bool
    @property
    def chunks(self) -> int:
        """Chunks taken by the C path (the idle sweep's activity)."""
    @property
    def owns(self) -> bool:
        """Whether the reader's call had its header block read here (its body to come)."""
    def __init__(
        self,
        fallback: Callable[[bytes], None],
        lost: Callable[[], None],
        failed: Callable[[BaseException, bool], None],
    ) -> None:
        """`failed(exc, booked)`: an error met reading or booking; forwarding goes on."""
    def __call__(self, data: bytes) -> None: ...
    def route(self, transport: object, reader: object, cache: dict[bytes, Any], call: type) -> None:
        """The backend transport, the `RequestReader`, the relay's route cache, `Call`."""
    def release(self) -> None:
        """Disarm and drop every reference (the connection is gone)."""
