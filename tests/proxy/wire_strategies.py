"""Hypothesis strategies that build protobuf and gRPC wire bytes piece by piece.

The C walkers read bytes from any client, so the tests that hold them to their Python
references must reach every branch a wrong line could change: every wire type (varint,
64-bit, length-delimited, 32-bit, and the group and invalid ones 3, 4, 6, 7), fields repeated
and out of order (protobuf: the last occurrence wins), map entries with the value before the
key or the key twice, varints at their limits (2**63, 2**64, a tenth continued byte), field
numbers at the scans' limits (4, 5, 2**29), messages of exactly MESSAGE_HEAD bytes and one
either side, heads cut inside any field, and capture limits equal to a message's size. A
`service_pb2` message never has any of these; see tests/proxy/test_messagewalk.py for the
tests and scripts/mutate_c.py for the check that they catch a wrong line.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hypothesis import strategies as st

from sidecar.proxy.stream_messages import ENABLE_FINAL, FINAL, MESSAGE_HEAD

# the profiles (tests/conftest.py) scale the examples of tests that size their own
_SCALE = {"long": 10.0, "mutate": 0.2, "sanitize": 0.4}.get(
    os.environ.get("HYPOTHESIS_PROFILE", "ci"), 1.0
)


def examples(n: int) -> int:
    """A test's max_examples: `n`; ten times it under the `long` profile, a fifth under
    `mutate` (scripts/mutate_c.py's first pass), two fifths under `sanitize` (sanitize.sh
    --ci)."""
    return max(10, int(n * _SCALE))


def varint(n: int) -> bytes:
    """A protobuf varint of any non-negative int (past 64 bits too: the walkers must cope)."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def delimited(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return tag(field, 2) + varint(len(payload)) + payload


# varint values at the limits the readers test: 0, 1, one and two bytes, 2**63 (the last bit
# that fits), 2**64 (its low 64 bits 0: "wide"), past it
LIMIT_INTS = [0, 1, 2, 0x7F, 0x80, 0x3FFF, 0x4000, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64]
ints = st.one_of(st.sampled_from(LIMIT_INTS), st.integers(0, 2**64 + 5), st.integers(2**64, 2**75))
# bytes that are not a varint: ten or more continued bytes (too long), or one cut short
bad_varints = st.sampled_from([b"\xff" * 10 + b"\x01", b"\x80" * 10, b"\x80", b"\xff\xff"])

KEYS = [ENABLE_FINAL, FINAL]
# bytes the map entries' fast path tests (the value's tag 0x12, length 2, bool_param's tag 8),
# their neighbours, and values at the one-byte varint's limit
FAST_BYTES = [b"\x12", b"\x02", b"\x08", b"\x1a", b"\x10", b"\x03", b"\x00", b"\x01", b"\x80"]
names = st.one_of(
    st.text(max_size=8).map(str.encode),
    st.binary(max_size=8),  # invalid UTF-8 too
    st.sampled_from([b"", b"add_sub", b"\xff\xfe", "résnet".encode()]),
)


def field_numbers(near: list[int]) -> st.SearchStrategy[int]:
    """A field number: one of `near` (the ones read), next to a limit, or any."""
    return st.one_of(
        st.sampled_from(near),
        st.sampled_from([1, 2, 3, 4, 5, 6, 7, 2**29 - 1, 2**29, 2**29 + 1, 2**61 - 1]),
        st.integers(1, 20),
    )


