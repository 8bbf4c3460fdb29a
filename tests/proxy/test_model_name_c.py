"""The C walk's model name reading (`_framewalk.extract_model_name`) against the Python
`model_name.extract_model_name` it stands in for on every unary request's first DATA frame.

Both must give the same answer (a name, None, or NEED_MORE) on every input: real Triton and
TF-Serving request heads cut at every length, and random, corrupted and hand-built protobuf
bytes (long and truncated varints, groups, fixed-width fields, fields running past a cut or past
the message's end, compressed messages, invalid UTF-8), down nested field paths.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from sidecar.proxy.model_name import HEAD_LIMIT, NEED_MORE, extract_model_name
from tests.proxy.proxy_h2build import grpc_message
from tests.proxy.test_proxy_model_name import _varint, field_bytes, tf_predict_request
from tests.proxy.wire_strategies import delimited, examples, field_numbers, names, piece

framewalk = pytest.importorskip("sidecar.proxy._framewalk", reason="the C walker is not built")


def c_name(head: bytes, path: tuple[int, ...]) -> object:
    return framewalk.extract_model_name(head, path, NEED_MORE)


def same(head: bytes, path: tuple[int, ...]) -> object:
    expected = extract_model_name(head, path)
    got = c_name(head, path)
    assert got == expected and type(got) is type(expected), (head, path)
    return got


def test_real_heads_cut_at_every_length() -> None:
    req = service_pb2.ModelInferRequest(model_name="add_sub", id="7")
    req.raw_input_contents.append(b"\1" * 300)
    infer = grpc_message(req.SerializeToString())
    predict = grpc_message(tf_predict_request("résnet"))
    for cut in range(len(infer) + 1):
        same(infer[:cut], (1,))
    for cut in range(len(predict) + 1):
        same(predict[:cut], (1, 1))
    assert c_name(infer, (1,)) == "add_sub"
    assert c_name(predict, (1, 1)) == "résnet"
    assert c_name(bytearray(predict), (1, 1)) == "résnet"  # the walk's head is a bytearray


# protobuf pieces, most of them well formed, some not
_pieces = st.one_of(
    st.builds(lambda f, b: field_bytes(f, b), st.integers(0, 40), st.binary(max_size=30)),
    st.builds(lambda f, v: _varint(f << 3) + _varint(v), st.integers(0, 40), st.integers(0, 2**70)),
    st.builds(
        lambda f, w: _varint(f << 3 | w), st.integers(0, 2**62), st.sampled_from([1, 5, 3, 4])
    ),
    st.builds(lambda n: _varint(n), st.integers(0, 2**75)),  # a bare varint (maybe a long tag)
    st.just(b"\xff" * 11),  # a varint too long
    st.binary(max_size=8),
)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    body = b"".join(draw(st.lists(_pieces, max_size=6)))
    if draw(st.booleans()):  # the name field nested once or twice, maybe not valid UTF-8
        name = draw(st.binary(max_size=12) | st.text(max_size=6).map(str.encode))
        inner = field_bytes(draw(st.sampled_from([1, 2])), name)
        if draw(st.booleans()):
            inner = field_bytes(1, inner)
        body = inner + body if draw(st.booleans()) else body + inner
    head = grpc_message(body, compressed=draw(st.integers(0, 9)) == 0)
    if draw(st.booleans()):  # a wrong size in the prefix (the message cut or longer)
        head = head[:1] + draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big") + head[5:]
    if draw(st.booleans()):  # cut anywhere
        head = head[: draw(st.integers(0, len(head)))]
    return head


@settings(max_examples=examples(3000), deadline=None)
@given(
    messages(),
    st.sampled_from([(1,), (1, 1), (2,), (1, 2), (1, 1, 1), (0,), (2**60,), (3, 1)]),
)
def test_random_and_corrupted_messages(head: bytes, path: tuple[int, ...]) -> None:
    same(head, path)


@settings(max_examples=examples(500), deadline=None)
@given(st.binary(max_size=HEAD_LIMIT + 20), st.sampled_from([(1,), (1, 1)]))
def test_random_bytes(head: bytes, path: tuple[int, ...]) -> None:
    same(head, path)


def test_paths_it_does_not_read_are_refused() -> None:
    for path in [(), (-1,), (2**61,), tuple([1] * 9), [1], (1.0,), 1]:
        with pytest.raises(ValueError):
            c_name(grpc_message(b""), path)  # type: ignore[arg-type]
    deepest = tuple([1] * 8)  # the deepest path it reads
    nested = b"m"
    for _ in deepest:  # field 1 inside field 1, eight deep
        nested = field_bytes(1, nested)
    head = grpc_message(nested)
    assert same(head, deepest) == "m"


def test_a_message_size_is_read_from_all_four_prefix_bytes() -> None:
    """Whether the head holds the whole message (no name: None) or not yet (NEED_MORE)
    turns on the size in the 5-byte prefix: sizes past 64 KiB and 16 MiB, where each of its
    four bytes counts, the head exactly the message or one byte short of it."""
    for size in (0x01_02_03, 0x01_00_02_03 + 7):
        tag = b"\x12" + _varint(size - 1 - len(_varint(size)))  # field 2: not the name
        body = tag + b"x" * (size - len(tag))
        assert len(body) == size
        message = grpc_message(body)
        assert same(message, (1,)) is None
        assert same(message[:-1], (1,)) is NEED_MORE


def test_a_tag_beyond_64_bits_is_not_a_small_field_number() -> None:
    """Its low 64 bits say field 1, length-delimited; Python's unbounded ints do not."""
    tag = _varint(1 << 64 | 1 << 3 | 2)
    head = grpc_message(tag + b"\x03abc" + field_bytes(1, b"real"))
    assert same(head, (1,)) == "real"


