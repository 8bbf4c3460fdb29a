"""Build real HTTP/2 byte streams (frames + HPACK from the `hpack` library) for scanner tests."""

from __future__ import annotations

from hpack import Encoder

from sidecar.proxy.frames import (
    CONTINUATION,
    DATA,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    GOAWAY,
    HEADERS,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame_header,
)


def frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return frame_header(len(payload), ftype, flags, sid) + payload


def settings(pairs: list[tuple[int, int]] | None = None, ack: bool = False) -> bytes:
    payload = b"".join(i.to_bytes(2, "big") + v.to_bytes(4, "big") for i, v in pairs or [])
    return frame(SETTINGS, FLAG_ACK if ack else 0, 0, payload)


def window_update(sid: int, inc: int = 65535) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, inc.to_bytes(4, "big"))


def grpc_message(body: bytes, compressed: bool = False) -> bytes:
    return bytes([1 if compressed else 0]) + len(body).to_bytes(4, "big") + body


def headers_frames(
    block: bytes,
    sid: int,
    *,
    end_stream: bool = False,
    pad: int = 0,
    priority: bool = False,
    split: int = 0,
) -> bytes:
    """A header block as HEADERS (+ CONTINUATION frames of `split` bytes each when split > 0)."""
    parts = [block] if split <= 0 else [block[i : i + split] for i in range(0, len(block), split)]
    parts = parts or [b""]
    flags = FLAG_END_STREAM if end_stream else 0
    first = parts[0]
    prefix = b""
    if priority:
        flags |= FLAG_PRIORITY
        prefix = (3).to_bytes(4, "big") + bytes([15])
    if pad:
        flags |= FLAG_PADDED
        payload = bytes([pad]) + prefix + first + b"\0" * pad
    else:
        payload = prefix + first
    if len(parts) == 1:
        flags |= FLAG_END_HEADERS
    out = frame(HEADERS, flags, sid, payload)
    for i, part in enumerate(parts[1:], start=1):
        out += frame(CONTINUATION, FLAG_END_HEADERS if i == len(parts) - 1 else 0, sid, part)
    return out


def data_frames(
    payload: bytes, sid: int, *, end_stream: bool = False, pad: int = 0, max_size: int = 16384
) -> bytes:
    chunks = [payload[i : i + max_size] for i in range(0, len(payload), max_size)] or [b""]
    out = b""
    for i, chunk in enumerate(chunks):
        flags = FLAG_END_STREAM if end_stream and i == len(chunks) - 1 else 0
        if pad:
            out += frame(DATA, flags | FLAG_PADDED, sid, bytes([pad]) + chunk + b"\0" * pad)
        else:
            out += frame(DATA, flags, sid, chunk)
    return out


def rst_stream(sid: int, code: int = 8) -> bytes:
    return frame(RST_STREAM, 0, sid, code.to_bytes(4, "big"))


def goaway(last_sid: int, code: int = 0) -> bytes:
    return frame(GOAWAY, 0, 0, last_sid.to_bytes(4, "big") + code.to_bytes(4, "big"))


def request_headers(path: str, extra: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *(extra or []),
    ]


class Conversation:
    """Both directions of one HTTP/2 connection, encoded with two real HPACK encoders."""

    def __init__(self) -> None:
        self.client_encoder = Encoder()
        self.server_encoder = Encoder()
        self.client = bytearray(PREFACE + settings([(4, 65535)]))
        self.server = bytearray(settings([(1, 4096), (5, 16384)]) + settings(ack=True))
        self.client += settings(ack=True)

    def request(
        self,
        sid: int,
        path: str,
        body: bytes | None,
        *,
        metadata: list[tuple[str, str]] | None = None,
        pad: int = 0,
        priority: bool = False,
        split: int = 0,
        data_pad: int = 0,
    ) -> None:
        block = self.client_encoder.encode(request_headers(path, metadata))
        self.client += headers_frames(
            block, sid, end_stream=body is None, pad=pad, priority=priority, split=split
        )
        if body is not None:
            self.client += data_frames(grpc_message(body), sid, end_stream=True, pad=data_pad)

    def response(self, sid: int, body: bytes | None, status: int = 0, message: str = "") -> None:
        trailers = [("grpc-status", str(status))] + ([("grpc-message", message)] if message else [])
        if body is None:  # trailers-only
            block = self.server_encoder.encode(
                [(":status", "200"), ("content-type", "application/grpc"), *trailers]
            )
            self.server += headers_frames(block, sid, end_stream=True)
            return
        block = self.server_encoder.encode(
            [(":status", "200"), ("content-type", "application/grpc")]
        )
        self.server += headers_frames(block, sid)
        self.server += data_frames(grpc_message(body), sid)
        self.server += headers_frames(self.server_encoder.encode(trailers), sid, end_stream=True)
