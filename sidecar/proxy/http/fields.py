"""Fields read from a header block llhttp (httptools) has accepted.

llhttp checks each block (one line a field, CRLF line ends, no folding, one Content-Length,
none with Transfer-Encoding, a Transfer-Encoding ending in chunked) and calls back once per
field; the relay parses the block with no field callbacks and reads the few fields it needs
from the accepted bytes in C-speed `bytes` operations instead (a Python call per field was the
larger part of a request's parsing cost).
"""

from __future__ import annotations


def field_value(lowered: bytes, block: bytes, name: bytes) -> bytes | None:
    """The value of header field `name` (lowercase, with its colon: b"\ncontent-length:") of a
    header block llhttp accepted (one line a field, no folding), or None where absent."""
    at = lowered.find(name)
    if at < 0:
        return None
    start = at + len(name)
    return block[start : block.find(b"\r\n", start)].strip()


def framing(block: bytes) -> tuple[bytes, int | None, bool]:
    """A request header block's target, Content-Length and whether it is chunked, read from
    the bytes llhttp accepted (it refused two Content-Lengths, one with Transfer-Encoding, a
    Transfer-Encoding not ending in chunked, folded lines)."""
    line = block.lstrip(b"\r\n")
    target = line[: line.find(b"\r\n")].split()[1]
    lowered = block.lower()
    length = field_value(lowered, block, b"\ncontent-length:")
    chunked = length is None and b"\ntransfer-encoding:" in lowered
    return target, None if length is None else int(length), chunked


def header_fields(block: bytes) -> list[tuple[bytes, bytes]]:
    """The (lowercased name, value) fields of a header block llhttp accepted, in order."""
    lines = block.lstrip(b"\r\n").split(b"\r\n")[1:]
    return [
        (name.lower(), value.strip()) for name, _, value in (x.partition(b":") for x in lines if x)
    ]
