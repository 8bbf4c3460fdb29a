"""Type stub of the C frame walker (`_framewalk.c`)."""

from collections.abc import Mapping

def walk(
    sink: object,
    data: bytes,
    start: int,
    hold: object = None,
    streams: Mapping[int, object] | None = None,
    request: bool = False,
    header_cache: Mapping[bytes, object] | None = None,
) -> int:
    """Handle the whole fast-path frames of `data` from `start`; returns where it stopped.

    `hold`: the FrameScanner in hold mode (its `_emit_injected` re-emits a HEADERS frame the
    sink appended HPACK bytes to), or None in observe mode. `streams`: the sink's stream table
    (a dict), whose `Stream` records the walk updates itself on DATA frames; `request`: the
    direction (client -> backend). `header_cache`: the backend direction's
    `HeaderDecoder.cache`, whose blocks' headers the walk may handle itself."""

def extract_model_name(head: bytes | bytearray, path: tuple[int, ...], need_more: object) -> object:
    """`model_name.extract_model_name`, returning `need_more` where that returns NEED_MORE."""

class Stream:
    """One open stream's record (`streams._PyStream`), updated in place by `walk`."""

    sid: int
    path: bytes
    method: str
    model_field: tuple[int, ...] | None
    start: float
    timeout: bytes | None
    model: str | None
    head: bytearray | None
    body: bytearray | None
    capture_limit: int
    start_ns: int
    request_end: float
    response_start: float
    request_bytes: int
    response_bytes: int
    http_status: bytes
    grpc_status: bytes | None
    grpc_message: bytes
    sampled: bool
    inferences: object
    path_text: str
    def __init__(
        self,
        sid: int,
        path: bytes,
        method: str,
        model_field: tuple[int, ...] | None,
        start: float,
        timeout: bytes | None = None,
    ) -> None: ...
