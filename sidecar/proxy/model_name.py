"""Which gRPC methods carry a model name, and reading it from a message's first bytes.

The methods and their model name fields are the configured backend's table
(`Backend.by_path`: its record lists its methods); a method not in it is labelled by its short
name and names no model.

No protobuf parse: the model name is (nearly always) the first field of the request, so the
relay keeps only the first few hundred bytes of a request's first message and walks the wire
format down a field path, e.g. `ModelInferRequest.model_name` = (1,) and TF-Serving's
`PredictRequest.model_spec.name` = (1, 1).
"""

from __future__ import annotations

from collections.abc import Mapping

from sidecar.backends import MethodInfo

UNKNOWN_MODEL = "_unknown"
HEAD_LIMIT = 5 + 1024  # gRPC prefix + protobuf bytes we are willing to hold per request


def method_info(path: bytes, by_path: Mapping[bytes, MethodInfo]) -> MethodInfo:
    """Method info for a `:path` in the backend's table `by_path`; other methods get their
    short name and no model field."""
    info = by_path.get(path)
    if info is not None:
        return info
    short = path.rsplit(b"/", 1)[-1].decode("utf-8", "replace") or "_unknown"
    return MethodInfo(short, None)


NEED_MORE = object()  # sentinel: the bytes so far do not decide the answer


def read_varint(buf: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    """Decode a varint at `pos`; returns (value, new_pos) or (-1, pos) when truncated."""
    value = 0
    shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
    return -1, pos


def _find(
    buf: bytes | bytearray, pos: int, end: int, complete: bool, path: tuple[int, ...]
) -> object:
    """Walk `path` through the message bytes buf[pos:end]; `complete` if end is its real end."""
    target = path[0]
    while pos < end:
        tag, pos = read_varint(buf, pos, end)
        if tag < 0:
            return NEED_MORE
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = read_varint(buf, pos, end)
            if value < 0:
                return NEED_MORE
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = read_varint(buf, pos, end)
            if size < 0:
                return NEED_MORE
            if field == target:
                stop = pos + size
                if len(path) == 1:
                    if stop > end:
                        return NEED_MORE
                    return bytes(buf[pos:stop]).decode("utf-8", "replace")
                return _find(buf, pos, min(stop, end), stop <= end, path[1:])
            pos += size
        else:
            return None  # groups: not in any message we read
    if pos > end or not complete:
        return NEED_MORE
    return None  # field absent


def extract_model_name(head: bytes | bytearray, path: tuple[int, ...]) -> object:
    """Model name from the first bytes of a gRPC request body.

    `head` starts with the 5-byte gRPC message prefix. Returns the name (str), None when the
    message has no such field or is compressed, or `NEED_MORE` when more bytes are needed.
    """
    if len(head) < 5:
        return NEED_MORE
    if head[0] & 1:
        return None  # compressed message: the name is not readable without inflating it
    size = int.from_bytes(head[1:5], "big")
    end = 5 + size
    available = min(end, len(head))
    try:
        return _find(head, 5, available, available == end, path)
    except ValueError:
        return None
