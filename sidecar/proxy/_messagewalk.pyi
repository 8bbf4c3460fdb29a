"""Type stub of the C message walker (`_messagewalk.c`)."""

from collections.abc import Callable

MESSAGE_HEAD: int
NAMES: tuple[str, ...]  # every Python attribute the C code reads or calls (native.py)

class RequestWalker:
    """The request messages of one inference stream (`stream_messages.RequestReader`)."""

    pick: Callable[[int], tuple[object, bool] | None] | None
    capture_limit: int
    @property
    def mid_message(self) -> bool: ...
    @property
    def copying(self) -> bool: ...
    def read(
        self, chunk: bytes
    ) -> list[tuple[int, object, bytes | None, str | None, str, bool]]: ...

class ResponseWalker:
    """The response messages of one inference stream (`stream_messages.ResponseReader`)."""

    pick: Callable[[int], tuple[object, bool] | None] | None
    capture_limit: int
    @property
    def mid_message(self) -> bool: ...
    @property
    def copying(self) -> bool: ...
    def read(self, chunk: bytes) -> list[tuple[int, str, str | None, str, bool | None, bool]]: ...
