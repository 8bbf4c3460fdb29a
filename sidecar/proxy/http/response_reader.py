"""The backend's byte stream cut into responses, after it was written to the client.

Each response's header block is parsed by llhttp (httptools): its status, and how its body is
framed. A 1xx is an interim response (`100 Continue` answers `Expect: 100-continue`), not the
final one; the final response of the call at the head of the FIFO ends that call when its
body ends (a Content-Length countdown, `chunked.py`, or the backend's FIN). A response to HEAD,
and a 204 or 304, has no body (but see `_header_block` for Triton's answer to HEAD). An error
response's body start is kept (bounded) for its `{"error": ...}` text.

A response that cannot be parsed, or comes with no request open, raises `BrokenResponse`: the
relay stops observing that connection and keeps forwarding its bytes (counted in
`xsp_observation_failures_total{reason="http_response"}`). A `101 Switching Protocols` turns
the connection into a tunnel (`tunnel`): bytes flow unobserved both ways from then on.
"""

from __future__ import annotations

import time
from time import perf_counter

from httptools import HttpParserError, HttpResponseParser

from sidecar.proxy.http.calls import Call, CallBook
from sidecar.proxy.http.chunked import ChunkedFramer, FramingError
from sidecar.proxy.http.fields import field_value

MAX_HEAD = 1 << 20  # a response header block longer than this is broken
KEEP_ERROR = 4096  # bytes of an error response's body kept for its error text


class BrokenResponse(Exception):
    """The backend's bytes are not HTTP/1.1 responses to the requests sent."""


class ResponseReader:
    """Follows one connection's responses (see the module docstring)."""

    __slots__ = (
        "body_left", "book", "call", "chunked", "head", "headers_done", "message_done", "parser",
        "tunnel", "until_close",
    )  # fmt: skip

    def __init__(self, book: CallBook) -> None:
        self.book = book
        self.parser = HttpResponseParser(self)
        self.head = b""  # a header block begun and not complete (already fed to llhttp)
        self.body_left = 0
        self.chunked: ChunkedFramer | None = None
        self.until_close = False  # a body that ends with the backend's FIN
        self.call: Call | None = None  # the call whose response body is being read
        self.tunnel = False  # 101 Switching Protocols: nothing more is HTTP/1.1
        self.headers_done = False
        self.message_done = False

    # -- llhttp callbacks -----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_message_complete(self) -> None:
        self.message_done = True

    # -- the byte stream ------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Read one chunk the client was already sent (BrokenResponse: see module doc)."""
        # The common case: a chunk that is one whole `200` response with a Content-Length
        # body, to the head call (not HEAD), read in one llhttp call and one pass here.
        if (
            data[9:13] == b"200 "
            and not self.head
            and self.call is None
            and not self.tunnel
            and (opened := self.book.open)
        ):
            idx = data.find(b"\r\n\r\n")
            block = data[: idx + 4]
            lowered = block.lower()
            at = lowered.find(b"\ncontent-length:") + 16
            if at > 15 and idx > 0 and b"\ntransfer-encoding:" not in lowered:
                try:
                    length = int(block[at : block.find(b"\r\n", at)])
                except ValueError:
                    length = -1
                call = opened[0]
                if idx + 4 + length == len(data) and not call.head:
                    self.message_done = self.headers_done = False
                    try:
                        self.parser.feed_data(data)
                    except HttpParserError as exc:
                        raise BrokenResponse(str(exc)) from exc
                    if not self.message_done:
                        raise BrokenResponse("response framing disagrees with llhttp")
                    self.message_done = self.headers_done = False
                    call.status = 200
                    if not call.response_start:
                        call.response_start = perf_counter()
                    call.response_bytes += length
                    self.book.end(call, "OK")
                    return
        try:
            self._feed(data)
        except (HttpParserError, FramingError, ValueError) as exc:
            raise BrokenResponse(str(exc)) from exc

    def _feed(self, data: bytes) -> None:
        head = self.head
        fed = len(head)
        if fed:
            data = head + data
            self.head = b""
        pos = 0
        end = len(data)
        view = memoryview(data)
        while pos < end and not self.tunnel:
            call = self.call
            if self.body_left:
                assert call is not None
                take = min(self.body_left, end - pos)
                body = view[pos : pos + take]
                self.parser.feed_data(body)
                self._body(call, body, take)
                pos += take
                self.body_left -= take
                if not self.body_left:
                    self._done(call)
            elif self.chunked is not None:
                assert call is not None
                framer = self.chunked
                size = framer.size
                to = framer.advance(data, pos)
                self.parser.feed_data(view[pos:to])
                self._body(call, view[pos:to], framer.size - size)
                pos = to
                if framer.done:
                    self._done(call)
            elif self.until_close:
                assert call is not None
                self.parser.feed_data(view[pos:])
                self._body(call, view[pos:], end - pos)
                pos = end
            else:
                pos = self._header_block(data, view, pos, fed)
                fed = 0

    def _body(self, call: Call, chunk: memoryview, payload: int) -> None:
        call.response_bytes += payload
        error = call.error
        if error is not None and len(error) < KEEP_ERROR:
            error += chunk[: KEEP_ERROR - len(error)]

    def _header_block(self, data: bytes, view: memoryview, pos: int, fed: int) -> int:
        if not fed:
            self.headers_done = self.message_done = False
        idx = data.find(b"\r\n\r\n", max(pos, pos + fed - 3))
        if idx < 0:
            if len(data) - pos > MAX_HEAD:
                raise BrokenResponse("response header block too large")
            self.parser.feed_data(view[pos + fed :])
            self.head = data[pos:]
            return len(data)
        to = idx + 4
        self.parser.feed_data(view[pos + fed : to])
        if not self.headers_done:
            raise BrokenResponse("no response header block")
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                self.tunnel = True
            return to  # interim: the final response is still to come
        block = data[pos:to]
        lowered = block.lower()
        length = field_value(lowered, block, b"\ncontent-length:")
        te = field_value(lowered, block, b"\ntransfer-encoding:")
        content_length = None if length is None else int(length)
        opened = self.book.open
        if not opened:
            raise BrokenResponse(f"a {status} response with no request open")
        call = self.call = opened[0]
        call.status = status
        if not call.response_start:
            call.response_start = time.perf_counter()
        if status >= 400:
            call.error = bytearray()
        if call.head and content_length and to < len(data) and data[to : to + 5] != b"HTTP/":
            # a body after a response to HEAD, in the same read: Triton's evhtp sends one with
            # its 405 (HEAD is not served); take it as the Content-Length says
            self.body_left = content_length
        elif call.head or status == 204 or status == 304:
            if call.head and content_length:
                self.parser = HttpResponseParser(self)  # llhttp would wait for the body
            self._done(call, checked=False)
        elif te is not None:
            if te.lower().endswith(b"chunked"):
                self.chunked = ChunkedFramer()
            else:
                self.until_close = True
        elif content_length is not None:
            if content_length:
                self.body_left = content_length
            else:
                self._done(call)
        else:
            self.until_close = True
        return to

    def _done(self, call: Call, checked: bool = True) -> None:
        if checked and not self.message_done:
            raise BrokenResponse("response framing disagrees with llhttp")
        self.message_done = self.headers_done = False
        self.call = None
        self.chunked = None
        self.book.response_done(call)

    def eof(self) -> None:
        """The backend sent FIN: a body read until close has ended."""
        call = self.call
        if self.until_close and call is not None:
            self.until_close = False
            self.call = None
            self.book.response_done(call)
