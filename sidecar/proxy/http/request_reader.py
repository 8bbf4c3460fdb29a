"""The client's byte stream cut into requests: header blocks held and checked, bodies followed.

A request's header block is held until complete (bounded by `HttpLimits.header_bytes`), parsed
by llhttp (httptools) and only then forwarded, with the observer's extra header lines added
before its blank line; so a malformed or ambiguous block (Content-Length with Transfer-
Encoding, differing Content-Lengths: request smuggling) is refused and never reaches the
backend. Body bytes are forwarded as they come (a Content-Length countdown, or `chunked.py`
for a chunked body), parsed by llhttp on the way (it consumes a Content-Length body without
a callback), and copied only when the observer captures the body. Each chunk's bytes go out in
one write where nothing was added (`feed` returns None).

A refusal (`Refused`) stops the stream: what came before it is still forwarded, nothing after.
A request that says `Connection: close` (or HTTP/1.0 without keep-alive) is the last one:
bytes after it are dropped, as the backend would drop them.
"""

from __future__ import annotations

import time
from time import perf_counter

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser

from sidecar.proxy.http import refusals
from sidecar.proxy.http.calls import Call, CallBook
from sidecar.proxy.http.chunked import ChunkedFramer, FramingError
from sidecar.proxy.http.fields import framing
from sidecar.proxy.http.limits import HttpLimits
from sidecar.proxy.http.routes import HttpRoutes

Piece = bytes | memoryview
_CRLF = b"\r\n"


