"""Incremental HTTP/2 frame scanner for one direction of a relayed connection.

The relay forwards bytes unchanged; this scanner walks the same bytes to find frame
boundaries. It never copies DATA payloads unless its sink asks for them (the first bytes of a
request message, or a sampled body), reassembles HEADERS/PUSH_PROMISE + CONTINUATION blocks
(padding and priority fields stripped) and hands every complete header block to the sink in
order, so the sink can keep its HPACK decoder in step.

Two modes:

- `observe(data)`: the caller has already forwarded `data`; the scanner only watches.
- `process(data) -> list[bytes]`: *hold mode*, used on the client->backend direction when an
  observer may add header fields. Bytes of a header block are held back until the block is
  complete, the sink may return extra HPACK bytes to append, and the returned pieces are what
  must be forwarded. Bytes are never reordered; nothing but a header block (or an incomplete
  9-byte frame header) is ever held.

A header block over `MAX_HEADER_BLOCK` is not assembled: its bytes (padding stripped) are
streamed to the sink's `skim_header_block` as they pass (in hold mode, what was held is released
at once), then the sink is told the block was lost (`on_header_block_lost`); the frame layer
stays in step, so the sink can keep its HPACK table in step and count the stream.
Anything else the scanner cannot parse (not HTTP/2, broken framing) makes it stop observing
(`failed` is set, `on_failure` is called once) while bytes keep flowing: in hold mode everything
held is released at once.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from sidecar.proxy import native

if TYPE_CHECKING:
    from sidecar.proxy._pump import Pump

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20

MAX_STREAM_ID = 0x7FFFFFFF

# RST_STREAM / GOAWAY error codes (RFC 9113 section 7)
NO_ERROR = 0x0
REFUSED_STREAM = 0x7
CANCEL = 0x8

DEFAULT_MAX_FRAME_SIZE = 16384
MAX_HEADER_BLOCK = 1 << 20  # held/assembled header block cap; beyond it we stop observing

_HEADER = struct.Struct(">BHBBI")

# The C frame walker (`_framewalk.c`, built by `pip install` where a C compiler exists) handles
# the whole fast-path frames of a chunk, in observe and hold mode; this module is the reference
# and the fallback. `native_walk` may be set to None to force the pure-Python path (the tests do).
# Its arguments: sink, data, start, the scanner in hold mode (else None), the sink's stream
# table (`FrameScanner.streams`), whether this is the client's direction, the sink's header
# cache (`FrameScanner.header_cache`) and the sink's connection (`FrameScanner.tracker`).
native_walk: (
    Callable[
        [
            FrameSink, bytes, int, FrameScanner | None, Mapping[int, object] | None, bool,
            Mapping[bytes, object] | None, object,
        ],
        int,
    ]
    | None
)  # fmt: skip
_framewalk = native.load("_framewalk")  # None: not built, or XSP_NATIVE=off
native_walk = None if _framewalk is None else _framewalk.walk

# frame types the fast path handles when the whole frame is in one chunk (skipped ones included)
_CONTROL_TYPES = frozenset({SETTINGS, RST_STREAM, GOAWAY, PING})
_FAST_TYPES = frozenset({DATA, HEADERS, PRIORITY, PING, WINDOW_UPDATE}) | _CONTROL_TYPES

# payload handling modes
_SKIP = 0
_DELIVER = 1
_COLLECT = 2
_SKIM = 3  # a frame of an oversize header block: streamed to sink.skim_header_block


class ScanError(Exception):
    """The byte stream is not HTTP/2 as this scanner understands it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class FrameSink(Protocol):
    """What a scanner reports to. Exceptions raised here stop observation, not forwarding."""

    def on_header_block(
        self, stream_id: int, end_stream: bool, block: bytes, frame_type: int
    ) -> bytes | None:
        """A complete HPACK block; may return HPACK bytes to append to it (hold mode only)."""
        ...

    def skim_header_block(self, chunk: bytes) -> None:
        """Next bytes of a header block too large to assemble (see `on_header_block_lost`)."""
        ...

    def on_header_block_lost(self, stream_id: int, end_stream: bool, frame_type: int) -> None:
        """A header block too large to assemble has ended (all of it went to `skim_...`)."""
        ...

    def on_data(self, stream_id: int, length: int) -> bool:
        """A DATA frame of `length` payload bytes starts; True to receive its payload."""
        ...

    def on_data_payload(self, stream_id: int, chunk: bytes) -> None:
        """Payload bytes (padding removed) of a DATA frame `on_data` asked for."""
        ...

    def on_end_stream(self, stream_id: int) -> None:
        """A DATA frame with END_STREAM was fully scanned."""
        ...

    def on_control(self, frame_type: int, flags: int, stream_id: int, payload: bytes) -> None:
        """A complete SETTINGS, RST_STREAM, GOAWAY or PING frame."""
        ...