@st.composite
def piece(
    draw: st.DrawFn, fields: st.SearchStrategy[int], values: st.SearchStrategy[bytes]
) -> bytes:
    """One field of any wire type, well formed or not."""
    field = draw(fields)
    kind = draw(
        st.sampled_from(
            [
                "delimited",
                "delimited",
                "varint",
                "fixed64",
                "fixed32",
                "bad wire",
                "wrong length",
                "field 0",
                "wide tag",
                "bad varint",
            ]
        )
    )
    if kind == "delimited":
        return delimited(field, draw(values))
    if kind == "varint":
        return tag(field, 0) + varint(draw(ints))
    if kind == "fixed64":
        return tag(field, 1) + draw(st.binary(min_size=8, max_size=8))
    if kind == "fixed32":
        return tag(field, 5) + draw(st.binary(min_size=4, max_size=4))
    if kind == "bad wire":  # groups (3, 4) and the unused 6, 7
        return tag(field, draw(st.sampled_from([3, 4, 6, 7]))) + draw(st.binary(max_size=3))
    if kind == "wrong length":  # a length past the bytes that follow (or a wide one)
        value = draw(values)
        return (
            tag(field, 2) + varint(len(value) + draw(st.sampled_from([1, 2, 200, 2**64]))) + value
        )
    if kind == "field 0":
        return tag(0, draw(st.sampled_from([0, 2]))) + b"\x00"
    if kind == "wide tag":  # past 64 bits: its low bits may look like a small field
        return varint(1 << 64 | field << 3 | 2) + varint(1) + b"x"
    return tag(field, draw(st.sampled_from([0, 2]))) + draw(bad_varints)


# ---- InferParameter and the parameters map ---------------------------------------------------


@st.composite
def infer_parameter(draw: st.DrawFn) -> bytes:
    """An InferParameter: bool_param (1), int64 (2), string (3), double (4), uint64 (5), in any
    number, order and wire type."""
    out = []
    for i in range(draw(st.integers(0, 3))):
        if i == 0 and draw(st.booleans()):
            out.append(b"\x08" + varint(draw(st.sampled_from([0, 1, 2, 2**64]))))
            continue
        which = draw(
            st.sampled_from(
                [
                    "bool",
                    "bool",
                    "bool wide",
                    "int64",
                    "string",
                    "double",
                    "uint64",
                    "bool as string",
                    "other",
                ]
            )
        )
        if which == "bool":
            out.append(b"\x08" + varint(draw(st.sampled_from([0, 1, 2, 0x80, 2**63, 2**64]))))
        elif which == "bool wide":
            out.append(b"\x08" + varint(draw(ints)))
        elif which == "int64":
            out.append(b"\x10" + varint(draw(ints)))
        elif which == "string":
            out.append(delimited(3, draw(names)))
        elif which == "double":
            out.append(b"\x21" + draw(st.binary(min_size=8, max_size=8)))
        elif which == "uint64":
            out.append(b"\x28" + varint(draw(ints)))
        elif which == "bool as string":
            out.append(delimited(1, draw(st.binary(max_size=2))))
        else:
            out.append(draw(piece(field_numbers([1, 2]), st.binary(max_size=4))))
    return b"".join(out)


@st.composite
def map_entry(draw: st.DrawFn) -> bytes:
    """A parameters-map entry: key (1) then value (2), as serializers write it, or the value
    first, the key twice, either missing, a key that is a prefix of a read one, junk; one in
    five cut anywhere (down to nothing, or the key's tag alone)."""
    entry = draw(_map_entry())
    if draw(st.integers(0, 4)) == 0:
        return entry[: draw(st.integers(0, len(entry)))]
    return entry