@st.composite
def built_heads(draw: st.DrawFn) -> tuple[bytes, tuple[int, ...]]:
    """A request head built field by field down a model path: the path's fields among others
    of every wire type (well formed or not), repeated, in any order, the name maybe not
    UTF-8; the prefix's size the body's or one either side; maybe compressed; maybe cut."""
    path = draw(st.sampled_from([(1,), (1, 1), (2,), (1, 2), (3, 1)]))

    def level(depth: int) -> bytes:
        target = path[depth] if depth < len(path) else 1
        others = piece(field_numbers([target, target + 1]), names)
        parts = [draw(others) for _ in range(draw(st.integers(0, 3)))]
        for _ in range(draw(st.integers(1, 2)) if depth < len(path) else 0):
            inner = level(depth + 1) if depth + 1 < len(path) else draw(names)
            parts.insert(draw(st.integers(0, len(parts))), delimited(target, inner))
        return b"".join(parts)

    body = level(0)
    size = max(0, len(body) + draw(st.sampled_from([0, 0, 0, -1, 1, 1000])))
    flag = draw(st.sampled_from([0, 0, 0, 1, 2]))
    head = bytes([flag]) + size.to_bytes(4, "big") + body
    if draw(st.booleans()):
        head = head[: draw(st.integers(0, len(head)))]
    return head, path


@settings(max_examples=examples(1500), deadline=None)
@given(built_heads())
def test_heads_built_down_the_path(case: tuple[bytes, tuple[int, ...]]) -> None:
    same(*case)


def test_extract_model_name_checks_its_arguments_and_releases_the_head() -> None:
    """Three arguments, else TypeError; the head's buffer is released after each read (a
    bytearray can then grow again), found or not."""
    with pytest.raises(TypeError, match="extract_model_name"):
        framewalk.extract_model_name(b"", (1,))
    with pytest.raises(TypeError):
        c_name(object(), (1,))  # type: ignore[arg-type]
    req = service_pb2.ModelInferRequest(model_name="add_sub")
    for head in (bytearray(grpc_message(req.SerializeToString())), bytearray(b"\0\0")):
        c_name(head, (1,))
        head.append(0)  # BufferError while the read still holds it