class Refused(Exception):
    """A request the relay answers itself (`refusals.REASONS`), then closes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _parser_refusal(exc: HttpParserError) -> Refused:
    text = str(exc)
    if "Content-Length" in text or "Transfer-Encoding" in text:
        return Refused(refusals.SMUGGLING, f"ambiguous request framing: {text}")
    return Refused(refusals.MALFORMED, f"malformed request: {text}")


class RequestReader:
    """Splits one connection's client bytes into requests (see the module docstring)."""

    __slots__ = (
        "body_left", "book", "call", "chunked", "closing", "head", "head_since", "headers_done",
        "keep_alive", "limits", "message_done", "parser", "refused", "routes", "upgrade",
    )  # fmt: skip

    def __init__(self, limits: HttpLimits, book: CallBook, routes: HttpRoutes) -> None:
        self.limits = limits
        self.book = book
        self.routes = routes
        self.parser = HttpRequestParser(self)
        self.head = b""  # a header block begun and not complete (already fed to llhttp)
        self.head_since = 0.0  # time.monotonic() at that block's first byte
        self.body_left = 0  # Content-Length body bytes still to come
        self.chunked: ChunkedFramer | None = None  # a chunked body being followed
        self.call: Call | None = None  # the request whose body is being forwarded
        self.closing = False  # the last request was read: later bytes are dropped
        self.refused: Refused | None = None
        # the message being parsed (llhttp callbacks)
        self.headers_done = False
        self.keep_alive = True
        self.message_done = False
        self.upgrade = False

    # -- llhttp callbacks (two a request: the fields are read from the checked block) ------

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # read here: llhttp resets it once a message without a body is complete
        self.keep_alive = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        self.message_done = True

    # -- the byte stream ------------------------------------------------------------------

    def in_message(self) -> bool:
        """Whether a request is part-way read (its header block or its body)."""
        return bool(self.head) or self.call is not None

    def feed(self, data: bytes) -> list[Piece] | None:
        """Read one chunk; returns the pieces to forward (None: `data` whole). Sets `refused`
        when a request is refused: the pieces before it are still to be forwarded."""
        if self.call is not None:
            if self.body_left == len(data):  # the rest of a Content-Length body, whole
                return self._body_end(data)
            return self._feed(data)
        if self.head or self.refused is not None or self.closing:
            return self._feed(data)
        # The common cases: a chunk that is one whole request, its header block and exactly
        # the Content-Length body it declares (none: no body), or its header block alone
        # with that body to follow (http.client, requests: two sends); read in one llhttp
        # call and one pass here. The fields are read before llhttp checks the block only to
        # choose this path; every answer still comes from what llhttp accepts (or refuses).
        idx = data.find(b"\r\n\r\n")
        to = idx + 4
        if idx <= 0 or to > self.limits.header_bytes or data[0] in _CRLF:
            return self._feed(data)
        block = data[:to] if to < len(data) else data
        lowered = block.lower()
        if b"\ntransfer-encoding:" in lowered:
            return self._feed(data)
        at = lowered.find(b"\ncontent-length:")
        if at < 0:
            length = 0
        else:
            at += 16
            try:
                length = int(block[at : block.find(b"\r\n", at)])
            except ValueError:
                return self._feed(data)
        if (to + length != len(data) and to != len(data)) or length > self.limits.body_bytes:
            return self._feed(data)
        return self._whole(data, block, to, length)

    def _whole(self, data: bytes, block: bytes, to: int, length: int) -> list[Piece] | None:
        """`feed` of a chunk that is one whole request, or one whole header block whose
        Content-Length body follows (see there)."""
        self.headers_done = self.message_done = self.upgrade = False
        parser = self.parser
        try:
            try:
                parser.feed_data(data)
            except HttpParserUpgrade:
                # see `_header_block`: one without a body is relayed, one with a body refused
                if length:
                    raise Refused(refusals.UPGRADE, "an upgrade request with a body") from None
                self.message_done = True
        except Refused as exc:
            self.refused = exc
            return []
        except HttpParserError as exc:
            self.refused = _parser_refusal(exc)
            return []
        verb = parser.get_method()
        # llhttp checked the line: a method, a target and a version (or none: HTTP/0.9's
        # form), each after one space or more, no other whitespace; the target is llhttp's,
        # as `fields.framing` reads it on the general path (the fuzzer found the paths naming
        # different targets where they read it differently)
        target = block[: block.find(_CRLF)].split()[1]
        route = self.routes.http_route(verb, target)
        book = self.book
        call, extra = book.start(verb, target, route.method, route.model, block, length)
        if not self.keep_alive:
            self.closing = True
        if length and to == len(data):  # the body follows
            self.call = call
            self.body_left = length
            return [data[: to - 2], extra, data[to - 2 :]] if extra else None
        if not self.message_done:  # our framing and llhttp's disagree: trust neither
            self.call = call
            self.refused = Refused(refusals.MALFORMED, "malformed request framing")
            if not length:
                return []
            return [data[: to - 2], extra, data[to - 2 :]] if extra else [data]
        self.message_done = self.headers_done = False
        call.request_bytes = length
        if call.body is not None:
            book.request_done(call, data[to:])
        else:
            call.request_end = perf_counter()  # `book.request_done` of a body not captured
        if extra:
            return [data[: to - 2], extra, data[to - 2 :]]
        return None

    def adopt(self, block: bytes) -> None:
        """The C pump (`_httppump.c`) read `block`, a header block llhttp accepted whose
        Content-Length body follows (none of it read yet), and set `call` and `body_left`:
        this reader's parser reads the block too, so the body goes on here."""
        self.headers_done = self.message_done = self.upgrade = False
        self.parser.feed_data(block)

    def _body_end(self, data: bytes) -> list[Piece] | None:
        """`feed` of a chunk that is the rest of a Content-Length body, exactly."""
        call = self.call
        assert call is not None
        try:
            self.parser.feed_data(data)
        except HttpParserError as exc:
            self.refused = _parser_refusal(exc)
            return []
        self.body_left = 0
        call.request_bytes += len(data)
        captured = call.body
        if captured is not None:
            captured += data
        try:
            self._request_done(None if captured is None else bytes(captured))
        except Refused as exc:
            self.refused = exc
            return [data]
        return None

    def _feed(self, data: bytes) -> list[Piece] | None:
        """`feed`, any chunk."""
        if self.refused is not None or (self.closing and self.call is None):
            return []  # (a last request's body still goes on)
        head = self.head
        fed = len(head)
        whole = not fed
        if fed:
            data = head + data
            self.head = b""
        pieces: list[Piece] = []
        start = pos = 0  # data[start:pos] is forwarded unchanged
        end = len(data)
        view = memoryview(data)
        try:
            while pos < end:
                if self.body_left:
                    take = min(self.body_left, end - pos)
                    body = view[pos : pos + take]
                    self.parser.feed_data(body)
                    call = self.call
                    assert call is not None
                    call.request_bytes += take
                    if call.body is not None:
                        call.body += body
                    pos += take
                    self.body_left -= take
                    if not self.body_left:
                        self._request_done(None if call.body is None else bytes(call.body))
                elif self.chunked is not None:
                    framer = self.chunked
                    to = framer.advance(data, pos)
                    if framer.size > self.limits.body_bytes:  # (this piece is not forwarded)
                        raise Refused(refusals.BODY_TOO_LARGE, "request body too large")
                    self.parser.feed_data(view[pos:to])
                    pos = to
                    call = self.call
                    assert call is not None
                    call.request_bytes = framer.size
                    if framer.parts is not None and framer.size > call.capture_limit:
                        framer.parts = None  # past the capture limit: not delivered
                    if framer.done:
                        payload = framer.payload() if framer.parts is not None else None
                        self._request_done(payload)
                elif self.closing:
                    end = pos  # after the last request: dropped
                else:
                    to, extra = self._header_block(data, view, pos, fed)
                    fed = 0
                    if to < 0:  # held: not complete yet
                        end = pos
                        break
                    if extra:
                        pieces.append(view[start : to - 2])
                        pieces.append(extra)
                        start = to - 2
                    pos = to
        except Refused as exc:
            self.refused = exc
            end = pos
        except FramingError as exc:
            self.refused = Refused(refusals.MALFORMED, f"malformed chunked body: {exc}")
            end = pos
        except HttpParserError as exc:
            self.refused = _parser_refusal(exc)
            end = pos
        if whole and not pieces and start == 0 and end == len(data) and self.refused is None:
            return None
        if start < end:
            pieces.append(view[start:end])
        return pieces

    def _header_block(self, data: bytes, view: memoryview, pos: int, fed: int) -> tuple[int, bytes]:
        """Read the header block at `pos` (its first `fed` bytes parsed before); returns its
        end and the lines to add before its blank line, or (-1, b"") where it is not complete
        (kept in `head`)."""
        if not fed:
            self.headers_done = self.message_done = self.upgrade = False
        limit = self.limits.header_bytes
        idx = data.find(b"\r\n\r\n", max(pos, pos + fed - 3))
        if idx < 0:
            if len(data) - pos > limit:
                raise Refused(refusals.HEADER_TOO_LARGE, "request header block too large")
            self._parse(view[pos + fed :])
            if not fed:
                self.head_since = time.monotonic()
            self.head = data[pos:]
            return -1, b""
        to = idx + 4
        if to - pos > limit:
            raise Refused(refusals.HEADER_TOO_LARGE, "request header block too large")
        self._parse(view[pos + fed : to])
        if not self.headers_done:
            return to, b""  # empty lines before a request: passed on as they are
        verb = self.parser.get_method()
        block = data[pos:to]
        target, length, chunked = framing(block)
        if self.upgrade:
            # llhttp takes what follows an upgrade request (or CONNECT) for the new protocol
            # and parses no body of it: one without a body is relayed as the backend reads it
            # (Triton ignores the Upgrade and answers over HTTP/1.1; llhttp goes on with the
            # next request), one with a body is refused
            if chunked or length:
                raise Refused(refusals.UPGRADE, "an upgrade request with a body")
            self.message_done = True
        if length is not None and length > self.limits.body_bytes:
            raise Refused(refusals.BODY_TOO_LARGE, f"request body of {length} bytes too large")
        route = self.routes.http_route(verb, target)
        call, extra = self.book.start(
            verb, target, route.method, route.model, block, None if chunked else length
        )
        self.call = call
        if not self.keep_alive:
            self.closing = True
        if chunked:
            self.chunked = ChunkedFramer(capture=call.body is not None)
        elif length:
            self.body_left = length
        else:
            self._request_done(b"" if call.body is not None else None)
        return to, extra

    def _parse(self, chunk: memoryview) -> None:
        try:
            self.parser.feed_data(chunk)
        except HttpParserUpgrade:
            self.upgrade = True  # see `_header_block`

    def _request_done(self, body: bytes | None) -> None:
        if not self.message_done:  # our framing and llhttp's disagree: trust neither
            raise Refused(refusals.MALFORMED, "malformed request framing")
        self.message_done = self.headers_done = False
        call, self.call = self.call, None
        self.chunked = None
        assert call is not None
        self.book.request_done(call, body)
