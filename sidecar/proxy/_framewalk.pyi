"""Type stub of the C frame walker (`_framewalk.c`)."""

def walk(sink: object, data: bytes, start: int) -> int:
    """Handle the whole fast-path frames of `data` from `start`; returns where it stopped."""