def frame_header(length: int, frame_type: int, flags: int, stream_id: int) -> bytes:
    """Encode a 9-byte HTTP/2 frame header."""
    return _HEADER.pack(length >> 16, length & 0xFFFF, frame_type, flags, stream_id & 0x7FFFFFFF)


def goaway_frame(last_stream_id: int, error_code: int = NO_ERROR) -> bytes:
    """A GOAWAY frame (error code 0: NO_ERROR, a graceful close)."""
    payload = (last_stream_id & 0x7FFFFFFF).to_bytes(4, "big") + error_code.to_bytes(4, "big")
    return frame_header(len(payload), GOAWAY, 0, 0) + payload


def ping_frame(opaque: bytes, ack: bool = False) -> bytes:
    """A PING frame with 8 bytes of opaque data."""
    if len(opaque) != 8:
        raise ValueError("PING carries exactly 8 bytes of opaque data")
    return frame_header(8, PING, FLAG_ACK if ack else 0, 0) + opaque


def rst_stream_frame(stream_id: int, error_code: int) -> bytes:
    """A RST_STREAM frame."""
    return frame_header(4, RST_STREAM, 0, stream_id) + error_code.to_bytes(4, "big")


def header_frames(stream_id: int, block: bytes, *, end_stream: bool, max_frame_size: int) -> bytes:
    """A header block as one HEADERS frame (+ CONTINUATION frames beyond `max_frame_size`)."""
    parts = [block[i : i + max_frame_size] for i in range(0, len(block), max_frame_size)]
    parts = parts or [b""]
    out = bytearray()
    for i, part in enumerate(parts):
        ftype = HEADERS if i == 0 else CONTINUATION
        flags = FLAG_END_STREAM if i == 0 and end_stream else 0
        if i == len(parts) - 1:
            flags |= FLAG_END_HEADERS
        out += frame_header(len(part), ftype, flags, stream_id) + part
    return bytes(out)


def _strip_padding(payload: bytes | bytearray, flags: int, skip: int = 0) -> bytes:
    """Return the fragment of a HEADERS/PUSH_PROMISE/DATA payload without pad/priority fields."""
    start = 0
    pad = 0
    if flags & FLAG_PADDED:
        if not payload:
            raise ScanError("protocol", "padded frame without a pad length")
        pad = payload[0]
        start = 1
    start += skip
    end = len(payload) - pad
    if end < start:
        raise ScanError("protocol", "padding longer than the frame payload")
    return bytes(payload[start:end])


