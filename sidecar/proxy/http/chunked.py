"""Where a chunked body ends in the byte stream, and its de-chunked payload.

llhttp (httptools) validates every byte of a message but does not say at which offset of a
chunk it fed a message ended; the relay needs that offset to find the next message's header
block in the same chunk (to hold, check and extend it). `ChunkedFramer` walks just the chunk
framing (size line, data, CRLF; the last chunk's trailer lines) to find it. It is lenient:
the same bytes go through llhttp, whose verdict (an error, or a message end elsewhere) wins.
"""

from __future__ import annotations

SIZE, DATA, DATA_END, TRAILER = range(4)
MAX_LINE = 16 << 10  # a chunk-size line or a trailer line longer than this is malformed


class FramingError(ValueError):
    """The chunk framing cannot be followed (a bad size line, a line too long)."""


class ChunkedFramer:
    """Follows one chunked body; `advance` consumes bytes until the body's end (`done`)."""

    __slots__ = ("done", "left", "line", "parts", "size", "state", "trailer_bytes")

    def __init__(self, capture: bool = False) -> None:
        self.state = SIZE
        self.left = 0  # bytes left of the current chunk's data (or of its CRLF)
        self.line = b""  # a size or trailer line cut by the end of a chunk
        self.size = 0  # payload bytes so far
        self.trailer_bytes = 0
        self.done = False
        self.parts: list[bytes] | None = [] if capture else None  # the payload, when captured

    def advance(self, data: bytes, pos: int) -> int:
        """Consume `data[pos:]` up to the body's end; returns the offset reached."""
        end = len(data)
        while pos < end:
            state = self.state
            if state == DATA:
                take = min(self.left, end - pos)
                if self.parts is not None:
                    self.parts.append(data[pos : pos + take])
                self.left -= take
                pos += take
                if not self.left:
                    self.state = DATA_END
                    self.left = 2
            elif state == DATA_END:
                take = min(self.left, end - pos)
                self.left -= take
                pos += take
                if not self.left:
                    self.state = SIZE
            else:
                nl = data.find(b"\n", pos)
                if nl < 0:
                    self.line += data[pos:]
                    if len(self.line) > MAX_LINE:
                        raise FramingError("chunk line too long")
                    return end
                line = self.line + data[pos:nl] if self.line else data[pos:nl]
                self.line = b""
                pos = nl + 1
                if len(line) > MAX_LINE:
                    raise FramingError("chunk line too long")
                if state == TRAILER:
                    self.trailer_bytes += len(line) + 1
                    if self.trailer_bytes > MAX_LINE:
                        raise FramingError("chunk trailers too long")
                    if not line.rstrip(b"\r"):
                        self.done = True
                        return pos
                    continue
                size_text = line.split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise FramingError("bad chunk size") from None
                if size < 0:
                    raise FramingError("bad chunk size")
                if size:
                    self.size += size
                    self.left = size
                    self.state = DATA
                else:
                    self.state = TRAILER
        return pos

    def payload(self) -> bytes:
        """The captured payload (de-chunked)."""
        return b"".join(self.parts or ())
