"""The gRPC messages of an inference stream (Triton's `ModelStreamInfer`), read as they pass.

`MessageSplitter` cuts one direction's DATA bytes into gRPC length-prefixed messages and keeps
only each message's first `MESSAGE_HEAD` bytes, so memory per stream is bounded whatever the
tensors' size. `read_request` / `read_response` read the few fields accounting needs from
those heads. A splitter given a `pick` hook (request sampling) asks it at each message's
prefix, and keeps the whole of a picked message (up to `capture_limit` bytes) besides its head.

Why a hand scan and not `service_pb2`: the relay runs this for every message of every stream;
decoding a whole `ModelInferRequest` (tensors included) with protobuf would copy the message
and cost tens of microseconds, while the fields needed (model_name = 1, id = 3, the
parameters map = 4; the response's error_message = 1 and infer_response = 2) come before the
tensors in the wire format, so a walk of the first bytes is enough. `tests/proxy/
test_stream_messages.py` checks the scan against `service_pb2` on random messages.

The relay reads a stream through `request_reader()` / `response_reader()`: one `read(chunk)`
per DATA chunk, returning one tuple of fields per message that ends in it. Where the C walker
(`_messagewalk.c`, built by `pip install` where a C compiler exists) is built, they are its
`RequestWalker` / `ResponseWalker`; `RequestReader` / `ResponseReader` here (the splitter and
the scans above, composed) are the reference the tests compare it with and the fallback.
`native_readers` may be set to None to force the pure-Python path (the tests do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sidecar.proxy import native
from sidecar.proxy.model_name import read_varint

MESSAGE_HEAD = 4096  # bytes kept of each message: its fields before the tensors
ENABLE_FINAL = b"triton_enable_empty_final_response"
FINAL = b"triton_final_response"


# a map entry's key field as written: tag 0x0a, length, the key
_KEY_PREFIXES = {key: b"\n" + bytes((len(key),)) + key for key in (ENABLE_FINAL, FINAL)}


class Unreadable(ValueError):
    """A message head that is not a protobuf message of the expected type."""


@dataclass(frozen=True, slots=True)
class Message:
    """One gRPC message of a stream: its head (up to `MESSAGE_HEAD` bytes), size, compression."""

    head: bytes
    size: int  # whole message, 5-byte gRPC prefix included
    compressed: bool
    sample: object = None  # what `MessageSplitter.pick` said at its prefix
    full: bytes | None = None  # the whole message, where picked and within the capture limit

    @property
    def complete(self) -> bool:
        """The head is the whole message."""
        return self.size - 5 == len(self.head)


# At a message's prefix, given its size (prefix excluded): None, or a token for the message
# (`Message.sample`) and whether to keep the whole message.
Pick = Callable[[int], "tuple[object, bool] | None"]


class MessageSplitter:
    """Splits one direction's DATA payload into gRPC messages (heads kept, rest skipped)."""

    __slots__ = (
        "_compressed", "_full", "_head", "_left", "_prefix", "_sample", "_size", "capture_limit",
        "pick",
    )  # fmt: skip

    def __init__(self) -> None:
        self._prefix = b""  # an incomplete 5-byte message prefix
        self._head = bytearray()
        self._left = 0  # bytes of the current message's body still to come
        self._size = 0
        self._compressed = False
        self.pick: Pick | None = None
        self.capture_limit = 0  # a picked message larger than this is not kept whole
        self._sample: object = None
        self._full: bytearray | None = None

    @property
    def mid_message(self) -> bool:
        """True while a message has begun and not ended."""
        return bool(self._prefix) or self._left > 0

    @property
    def copying(self) -> bool:
        """True while the message under way is being kept whole (picked, within the limit)."""
        return self._full is not None

    def _ask(self, pick: Pick, size: int) -> tuple[object, bool]:
        picked = pick(size)
        if picked is None:
            return None, False
        sample, keep = picked
        return sample, keep and size <= self.capture_limit

    def feed(self, chunk: bytes) -> list[Message]:
        """The messages that end in `chunk`, in order."""
        n = len(chunk)
        pick = self.pick
        if not self._left and not self._prefix and n > 5:  # the usual DATA frame: one message
            size = int.from_bytes(chunk[1:5], "big")
            if n == size + 5 and size <= MESSAGE_HEAD:
                head = chunk[5:]
                if pick is None:
                    return [Message(head, n, bool(chunk[0] & 1))]
                sample, keep = self._ask(pick, size)
                return [Message(head, n, bool(chunk[0] & 1), sample, head if keep else None)]
        out: list[Message] = []
        pos = 0
        while pos < n:
            if self._left:
                take = min(self._left, n - pos)
                room = MESSAGE_HEAD - len(self._head)
                if room > 0:
                    self._head += chunk[pos : pos + min(room, take)]
                if self._full is not None:
                    self._full += chunk[pos : pos + take]
                pos += take
                self._left -= take
                if not self._left:
                    full = bytes(self._full) if self._full is not None else None
                    out.append(
                        Message(bytes(self._head), self._size, self._compressed, self._sample, full)
                    )
                    self._head = bytearray()
                    self._sample = self._full = None
                continue
            if self._prefix or n - pos < 5:
                need = 5 - len(self._prefix)
                self._prefix += chunk[pos : pos + need]
                pos += min(need, n - pos)
                if len(self._prefix) < 5:
                    return out
                prefix, self._prefix = self._prefix, b""
            else:
                prefix = chunk[pos : pos + 5]
                pos += 5
            size = int.from_bytes(prefix[1:5], "big")
            self._compressed = bool(prefix[0] & 1)
            self._size = size + 5
            sample, keep = self._ask(pick, size) if pick is not None else (None, False)
            if size == 0:
                out.append(Message(b"", 5, self._compressed, sample, b"" if keep else None))
            elif n - pos >= size and size <= MESSAGE_HEAD:  # whole message here: no copy loop
                head = chunk[pos : pos + size]
                out.append(
                    Message(head, size + 5, self._compressed, sample, head if keep else None)
                )
                pos += size
            else:
                self._left = size
                self._sample = sample
                self._full = bytearray() if keep else None
        return out


