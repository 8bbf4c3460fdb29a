"""Type stub of the relay's C `data_received` (`_pump.c`)."""

from collections.abc import Callable

NAMES: tuple[str, ...]  # every Python attribute the C code reads or calls (native.py)

class Pump:
    """One relayed direction's `data_received`: the chunk walked in C and written to the other
    side; `fallback` (the protocol's Python `data_received`) takes every chunk while not armed."""

    armed: bool
    @property
    def hold(self) -> bool: ...
    def __init__(self, fallback: Callable[[bytes], None], lost: Callable[[], None]) -> None: ...
    def __call__(self, data: bytes) -> None: ...
    def route(self, transport: object, scanner: object, walk: object) -> None:
        """The other side's transport, this direction's `FrameScanner`, `_framewalk.walk`."""
    def release(self) -> None:
        """Disarm and drop every reference (the connection is gone)."""