class FrameScanner:
    """Incremental scanner of one direction. `client_side`: the client's (request) direction,
    which starts with the 24-byte preface."""

    def __init__(
        self,
        sink: FrameSink,
        *,
        client_side: bool,
        hold: bool = False,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.sink = sink
        self.hold = hold
        self.client_side = client_side
        # The sink's stream table (stream id -> its record), where the sink has one the C walk
        # may update itself (`_framewalk.Stream` records: see `_framewalk.c`); else None.
        self.streams: Mapping[int, object] | None = None
        # The direction's HPACK decoder's cache of blocks (`HeaderDecoder.cache`), where the C
        # walk may handle a response's headers, or with `tracker` a new request's, without
        # calling the sink; else None.
        self.header_cache: Mapping[bytes, object] | None = None
        # The sink's `streams.ConnectionTracker`, where the C walk may start and end a call
        # itself (in hold mode only a request its observer lets it answer: `QuickDecisions`;
        # see `_framewalk.c`); else None.
        self.tracker: object = None
        self.on_failure = on_failure
        # The relay's C `data_received` for this direction (`_pump.Pump`), disarmed when the
        # scanner stops; else None.
        self.pump: Pump | None = None
        self.failed = False
        self.failure_reason = ""
        self.max_frame_size = DEFAULT_MAX_FRAME_SIZE  # peer's limit for frames we may build
        self._preface_left = len(PREFACE) if client_side else 0
        self._carry = b""  # incomplete frame header (or preface) from the previous chunk
        self._remaining = 0  # payload bytes of the current frame still to come
        self._mode = _SKIP
        self._ftype = 0
        self._flags = 0
        self._sid = 0
        self._payload = bytearray()
        # header block assembly
        self._block_sid = 0  # non-zero while CONTINUATION frames are expected
        self._block_type = 0
        self._block_end_stream = False
        self._block_parts: list[bytes] = []
        self._block_size = 0
        self._block_lost = False  # the current block is too large: its frames are skimmed
        self._skim_off = 0  # payload bytes of the current skimmed frame seen so far
        self._skim_start = 0  # where its header block fragment starts / ends in the payload
        self._skim_end = 0
        self._skim_padded = False
        # hold mode
        self._held = bytearray()
        self._held_frames: list[tuple[int, int, bool]] = []  # (offset, length, padded)
        self._holding = False
        self.out: list[bytes] = []  # the pieces to forward now (the pump reads it too)
        self._data = b""
        self._emit_from = 0

    # -- public ---------------------------------------------------------------------------

    def observe(self, data: bytes) -> None:
        """Scan bytes the caller has already forwarded."""
        if self.failed:
            return
        try:
            walk = native_walk
            if walk is not None and not (
                self.hold or self._remaining or self._carry or self._block_sid or self._preface_left
            ):
                pos = walk(  # whole fast-path frames, in C
                    self.sink,
                    data,
                    0,
                    None,
                    self.streams,
                    self.client_side,
                    self.header_cache,
                    self.tracker,
                )
                if pos == len(data):
                    return
                self._scan(data, pos)  # no carry here: the walk ran at a frame boundary
                return
            self._scan(data)
        except ScanError as exc:
            self._fail(exc.reason)
        except Exception:  # observation must never break forwarding
            self._fail("internal")

    def process(self, data: bytes) -> list[bytes]:
        """Hold mode: scan `data` and return the pieces to forward now, in order."""
        if self.failed:
            if self._held or self._carry:  # stopped from outside while holding
                pending = bytes(self._held) + self._carry
                self._held = bytearray()
                self._carry = b""
                return [pending, data]
            return [data]
        self.out = out = []
        try:
            walk = native_walk
            if (
                walk is not None
                and self.hold
                and not (self._remaining or self._carry or self._block_sid or self._preface_left)
            ):
                self._data = data  # what `emit_injected` and a failure release read
                self._emit_from = 0
                pos = walk(  # C
                    self.sink,
                    data,
                    0,
                    self,
                    self.streams,
                    self.client_side,
                    self.header_cache,
                    self.tracker,
                )
                if pos < len(data):
                    self._scan(data, pos, self._emit_from)
                elif self._emit_from < pos:
                    out.append(data[self._emit_from :] if self._emit_from else data)
            else:
                self._scan(data)
        except Exception as exc:
            self._release(exc)
        self._data = b""
        return out

    def _release(self, exc: Exception) -> None:
        """Hold mode, scanning failed with `exc`: release everything not yet forwarded (the held
        block, then the rest of the chunk) into `out`, and stop."""
        out = self.out
        if self._held:
            out.append(bytes(self._held))
        rest = self._data[self._emit_from :]
        if rest:
            out.append(rest)
        self._held = bytearray()
        self._held_frames = []
        self._holding = False
        self._carry = b""
        self._fail(exc.reason if isinstance(exc, ScanError) else "internal")

    def stop(self) -> None:
        """Stop observing (no failure is reported); held bytes go out with the next chunk."""
        self.failed = True
        if self.pump is not None:
            self.pump.armed = False

    # -- the relay's C data_received (`_pump.c`) -----------------------------------------

    # Observe mode: the pump writes a chunk, then walks it in C from where the scanner stood
    # at a whole frame (`_walkable`), else calls `observe_step`; where the walk stops short of
    # the chunk's end, `observe_rest` scans the rest. Hold mode: the pump walks the chunk with
    # this scanner as the walk's `hold`, then writes it whole where the walk emitted nothing
    # (`out` empty), else writes what `process_done` returns; `process_step` and
    # `process_rest` are `process` in pieces (every name the C code uses is declared in
    # `native.py`). Between two chunks of the pump `out` is empty, `_emit_from` 0 and `_data`
    # empty: what `process` sets before its walk.

    def _walkable(self, hold: bool) -> bool:
        """Whether the next chunk may start in the C walk (`observe`'s or `process`'s test)."""
        return bool(self.hold) == hold and self.at_frame_boundary()

    def observe_step(self, data: bytes) -> bool:
        """`observe(data)`; returns `_walkable(False)` after it."""
        self.observe(data)
        return self._walkable(False)

    def observe_rest(self, data: bytes, pos: int) -> bool:
        """Observe `data` from `pos`, where the C walk stopped; returns `_walkable(False)`."""
        try:
            self._scan(data, pos)  # the pump walked from a frame boundary: no carry
        except Exception as exc:  # observation must never break forwarding
            self.walk_failed(exc)
        return self._walkable(False)

    def _pieces(self) -> tuple[list[bytes], bool]:
        """The pieces the pump forwards now, and `_walkable(True)`; the state between chunks."""
        out = self.out
        self.out = []
        self._emit_from = 0
        self._data = b""
        return out, self._walkable(True)

    def process_step(self, data: bytes) -> tuple[list[bytes], bool]:
        """`process(data)`."""
        out = self.process(data)
        self.out = out
        return self._pieces()

    def process_rest(self, data: bytes, pos: int) -> tuple[list[bytes], bool]:
        """Hold mode, the C walk stopped at `pos`: scan the rest as `process` does."""
        try:
            self._scan(data, pos, self._emit_from)
        except Exception as exc:
            self._release(exc)
        return self._pieces()

    def process_done(self, data: bytes) -> tuple[list[bytes], bool]:
        """Hold mode, the C walk took the whole chunk and emitted frames of its own."""
        if self._emit_from < len(data):
            self.out.append(data[self._emit_from :])
        return self._pieces()

    def hold_failed(self, exc: BaseException, data: bytes) -> tuple[list[bytes], bool]:
        """Hold mode, the C walk raised `exc`: what `process` does."""
        if not isinstance(exc, Exception):
            raise exc
        self._data = data
        self._release(exc)
        return self._pieces()

    def walk_failed(self, exc: BaseException) -> None:
        """Scanning raised `exc` while the pump observed a chunk: what `observe` does."""
        if not isinstance(exc, Exception):
            raise exc
        self._fail(exc.reason if isinstance(exc, ScanError) else "internal")

    def at_frame_boundary(self) -> bool:
        """True while observing and every byte scanned so far ends a whole frame."""
        return not (
            self.failed or self._remaining or self._carry or self._block_sid or self._preface_left
        )

    def next_boundary(self, data: bytes) -> int | None:
        """Where in `data` (about to be scanned) the first frame boundary lies that is outside
        a header block: 0 if `at_frame_boundary()` now, None if there is none in `data`.

        Reads the scanner's state without changing it; the caller may then scan `data[:off]`,
        write frames of its own (they land between two whole frames) and scan the rest.
        """
        if self.failed or self._preface_left:
            return None
        n = len(data)
        if self._carry:
            head = self._carry + data[: 9 - len(self._carry)]
            if len(head) < 9:
                return None
            pos = 9 - len(self._carry) + int.from_bytes(head[:3], "big")
            in_block = head[3] in (HEADERS, PUSH_PROMISE, CONTINUATION) and not (
                head[4] & FLAG_END_HEADERS
            )
        elif self._remaining:
            pos = self._remaining
            in_block = self._ftype in (HEADERS, PUSH_PROMISE, CONTINUATION) and not (
                self._flags & FLAG_END_HEADERS
            )
        else:
            pos = 0
            in_block = bool(self._block_sid)
        while pos <= n:
            if not in_block:
                return pos
            if n - pos < 9:
                return None
            hi, lo, _, flags, _ = _HEADER.unpack_from(data, pos)
            pos += 9 + ((hi << 16) | lo)
            in_block = not flags & FLAG_END_HEADERS
        return None

    def pending_bytes(self) -> int:
        """Bytes received but not yet returned by `process` (hold mode)."""
        return len(self._held) + len(self._carry)

    # -- scanning -------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.failed:
            return
        self.failed = True
        if self.pump is not None:
            self.pump.armed = False
        self.failure_reason = reason
        self._payload = bytearray()
        self._block_parts = []
        if self.on_failure is not None:
            with contextlib.suppress(Exception):
                self.on_failure(reason)

    def _scan(self, data: bytes, pos: int = 0, emit_from: int = 0) -> None:
        """Scan `data` from `pos`; in hold mode `data[:emit_from]` is already forwarded."""
        # Hold-mode invariant: bytes not yet forwarded == self._held + data[self._emit_from:]
        # (plus self._carry once a chunk ends inside a frame header).
        if self._carry:
            data = self._carry + data
            self._carry = b""
        hold = self.hold
        out = self.out
        n = len(data)
        if hold:
            self._data = data  # for releasing the unforwarded rest if scanning fails
        self._emit_from = emit_from
        while pos < n:
            remaining = self._remaining
            if remaining:
                take = remaining if remaining <= n - pos else n - pos
                mode = self._mode
                if mode == _DELIVER:
                    self.sink.on_data_payload(self._sid, data[pos : pos + take])
                elif mode == _COLLECT:
                    self._payload += data[pos : pos + take]
                elif mode == _SKIM:
                    self._skim(data[pos : pos + take])
                if self._holding:
                    self._held += data[pos : pos + take]
                    self._emit_from = pos + take
                pos += take
                self._remaining = remaining - take
                if self._remaining == 0:
                    self._finish_frame(pos)
                    pos = self._walk_on(data, pos)
                continue
            if self._preface_left:
                take = min(self._preface_left, n - pos)
                start = len(PREFACE) - self._preface_left
                if data[pos : pos + take] != PREFACE[start : start + take]:
                    raise ScanError("preface", "the client did not start with the HTTP/2 preface")
                pos += take
                self._preface_left -= take
                continue
            if n - pos < 9:
                if hold and not self._holding and pos > self._emit_from:
                    out.append(data[self._emit_from : pos])
                self._carry = data[pos:]
                self._emit_from = n
                return
            hi, lo, ftype, flags, sid = _HEADER.unpack_from(data, pos)
            length = (hi << 16) | lo
            sid &= 0x7FFFFFFF
            hdr_pos = pos
            pos += 9
            end = pos + length
            if (
                end <= n
                and not self._block_sid
                and ftype in _FAST_TYPES
                and (ftype != HEADERS or (flags & FLAG_END_HEADERS and length <= MAX_HEADER_BLOCK))
            ):
                # Fast path: a whole frame inside this chunk, handled without buffering.
                if ftype == DATA:
                    if sid == 0:
                        raise ScanError("protocol", "DATA frame on stream 0")
                    sink = self.sink
                    if sink.on_data(sid, length):
                        chunk = (
                            _strip_padding(data[pos:end], flags)
                            if flags & FLAG_PADDED
                            else data[pos:end]
                        )
                        if chunk:
                            sink.on_data_payload(sid, chunk)
                    if flags & FLAG_END_STREAM:
                        sink.on_end_stream(sid)
                elif ftype == HEADERS:
                    if sid == 0:
                        raise ScanError("protocol", "header frame on stream 0")
                    if flags & (FLAG_PADDED | FLAG_PRIORITY):
                        skip = 5 if flags & FLAG_PRIORITY else 0
                        fragment = _strip_padding(data[pos:end], flags, skip)
                    else:
                        fragment = data[pos:end]
                    extra = self.sink.on_header_block(
                        sid, bool(flags & FLAG_END_STREAM), fragment, HEADERS
                    )
                    if extra and hold:
                        self.emit_injected(data, hdr_pos, extra)
                elif ftype in _CONTROL_TYPES:
                    self.sink.on_control(ftype, flags, sid, data[pos:end])
                pos = end
                continue
            if self._block_sid and (ftype != CONTINUATION or sid != self._block_sid):
                raise ScanError("protocol", "header block interrupted by another frame")
            self._ftype = ftype
            self._flags = flags
            self._sid = sid
            if ftype == DATA:
                if sid == 0:
                    raise ScanError("protocol", "DATA frame on stream 0")
                if self.sink.on_data(sid, length):
                    self._mode = _COLLECT if flags & FLAG_PADDED else _DELIVER
                    self._payload = bytearray()
                else:
                    self._mode = _SKIP
            elif ftype in (HEADERS, CONTINUATION, PUSH_PROMISE):
                if sid == 0:
                    raise ScanError("protocol", "header frame on stream 0")
                if ftype == CONTINUATION and not self._block_sid:
                    raise ScanError("protocol", "CONTINUATION without a header block")
                if ftype != CONTINUATION:
                    self._block_type = ftype
                    self._block_end_stream = ftype == HEADERS and bool(flags & FLAG_END_STREAM)
                if not self._block_lost and self._block_size + length > MAX_HEADER_BLOCK:
                    self._lose_block()
                if self._block_lost:
                    self._start_skim(ftype, flags, length)
                else:
                    self._mode = _COLLECT
                    self._payload = bytearray()
                if hold and not self._block_lost:
                    if not self._holding:
                        if hdr_pos > self._emit_from:
                            out.append(data[self._emit_from : hdr_pos])
                        self._holding = True
                    padded = ftype != CONTINUATION and bool(flags & FLAG_PADDED)
                    self._held_frames.append((len(self._held), length, padded))
                    self._held += data[hdr_pos:pos]
                    self._emit_from = pos
            elif ftype in _CONTROL_TYPES:
                self._mode = _COLLECT
                self._payload = bytearray()
            else:
                self._mode = _SKIP
            self._remaining = length
            if length == 0:
                self._finish_frame(pos)
        if hold and not self._holding and n > self._emit_from:
            out.append(data[self._emit_from :] if self._emit_from else data)
        self._emit_from = n

    def _walk_on(self, data: bytes, pos: int) -> int:
        """A frame split across chunks has just ended at `pos`: the rest of `data` goes back
        to the C walk (where built) while the scanner stands between whole frames outside a
        header block, so a large body's reads cost one Python step each (the split frame's
        end), not one per frame. Returns where the walk stopped (`pos` where it did not run);
        the walk is `observe`'s or `process`'s, from `pos`."""
        walk = native_walk
        if walk is None or pos == len(data) or self.failed or self._block_sid or self._holding:
            return pos
        return walk(
            self.sink,
            data,
            pos,
            self if self.hold else None,
            self.streams,
            self.client_side,
            self.header_cache,
            self.tracker,
        )

    def _finish_frame(self, pos: int) -> None:
        """Handle a frame whose payload is complete (`pos` is just after it)."""
        ftype = self._ftype
        flags = self._flags
        sid = self._sid
        if ftype == DATA:
            if self._mode == _COLLECT:
                chunk = _strip_padding(self._payload, flags)
                self._payload = bytearray()
                if chunk:
                    self.sink.on_data_payload(sid, chunk)
            if flags & FLAG_END_STREAM:
                self.sink.on_end_stream(sid)
            return
        if ftype in (HEADERS, PUSH_PROMISE, CONTINUATION):
            if self._block_lost:
                if flags & FLAG_END_HEADERS:
                    self._block_sid = 0
                    self._block_size = 0
                    self._block_lost = False
                    self.sink.on_header_block_lost(sid, self._block_end_stream, self._block_type)
                else:
                    self._block_sid = sid
                return
            payload = self._payload
            self._payload = bytearray()
            if ftype == HEADERS:
                skip = 5 if flags & FLAG_PRIORITY else 0
                fragment = _strip_padding(payload, flags, skip)
                self._block_parts = [fragment]
            elif ftype == PUSH_PROMISE:
                fragment = _strip_padding(payload, flags, 4)
                self._block_parts = [fragment]
            else:
                fragment = bytes(payload)
                self._block_parts.append(fragment)
            self._block_size += len(fragment)
            if not flags & FLAG_END_HEADERS:
                self._block_sid = sid
                return
            parts = self._block_parts
            block = parts[0] if len(parts) == 1 else b"".join(parts)
            self._block_sid = 0
            self._block_parts = []
            self._block_size = 0
            extra = self.sink.on_header_block(sid, self._block_end_stream, block, self._block_type)
            if self.hold:
                held = self._held
                if extra:
                    self._inject(held, self._held_frames, extra, sid)
                self.out.append(bytes(held))
                self._held = bytearray()
                self._held_frames = []
                self._holding = False
                self._emit_from = pos
            return
        control = bytes(self._payload)
        self._payload = bytearray()
        self.sink.on_control(ftype, flags, sid, control)

    def emit_injected(self, data: bytes, at: int, extra: bytes) -> None:
        """Hold mode: forward up to the whole HEADERS frame at `data[at:]`, then that frame
        with `extra` HPACK bytes appended to its block (the C walk calls this too)."""
        hi, lo, _, flags, sid = _HEADER.unpack_from(data, at)
        length = (hi << 16) | lo
        end = at + 9 + length
        if at > self._emit_from:
            self.out.append(data[self._emit_from : at])
        frame = bytearray(data[at:end])
        self._inject(frame, [(0, length, bool(flags & FLAG_PADDED))], extra, sid & 0x7FFFFFFF)
        self.out.append(bytes(frame))
        self._emit_from = end

    def _lose_block(self) -> None:
        """Stop assembling the current header block (too large); release what is held."""
        self._block_lost = True
        for part in self._block_parts:
            self.sink.skim_header_block(part)
        self._block_parts = []
        self._payload = bytearray()
        if self._holding:
            self.out.append(bytes(self._held))
            self._held = bytearray()
            self._held_frames = []
            self._holding = False

    def _start_skim(self, ftype: int, flags: int, length: int) -> None:
        self._mode = _SKIM
        self._skim_off = 0
        self._skim_end = length
        self._skim_padded = ftype != CONTINUATION and bool(flags & FLAG_PADDED)
        start = 1 if self._skim_padded else 0
        if ftype == HEADERS and flags & FLAG_PRIORITY:
            start += 5
        elif ftype == PUSH_PROMISE:
            start += 4
        self._skim_start = start

    def _skim(self, chunk: bytes) -> None:
        """Pass on the header block fragment part of a chunk of a skimmed frame's payload."""
        off = self._skim_off
        self._skim_off = off + len(chunk)
        if self._skim_padded and off == 0 and chunk:
            self._skim_end -= chunk[0]  # the pad length
        lo = max(self._skim_start - off, 0)
        hi = min(self._skim_end - off, len(chunk))
        if hi > lo:
            self.sink.skim_header_block(chunk[lo:hi])

    def _inject(
        self, held: bytearray, frames: list[tuple[int, int, bool]], extra: bytes, sid: int
    ) -> None:
        """Append `extra` HPACK bytes to a block's last frame (or add a CONTINUATION frame).

        `held` holds the raw frames of one header block; `frames` gives each frame's
        (offset in `held`, payload length, padded).
        """
        off, length, padded = frames[-1]
        if length + len(extra) <= self.max_frame_size:
            # Insert after the header block fragment, before any padding.
            trailing_pad = held[off + 9] if padded else 0
            insert_at = off + 9 + length - trailing_pad
            held[insert_at:insert_at] = extra
            new_length = length + len(extra)
            held[off : off + 3] = new_length.to_bytes(3, "big")
        else:
            held[off + 4] &= ~FLAG_END_HEADERS & 0xFF
            held += frame_header(len(extra), CONTINUATION, FLAG_END_HEADERS, sid) + extra
