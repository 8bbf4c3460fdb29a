"""Graceful drain of one relayed connection, as HTTP/2 defines it (RFC 9113 section 6.8).

The relay is the HTTP/2 server its clients see, so at shutdown it is the one that sends GOAWAY.
It does the two-step GOAWAY that gRPC servers do:

1. `GOAWAY(last-stream-id 2^31-1, NO_ERROR)` + `PING(DRAIN_PING)` to the client. The client
   stops opening streams; every stream it has opened is still forwarded.
2. When the client's PING ACK comes back (or after `PING_TIMEOUT_S`), every stream the client
   opened before it read the first GOAWAY has reached the relay (the ACK follows them on the
   same TCP connection): the final `GOAWAY(last forwarded client stream id)` is sent and the
   client→backend direction goes through a `RefusingFilter`.

Why two steps: a single GOAWAY with the last forwarded id races with the streams the client
opens while it is in flight; they would all be refused. gRPC clients retry refused streams
transparently, but every retry costs a round trip to another server and clients of other
HTTP/2 stacks may not retry at all. After the second step a compliant client opens no stream.

A stream that still opens above the final last-stream-id (a client that ignores GOAWAY) is
refused: RST_STREAM REFUSED_STREAM to the client, and *none* of its frames reach the backend,
so the backend never starts it (REFUSED_STREAM promises the client it was not processed).
Its header block is still HPACK-decoded by the relay (the client→relay table stays in step),
but the backend's decoder never sees it: from then on the client's encoder may refer to
entries the backend lacks. Forwarding the block and resetting the stream would keep the
backend's table in step but could let the backend start the request, so the relay does not.
The only header block that can still go to the backend after the final GOAWAY is the trailers
of an accepted stream, which gRPC clients never send; one that comes anyway while the tables
are out of step cannot be forwarded faithfully, so that stream is reset on both sides (CANCEL).

All frames the relay writes into the client-bound byte stream land between two whole frames
of the backend's (`FrameScanner.next_boundary`), never inside a frame or a header block.
At the end of the grace period each call still in flight is cut with a `grpc-status`
UNAVAILABLE response (its header fields are literals without indexing, so the client's HPACK
table is untouched), and the connection is closed.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

from sidecar.proxy.frames import (
    CANCEL,
    HEADERS,
    header_frames,
    rst_stream_frame,
)
from sidecar.proxy.headers import encode_literal_without_indexing

DRAIN_PING = b"xspdrain"  # opaque data of the PING that follows the first GOAWAY
PING_TIMEOUT_S = 2.0  # no PING ACK this long after the first GOAWAY: send the final one anyway
CUT_MESSAGE = "xsp-sidecar: shutting down; the call did not finish within the grace period"
UNAVAILABLE = "14"


def cut_frames(
    stream_id: int, response_started: bool, max_frame_size: int, message: str = CUT_MESSAGE
) -> bytes:
    """End a call the relay gives up on with grpc-status UNAVAILABLE: trailers after the
    backend's response headers, else a trailers-only response."""
    fields: list[tuple[str, str]] = []
    if not response_started:
        fields += [(":status", "200"), ("content-type", "application/grpc")]
    fields += [("grpc-status", UNAVAILABLE), ("grpc-message", quote(message, safe=" ;,"))]
    block = encode_literal_without_indexing(fields)
    return header_frames(stream_id, block, end_stream=True, max_frame_size=max_frame_size)


class RefusingFilter:
    """Client→backend bytes after the final GOAWAY: drops every frame of a client stream above
    `last_stream_id`; see the module doc for the trailers of an accepted stream once a refused
    header block has put the backend's HPACK table out of step. Must start at a frame boundary
    outside a header block; it never holds back more than an incomplete 9-byte frame header.
    """

    def __init__(self, last_stream_id: int, on_reset: Callable[[int], None]) -> None:
        self.last_stream_id = last_stream_id
        self.on_reset = on_reset  # an accepted stream reset on both sides (CANCEL)
        self.stale = False  # a refused header block was dropped: the backend's table lags
        self.reset: set[int] = set()
        self._carry = b""
        self._remaining = 0
        self._drop = False

    def process(self, data: bytes) -> bytes:
        """The part of `data` to forward to the backend (frames dropped, resets added)."""
        if self._carry:
            data = self._carry + data
            self._carry = b""
        out = bytearray()
        n = len(data)
        pos = 0
        while pos < n:
            if self._remaining:
                take = min(self._remaining, n - pos)
                if not self._drop:
                    out += data[pos : pos + take]
                pos += take
                self._remaining -= take
                continue
            if n - pos < 9:
                self._carry = data[pos:]
                break
            length = int.from_bytes(data[pos : pos + 3], "big")
            ftype = data[pos + 3]
            sid = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            drop = False
            if sid & 1 and sid > self.last_stream_id:
                drop = True  # a refused stream: nothing of it reaches the backend
                if ftype == HEADERS:
                    self.stale = True
            elif sid in self.reset:
                drop = True
            elif self.stale and sid & 1 and ftype == HEADERS:
                drop = True
                self.reset.add(sid)
                out += rst_stream_frame(sid, CANCEL)
                self.on_reset(sid)
            if not drop:
                out += data[pos : pos + 9]
            self._drop = drop
            self._remaining = length
            pos += 9
        return bytes(out)