_CUT = "message cut inside a field"
Field = tuple[int, int, "bytes | int", bool]


def _fields(buf: bytes, complete: bool = True, last: int = 1 << 29) -> list[Field]:
    """(field, wire type, value, value complete) of a message's fields numbered up to `last`.

    `complete`: `buf` is the whole message, so a field running past its end is an error;
    otherwise `buf` is a head and the scan stops where it is cut (a length-delimited value cut
    there is returned as far as it goes, marked incomplete). The scan stops at the first field
    numbered above `last`, returned as `(field, wire, b"", False)`: every protobuf serializer
    writes known fields in field-number order, so the fields read here (ids, names,
    parameters) come before the tensors, which are never walked.
    """
    try:
        return _scan(buf, complete, last)
    except Unreadable:
        raise
    except ValueError as exc:  # read_varint's "varint too long"
        raise Unreadable(str(exc)) from exc


def _scan(buf: bytes, complete: bool, last: int) -> list[Field]:
    out: list[Field] = []
    pos = 0
    end = len(buf)
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:  # one-byte varints: every field number below 16
            pos += 1
        else:
            tag, pos = read_varint(buf, pos, end)
            if tag < 0:
                if complete:
                    raise Unreadable(_CUT)
                break
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise Unreadable("field number 0")
        if field > last:
            out.append((field, wire, b"", False))
            return out
        if wire == 2:
            size = buf[pos] if pos < end else -1
            if 0 <= size < 0x80:
                pos += 1
            else:
                size, pos = read_varint(buf, pos, end)
            if size < 0 or pos + size > end:
                if complete:
                    raise Unreadable(_CUT)
                if size < 0:
                    break
            out.append((field, 2, buf[pos : pos + size], pos + size <= end))
            pos += size
        elif wire == 0:
            value, pos = read_varint(buf, pos, end)
            if value < 0:
                if complete:
                    raise Unreadable(_CUT)
                break
            out.append((field, 0, value, True))
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise Unreadable(f"wire type {wire}")
    if complete and pos > end:
        raise Unreadable(_CUT)
    return out


def _bool_parameter(entry: bytes | int, complete: bool, key: bytes) -> bool | None:
    """The bool value of a parameters-map entry if its key is `key`, else None."""
    if not isinstance(entry, bytes):
        raise Unreadable("a parameters entry that is not a message")
    if entry[:1] == b"\n":  # the key (field 1) first, as serializers write map entries
        prefix = _KEY_PREFIXES[key]
        if not entry.startswith(prefix):
            return None
        # the common shape: value = InferParameter{bool_param} as 0x12 02 08 0x
        value = entry[len(prefix) :]
        if len(value) == 4 and value[:3] == b"\x12\x02\x08" and value[3] < 0x80:
            return bool(value[3])
    fields = _fields(entry, complete)
    if not any(f == 1 and v == key for f, _, v, _ in fields):
        return None
    for f, _, v, whole in fields:
        if f == 2 and isinstance(v, bytes):
            for pf, wire, pv, _ in _fields(v, whole):
                if pf == 1 and wire == 0:
                    return bool(pv)
            return False
    return False


def _text(value: bytes | int) -> str:
    if not isinstance(value, bytes):
        raise Unreadable("a string field that is not length-delimited")
    return value.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class RequestFields:
    """What accounting reads of a `ModelInferRequest`."""

    model: str
    id: str
    final_flag_asked: bool  # parameters["triton_enable_empty_final_response"] is true


@dataclass(frozen=True, slots=True)
class ResponseFields:
    """What accounting reads of a `ModelStreamInferResponse`."""

    error: str
    model: str
    id: str
    final: bool | None  # parameters["triton_final_response"]; None where absent
    has_outputs: bool  # an output tensor (an empty final response has none)


