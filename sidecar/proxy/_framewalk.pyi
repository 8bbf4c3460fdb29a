"""Type stub of the C frame walker (`_framewalk.c`)."""

def walk(sink: object, data: bytes, start: int, hold: object = None) -> int:
    """Handle the whole fast-path frames of `data` from `start`; returns where it stopped.

    `hold`: the FrameScanner in hold mode (its `_emit_injected` re-emits a HEADERS frame the
    sink appended HPACK bytes to), or None in observe mode."""