@st.composite
def _map_entry(draw: st.DrawFn) -> bytes:
    exact = st.sampled_from(KEYS)
    near = st.sampled_from(KEYS).map(lambda k: k[:-1]) | exact.map(lambda k: k + b"x")
    key = draw(st.one_of(exact, exact, exact, near, names))
    shape = draw(
        st.sampled_from(
            [
                "fast",
                "fast",
                "key value",
                "value key",
                "key twice",
                "two values",
                "key only",
                "value only",
                "pieces",
            ]
        )
    )
    if shape == "fast":  # the serializers' bytes for a bool value: 0a len key 12 02 08 b
        value = draw(st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x7f", b"\x80", b"\x80\x01"]))
        tail = bytearray(b"\x12" + bytes([len(value) + 1]) + b"\x08" + value)
        if draw(st.integers(0, 2)) == 0:  # near misses: a byte of the shape changed
            for _ in range(draw(st.integers(1, 2))):
                tail[draw(st.integers(0, len(tail) - 1))] = draw(st.sampled_from(FAST_BYTES))[0]
        if draw(st.integers(0, 3)) == 0:  # a byte before it (the last maybe dropped)
            tail = bytearray(draw(st.sampled_from(FAST_BYTES))) + tail
            if draw(st.booleans()):
                del tail[-1]
        if draw(st.integers(0, 3)) == 0:  # more after it
            tail += draw(piece(field_numbers([1, 2]), st.binary(max_size=3)))
        return delimited(1, key) + bytes(tail)
    value = delimited(2, draw(infer_parameter()))
    if shape == "key value":
        return delimited(1, key) + value
    if shape == "value key":
        return value + delimited(1, key)
    if shape == "key twice":
        return delimited(1, draw(st.sampled_from(KEYS))) + value + delimited(1, key)
    if shape == "two values":
        return delimited(1, key) + value + delimited(2, draw(infer_parameter()))
    if shape == "key only":
        return delimited(1, key)
    if shape == "value only":
        return value
    return b"".join(draw(st.lists(piece(field_numbers([1, 2]), infer_parameter()), max_size=3)))


# ---- whole messages --------------------------------------------------------------------------


# A field drawn from a table: (what, weight, how its bytes are made); `what` is sampled from the
# names repeated by weight, in the table's order
FieldTable = list[tuple[str, int, Callable[[st.DrawFn], bytes]]]


def _field(draw: st.DrawFn, table: FieldTable) -> bytes:
    which = draw(st.sampled_from([what for what, weight, _ in table for _ in range(weight)]))
    return next(make for what, _, make in table if what == which)(draw)


def _named(field: int) -> Callable[[st.DrawFn], bytes]:
    return lambda draw: delimited(field, draw(names))


def _bytes(field: int, size: int) -> Callable[[st.DrawFn], bytes]:
    return lambda draw: delimited(field, draw(st.binary(max_size=size)))


def _param(draw: st.DrawFn) -> bytes:
    return delimited(4, draw(map_entry()))


def _tensor(draw: st.DrawFn) -> bytes:
    return delimited(draw(st.integers(5, 8)), draw(st.binary(max_size=6)))


def _other(fields: list[int], payload: st.SearchStrategy[bytes]) -> Callable[[st.DrawFn], bytes]:
    """Any other piece: a field of any wire type, number and length (see `piece`)."""
    return lambda draw: draw(piece(field_numbers(fields), payload))


# ModelInferRequest: model_name (1), model_version (2), id (3), parameters (4), the tensors past
# them (5..8), or any other piece
REQUEST_FIELDS: FieldTable = [
    ("model", 2, _named(1)),
    ("id", 2, _named(3)),
    ("param", 3, _param),
    ("version", 1, _named(2)),
    ("tensor", 1, _tensor),
    ("piece", 1, _other([1, 3, 4, 5], names | map_entry())),
]
# ModelInferResponse: model_name (1), id (3), parameters (4), outputs (5),
# raw_output_contents (6), any other
INNER_RESPONSE_FIELDS: FieldTable = [
    ("model", 2, _named(1)),
    ("id", 2, _named(3)),
    ("param", 3, _param),
    ("outputs", 1, _bytes(5, 4)),
    ("raw", 1, _bytes(6, 4)),
    ("piece", 1, _other([1, 3, 4, 5, 6], names | map_entry())),
]


def request_field(draw: st.DrawFn) -> bytes:
    return _field(draw, REQUEST_FIELDS)


@st.composite
def inner_response(draw: st.DrawFn) -> bytes:
    return b"".join(_field(draw, INNER_RESPONSE_FIELDS) for _ in range(draw(st.integers(0, 6))))


# ModelStreamInferResponse: error_message (1), infer_response (2), any other
RESPONSE_FIELDS: FieldTable = [
    ("error", 1, _named(1)),
    ("inner", 3, lambda draw: delimited(2, draw(inner_response()))),
    ("piece", 1, _other([1, 2, 3], names | inner_response())),
]


def response_field(draw: st.DrawFn) -> bytes:
    return _field(draw, RESPONSE_FIELDS)


def _padded(body: bytes, field: int, size: int) -> bytes:
    """`body` after a length-delimited `field` that makes the whole `size` bytes (or just over,
    where the padding field's own head does not fit)."""
    for pad in range(max(0, size - len(body) - 2), -1, -1):
        filler = delimited(field, bytes(pad))
        if len(filler) + len(body) <= size:
            return filler + body
    return body


@st.composite
def message_bodies(draw: st.DrawFn, responses: bool) -> bytes:
    """A request's or response's body of fields in any order; sometimes padded in front so that
    the body is MESSAGE_HEAD bytes give or take one, or so that the head's cut at MESSAGE_HEAD
    falls inside one of the fields (a tensor then follows, as in a real message)."""
    make = response_field if responses else request_field
    fields = [make(draw) for _ in range(draw(st.integers(0, 6)))]
    body = b"".join(fields)
    pad_field = 3 if responses else 2  # read and ignored by the scans
    size = draw(st.sampled_from(["small", "small", "at head", "cut inside"]))
    if size == "at head":
        return _padded(body, pad_field, MESSAGE_HEAD + draw(st.sampled_from([-1, 0, 1])))
    if size == "cut inside" and body:
        head = _padded(body, pad_field, MESSAGE_HEAD + draw(st.integers(0, len(body))))
        return head + delimited(draw(st.sampled_from([5, 6, 7, 2**29])), bytes(40))
    return body


@st.composite
def inner_cut_response(draw: st.DrawFn) -> bytes:
    """A response whose infer_response is cut by the head's end: its fields read as a head."""
    inner = draw(inner_response())
    pad = _padded(b"", 3, MESSAGE_HEAD - draw(st.integers(0, len(inner) + 4)))
    return pad + delimited(2, inner + delimited(5, bytes(60)))


@st.composite
def grpc_stream(
    draw: st.DrawFn, bodies: st.SearchStrategy[bytes]
) -> tuple[bytes, list[int], list[int]]:
    """One direction's DATA bytes: gRPC-framed bodies (some compressed, some with a prefix that
    lies about the size), perhaps cut inside the last; chunk sizes cutting it anywhere, inside
    prefixes too; and the body sizes, for capture limits at a message's size."""
    parts = []
    sizes = []
    for _ in range(draw(st.integers(1, 4))):
        body = draw(bodies)
        flag = 1 if draw(st.integers(0, 9)) == 0 else 0
        if draw(st.integers(0, 15)) == 0:  # flag bits other than compression
            flag |= draw(st.sampled_from([2, 0x80, 0xFE]))
        parts.append(bytes([flag]) + len(body).to_bytes(4, "big") + body)
        sizes.append(len(body))
    wire = b"".join(parts)
    if draw(st.integers(0, 3)) == 0:
        wire = wire[: draw(st.integers(0, len(wire)))]
    cuts = draw(
        st.lists(
            st.one_of(
                st.integers(1, 7),
                st.integers(1, 700),
                st.sampled_from([MESSAGE_HEAD, MESSAGE_HEAD + 3, MESSAGE_HEAD + 4, 4101]),
            ),
            max_size=12,
        )
    )
    return wire, cuts, sizes


def capture_limits(sizes: list[int]) -> st.SearchStrategy[int]:
    """A capture limit: a message's size or one either side of it, or any."""
    near = [s + d for s in sizes for d in (-1, 0, 1) if s + d >= 0]
    return (
        st.one_of(st.sampled_from(near), st.integers(0, 2 * MESSAGE_HEAD))
        if near
        else st.integers(0, 9000)
    )