def read_request(head: bytes, complete: bool = True) -> RequestFields:
    """The model, id and final-flag request of a `ModelInferRequest` head (`complete`: the
    whole message)."""
    model = ident = ""
    asked = False
    for field, _, value, whole in _fields(head, complete, 4):
        if field == 1:
            model = _text(value)
        elif field == 3:
            ident = _text(value)
        elif field == 4 and _bool_parameter(value, whole, ENABLE_FINAL):
            asked = True
    return RequestFields(model, ident, asked)


def read_response(head: bytes, complete: bool = True) -> ResponseFields:
    """The error, model, id and final flag of a `ModelStreamInferResponse` head (`complete`:
    the whole message)."""
    error = model = ident = ""
    final: bool | None = None
    outputs = False
    for field, _, value, whole in _fields(head, complete):
        if field == 1:
            error = _text(value)
        elif field == 2:
            if not isinstance(value, bytes):
                raise Unreadable("infer_response is not a message")
            for f, _, v, inner_whole in _fields(value, whole, 4):
                if f == 1:
                    model = _text(v)
                elif f == 3:
                    ident = _text(v)
                elif f == 4:
                    flag = _bool_parameter(v, inner_whole, FINAL)
                    if flag is not None:
                        final = flag
                elif f in (5, 6):  # the first field past 4: the scan stopped there
                    outputs = True
    return ResponseFields(error, model, ident, final, outputs)


# One request message: (size with the 5-byte prefix, the pick's token, the whole message if
# kept, model (None: compressed or unreadable), id, final flag asked).
RequestRead = tuple[int, object, "bytes | None", "str | None", str, bool]
# One response message: (size with the prefix, error_message, model (None: compressed or
# unreadable), id, triton_final_response (None: absent), has an output tensor).
ResponseRead = tuple[int, str, "str | None", str, "bool | None", bool]


class RequestReader(MessageSplitter):
    """A stream's request messages, each read as a `RequestRead`."""

    __slots__ = ()

    def read(self, chunk: bytes) -> list[RequestRead]:
        """The messages that end in `chunk`, in order."""
        out: list[RequestRead] = []
        for msg in self.feed(chunk):
            model: str | None = None
            ident, asked = "", False
            if not msg.compressed:
                try:
                    fields = read_request(msg.head, msg.complete)
                    model, ident, asked = fields.model, fields.id, fields.final_flag_asked
                except Unreadable:
                    pass
            out.append((msg.size, msg.sample, msg.full, model, ident, asked))
        return out


class ResponseReader(MessageSplitter):
    """A stream's response messages, each read as a `ResponseRead`."""

    __slots__ = ()

    def read(self, chunk: bytes) -> list[ResponseRead]:
        """The messages that end in `chunk`, in order."""
        out: list[ResponseRead] = []
        for msg in self.feed(chunk):
            read: ResponseRead = (msg.size, "", None, "", None, False)
            if not msg.compressed:
                try:
                    f = read_response(msg.head, msg.complete)
                    read = (msg.size, f.error, f.model, f.id, f.final, f.has_outputs)
                except Unreadable:
                    pass
            out.append(read)
        return out


class RequestReading(Protocol):
    """`RequestReader` or the C `RequestWalker`."""

    pick: Pick | None
    capture_limit: int

    @property
    def mid_message(self) -> bool: ...

    @property
    def copying(self) -> bool: ...

    def read(self, chunk: bytes) -> list[RequestRead]: ...


class ResponseReading(Protocol):
    """`ResponseReader` or the C `ResponseWalker`."""

    @property
    def mid_message(self) -> bool: ...

    def read(self, chunk: bytes) -> list[ResponseRead]: ...


native_readers: tuple[Callable[[], RequestReading], Callable[[], ResponseReading]] | None
_messagewalk = native.load("_messagewalk")  # None: not built, or XSP_NATIVE=off
native_readers = (
    None if _messagewalk is None else (_messagewalk.RequestWalker, _messagewalk.ResponseWalker)
)


def request_reader() -> RequestReading:
    """A reader of one stream's request messages: the C walker where built."""
    return native_readers[0]() if native_readers is not None else RequestReader()


def response_reader() -> ResponseReading:
    """A reader of one stream's response messages: the C walker where built."""
    return native_readers[1]() if native_readers is not None else ResponseReader()


SEQUENCE_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})


def sequence_parameters(message: bytes) -> list[str]:
    """The stateful-sequence parameters (`sequence_id`, `sequence_start`, `sequence_end`) a
    whole `ModelInferRequest` sets, in order."""
    found = []
    for field, _, value, whole in _fields(message, True, 4):
        if field != 4 or not isinstance(value, bytes):
            continue
        for f, _, key, _ in _fields(value, whole):
            if f == 1 and isinstance(key, bytes):
                name = key.decode("utf-8", "replace")
                if name in SEQUENCE_PARAMETERS:
                    found.append(name)
                break
    return found
