"""Type stub of the C frame walker (`_framewalk.c`)."""

from collections.abc import Mapping

NAMES: tuple[str, ...]  # every Python attribute the C code reads or calls (native.py)

def walk(
    sink: object,
    data: bytes,
    start: int,
    hold: object = None,
    streams: Mapping[int, object] | None = None,
    request: bool = False,
    header_cache: Mapping[bytes, object] | None = None,
    tracker: object = None,
) -> int:
    """Handle the whole fast-path frames of `data` from `start`; returns where it stopped.

    `hold`: the FrameScanner in hold mode (its `emit_injected` re-emits a HEADERS frame the
    sink appended HPACK bytes to), or None in observe mode. `streams`: the sink's stream table
    (a dict), whose `Stream` records the walk updates itself on DATA frames; `request`: the
    direction (client -> backend). `header_cache`: the direction's `HeaderDecoder.cache`,
    whose blocks' headers the walk may handle itself (a request's only with `tracker`).
    `tracker`: the sink's `ConnectionTracker`: the walk starts a new request whose block is
    cached where there is no observer, or where the observer's `QuickDecisions` let the walk
    answer it (an unpicked request, a method never replayed: a `QuietEnd`), and ends a call
    whose cached trailers need nothing from Python (no observer, or a `QuietEnd`), counting
    it in its metrics."""

def configure(
    status_names: dict[bytes, str], unknown_model: str, buckets: tuple[float, ...]
) -> None:
    """The constants `walk` counts a call's end with: grpc-status values and their code
    names, the `model` label of a call with no model name, the duration buckets' bounds."""

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
