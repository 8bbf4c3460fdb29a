"""The C message walker (`_messagewalk.c`) against the pure-Python readers it accelerates.

Both read the same bytes cut into the same random chunks and must return exactly the same
tuples after every chunk, and agree on `mid_message` and `copying`: on random `ModelInferRequest` /
`ModelStreamInferResponse` messages built with tritonclient's `service_pb2` (ids, the final
flags, other parameters, tensors past the kept head), on the same messages corrupted (bytes
flipped, cut short, random bytes, compressed), on streams cut inside a message, and with a
`pick` hook that keeps some messages whole.
"""

from __future__ import annotations

import gc
import itertools
import sys
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from sidecar.proxy import stream_messages
from sidecar.proxy.stream_messages import (
    ENABLE_FINAL,
    FINAL,
    MESSAGE_HEAD,
    RequestReader,
    RequestReading,
    ResponseReader,
    ResponseReading,
)
from tests.proxy.native_lifetimes import tracked_while_freed
from tests.proxy.proxy_h2build import grpc_message
from tests.proxy.wire_strategies import (
    capture_limits,
    delimited,
    examples,
    grpc_stream,
    inner_cut_response,
    map_entry,
    message_bodies,
    names,
)

native = stream_messages.native_readers
pytestmark = pytest.mark.skipif(native is None, reason="the C message walker is not built here")

texts = st.text(max_size=20)
param_values = st.one_of(
    st.booleans().map(lambda v: ("bool_param", v)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: ("int64_param", v)),
    texts.map(lambda v: ("string_param", v)),
)
param_keys = st.one_of(
    st.sampled_from(["triton_enable_empty_final_response", "triton_final_response"]), texts
)
params = st.dictionaries(param_keys, param_values, max_size=3)
tensor_sizes = st.one_of(st.integers(0, 64), st.integers(MESSAGE_HEAD - 100, MESSAGE_HEAD + 200))


def _set_params(target: object, values: dict[str, tuple[str, object]]) -> None:
    for key, (kind, value) in values.items():
        setattr(target[key], kind, value)  # type: ignore[index]


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    req = service_pb2.ModelInferRequest(model_name=draw(texts), id=draw(texts))
    _set_params(req.parameters, draw(params))
    size = draw(tensor_sizes)
    req.inputs.add(name="INPUT0", datatype="UINT8", shape=[size])
    req.raw_input_contents.append(bytes(size))
    return req.SerializeToString()


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    resp = service_pb2.ModelStreamInferResponse(error_message=draw(texts))
    inner = resp.infer_response
    inner.model_name = draw(texts)
    inner.id = draw(texts)
    _set_params(inner.parameters, draw(params))
    for i in range(draw(st.integers(0, 2))):
        size = draw(tensor_sizes)
        inner.outputs.add(name=f"OUT{i}", datatype="UINT8", shape=[size])
        inner.raw_output_contents.append(bytes(size))
    return resp.SerializeToString()


@st.composite
def damaged(draw: st.DrawFn, message: bytes) -> bytes:
    """The message unchanged, with bytes flipped, cut short, or random bytes instead."""
    how = draw(st.sampled_from(["intact", "intact", "flip", "cut", "random"]))
    if how == "flip" and message:
        body = bytearray(message)
        for _ in range(draw(st.integers(1, 4))):
            body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        return bytes(body)
    if how == "cut":
        return message[: draw(st.integers(0, len(message)))]
    if how == "random":
        return draw(st.binary(max_size=60))
    return message


@st.composite
def streams(draw: st.DrawFn, messages: st.SearchStrategy[bytes]) -> tuple[bytes, list[int]]:
    """Framed (sometimes compressed) messages, possibly cut inside the last, and chunk sizes."""
    wire = b"".join(
        grpc_message(draw(damaged(draw(messages))), compressed=draw(st.integers(0, 9)) == 0)
        for _ in range(draw(st.integers(1, 5)))
    )
    if draw(st.booleans()):
        wire = wire[: draw(st.integers(0, len(wire)))]  # the stream ends inside a message
    cuts = draw(st.lists(st.integers(1, 700), max_size=20))
    return wire, cuts


class Pick:
    """A pick hook that answers from a fixed list of (token, keep) or None, in turn."""

    def __init__(self, answers: list[tuple[object, bool] | None]) -> None:
        self.answers = answers
        self.asked: list[int] = []

    def __call__(self, size: int) -> tuple[object, bool] | None:
        self.asked.append(size)
        return self.answers[len(self.asked) % len(self.answers)]


answers = st.lists(
    st.one_of(st.none(), st.tuples(st.sampled_from(["tok", None, 7]), st.booleans())),
    min_size=1,
    max_size=5,
)


def read_all(reader: RequestReading | ResponseReading, wire: bytes, cuts: list[int]) -> list:
    """Each chunk's reads and the reader's mid_message (and copying) after it."""
    out = []
    pos = 0
    for cut in [*cuts, len(wire)]:
        read = reader.read(wire[pos : pos + cut])
        out.append((read, reader.mid_message, getattr(reader, "copying", None)))
        pos += cut
        if pos >= len(wire):
            break
    return out


# -- fixed inputs first (quick to fail) ------------------------------------------------------


def test_every_entry_near_the_fast_path_reads_the_same() -> None:
    """Every parameters entry `0a len key` + the fast path's `12 02 08 b` with up to two of
    its bytes changed to one of those the fast path tests or a neighbour (one either side),
    or shifted by a byte, for both keys, in requests and responses; a field follows each
    entry (a byte the fast path must not read)."""
    assert native is not None
    alphabet = [0x12, 0x11, 0x13, 0x02, 0x01, 0x03, 0x08, 0x07, 0x09, 0x1A, 0x00, 0x7F, 0x80]
    tails = set()
    for last in (0x00, 0x01, 0x7F, 0x80):
        shape = [0x12, 0x02, 0x08, last]
        tails.add(bytes(shape))
        for i, j in itertools.combinations(range(4), 2):
            for a, b in itertools.product(alphabet, repeat=2):
                changed = list(shape)
                changed[i], changed[j] = a, b
                tails.add(bytes(changed))
        for first in alphabet:
            tails.add(bytes([first, *shape[:3]]))
            tails.add(bytes([first, *shape]))
        tails.add(bytes(shape[:3]))
    for key in (ENABLE_FINAL, FINAL):
        entries = [
            delimited(4, delimited(1, key) + tail) + delimited(1, b"m") for tail in sorted(tails)
        ]
        requests = b"".join(grpc_message(entry) for entry in entries)
        responses = b"".join(grpc_message(delimited(2, entry)) for entry in entries)
        assert native[0]().read(requests) == RequestReader().read(requests)
        assert native[1]().read(responses) == ResponseReader().read(responses)


def test_the_last_occurrence_wins_as_in_protobuf() -> None:
    """Issue 44's survivors, by value: a repeated model name or id (the last wins), the
    capture limit (a message of exactly the limit is kept), raw_output_contents (field 6)
    as the first field past the parameters (an output)."""
    assert native is not None
    body = delimited(1, b"a") + delimited(3, b"1") + delimited(1, b"b") + delimited(3, b"2")
    wire = grpc_message(body)
    for reader in (RequestReader(), native[0]()):
        reader.capture_limit = len(body)
        reader.pick = lambda size: ("t", True)
        assert reader.read(wire) == [(len(wire), "t", body, "b", "2", False)]
        reader.capture_limit = len(body) - 1
        assert reader.read(wire) == [(len(wire), "t", None, "b", "2", False)]
    inner = delimited(1, b"a") + delimited(3, b"1")
    twice = grpc_message(delimited(2, inner) + delimited(2, delimited(1, b"b") + delimited(6, b"")))
    for response in (ResponseReader(), native[1]()):
        assert response.read(twice) == [(len(twice), "", "b", "1", None, True)]


class Untrue:
    def __bool__(self) -> bool:
        raise ArithmeticError("no truth")


def test_what_pick_may_answer() -> None:
    """None, or a 2-tuple (token, keep): anything else is a TypeError in C; keep's truth is
    asked as Python asks it (its exception propagates from both); a None token is None."""
    assert native is not None
    wire = grpc_message(b"\x0a\x01a")
    for answer in ([1, True], (1, True, 0), 7.5):
        walker = native[0]()
        walker.pick = lambda size, answer=answer: answer
        held = sys.getrefcount(answer)
        with pytest.raises(TypeError):
            walker.read(wire)
        assert sys.getrefcount(answer) == held  # the answer is released on the error path
    untrue = ("t", Untrue())
    for reader in (RequestReader(), native[0]()):
        reader.pick = lambda size: untrue
        with pytest.raises(ArithmeticError):
            reader.read(wire)
        held = sys.getrefcount(untrue)
        with pytest.raises(ArithmeticError):
            reader.read(wire)
        assert sys.getrefcount(untrue) == held
        reader.pick = lambda size: (None, True)
        reader.capture_limit = 10
        assert reader.read(wire) == [(len(wire), None, wire[5:], "a", "", False)]
    for walker_type in native:
        with pytest.raises(TypeError):
            walker_type(1)
        with pytest.raises(TypeError):
            walker_type(pick=None)


def test_reads_what_protobuf_wrote() -> None:
    """The walker's own fields of known messages (not only agreement with the reference)."""
    assert native is not None
    req = service_pb2.ModelInferRequest(model_name="add_sub", id="r1")
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    resp = service_pb2.ModelStreamInferResponse(error_message="")
    resp.infer_response.model_name = "add_sub"
    resp.infer_response.id = "r1"
    resp.infer_response.parameters["triton_final_response"].bool_param = True
    resp.infer_response.outputs.add(name="OUT", datatype="FP32", shape=[1])
    request_wire = grpc_message(req.SerializeToString())
    walker = native[0]()
    walker.capture_limit = 1 << 20
    walker.pick = lambda size: ("token", True)
    assert walker.read(request_wire) == [
        (len(request_wire), "token", request_wire[5:], "add_sub", "r1", True)
    ]
    response_wire = grpc_message(resp.SerializeToString())
    assert native[1]().read(response_wire) == [
        (len(response_wire), "", "add_sub", "r1", True, True)
    ]
    cut = native[1]()
    assert cut.read(response_wire[:7]) == [] and cut.mid_message
    assert native[1]().read(grpc_message(b"\x0a\x05ab")) == [(9, "", None, "", None, False)]


def _leak_wires() -> list[tuple[bytes, list[int]]]:
    """Requests and responses that take every path of the walker (whole, split, kept, empty,
    compressed, unreadable, past the head), with sizes past the small ints CPython caches."""
    name = delimited(1, b"model-" + bytes(300)) + delimited(3, b"id" * 150)
    param = delimited(4, delimited(1, b"triton_enable_empty_final_response") + b"\x12\x02\x08\x01")
    final = delimited(4, delimited(1, b"triton_final_response") + delimited(2, b"\x08\x01"))
    big = delimited(7, bytes(MESSAGE_HEAD + 300))
    bodies = [
        name + param,
        b"",
        delimited(1, b"") + delimited(3, b""),
        name + big,
        b"\x07\x07" + bytes(300),  # unreadable
        delimited(1, b"") + delimited(2, name + final + delimited(5, b"")),
        delimited(2, name + final + big),
    ]
    wire = b"".join(grpc_message(b) for b in bodies) + grpc_message(name, compressed=True)
    cut = wire + grpc_message(big)[:-7]  # the walker dropped inside a message it copies
    return [(wire, []), (wire, [3, 2, 700, 1, 5000, 4]), (cut, [6000])]


def test_reads_leak_no_references() -> None:
    """Reading does not leak or over-release references: the shared singletons' counts end
    where they began, and thousands of reads keep no memory (tokens, names, kept messages)."""
    assert native is not None
    shared = (None, True, False, "")

    def pick(size: int) -> tuple[object, bool] | None:
        if size % 3 == 0:
            return None
        return ([size], size % 2 == 0)  # a fresh token each time

    def run(times: int) -> None:
        for _ in range(times):
            for wire, cuts in _leak_wires():
                request = native[0]()
                request.capture_limit = 1 << 20
                request.pick = pick
                read_all(request, wire, cuts)
                read_all(native[1](), wire, cuts)

    run(5)
    gc.collect()
    before = [sys.getrefcount(x) for x in (*shared, pick)]
    tracemalloc.start()
    try:
        run(5)
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        run(300)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    after = [sys.getrefcount(x) for x in (*shared, pick)]
    assert after[-1] == before[-1]
    assert all(abs(a - b) < 50 for a, b in zip(after, before, strict=True)), (before, after)
    assert grown < 64 * 1024, grown


# -- random inputs ----------------------------------------------------------------------------


@settings(max_examples=examples(400), deadline=None)
@given(stream=streams(requests()), picks=st.one_of(st.none(), answers), limit=st.integers(0, 5000))
def test_requests_read_the_same(
    stream: tuple[bytes, list[int]], picks: list | None, limit: int
) -> None:
    assert native is not None
    wire, cuts = stream
    readers: list[RequestReading] = [RequestReader(), native[0]()]
    hooks = []
    for reader in readers:
        reader.capture_limit = limit
        if picks is not None:
            hook = Pick(picks)
            hooks.append(hook)
            reader.pick = hook
    python, c = (read_all(reader, wire, cuts) for reader in readers)
    assert c == python
    if hooks:
        assert hooks[0].asked == hooks[1].asked


@settings(max_examples=examples(400), deadline=None)
@given(stream=streams(responses()))
def test_responses_read_the_same(stream: tuple[bytes, list[int]]) -> None:
    assert native is not None
    wire, cuts = stream
    readers: list[ResponseReading] = [ResponseReader(), native[1]()]
    python, c = (read_all(reader, wire, cuts) for reader in readers)
    assert c == python


@settings(max_examples=examples(300), deadline=None)
@given(body=st.binary(max_size=80), cuts=st.lists(st.integers(1, 40), max_size=5))
def test_random_bytes_read_the_same(body: bytes, cuts: list[int]) -> None:
    assert native is not None
    wire = grpc_message(body)
    for python, c in ((RequestReader(), native[0]()), (ResponseReader(), native[1]())):
        assert read_all(c, wire, cuts) == read_all(python, wire, cuts)


def read_both(
    readers: list, wire: bytes, cuts: list[int]
) -> None:  # the C walker reads as the Python reader does, after every chunk
    python, c = (read_all(reader, wire, cuts) for reader in readers)
    assert c == python


@settings(max_examples=examples(600), deadline=None)
@given(data=st.data(), stream=grpc_stream(message_bodies(responses=False)), picks=answers)
def test_built_requests_read_the_same(
    data: st.DataObject, stream: tuple[bytes, list[int], list[int]], picks: list
) -> None:
    """Requests built field by field: repeated and out-of-order fields, every wire type, map
    entries in any order, heads cut inside a field, a capture limit at a message's size."""
    assert native is not None
    wire, cuts, sizes = stream
    limit = data.draw(capture_limits(sizes))
    readers: list[RequestReading] = [RequestReader(), native[0]()]
    hooks = [Pick(picks), Pick(picks)]
    for reader, hook in zip(readers, hooks, strict=True):
        reader.capture_limit = limit
        reader.pick = hook
    read_both(readers, wire, cuts)
    assert hooks[0].asked == hooks[1].asked


@settings(max_examples=examples(600), deadline=None)
@given(stream=grpc_stream(message_bodies(responses=True) | inner_cut_response()))
def test_built_responses_read_the_same(stream: tuple[bytes, list[int], list[int]]) -> None:
    """Responses built field by field, infer_response repeated, cut, or holding any piece."""
    assert native is not None
    wire, cuts, _ = stream
    read_both([ResponseReader(), native[1]()], wire, cuts)


@settings(max_examples=examples(500), deadline=None)
@given(
    entries=st.lists(map_entry(), min_size=1, max_size=4),
    model=names,
    cuts=st.lists(st.integers(1, 30), max_size=4),
)
def test_parameter_entries_read_the_same(
    entries: list[bytes], model: bytes, cuts: list[int]
) -> None:
    """Messages of parameters-map entries alone (the final flags' fast path and its edges)."""
    assert native is not None
    params = b"".join(delimited(4, entry) for entry in entries)
    request = grpc_message(delimited(1, model) + params)
    response = grpc_message(delimited(2, params + delimited(1, model) + delimited(6, b"")))
    read_both([RequestReader(), native[0]()], request, cuts)
    read_both([ResponseReader(), native[1]()], response, cuts)


def test_a_pick_that_raises_stops_the_read() -> None:
    """The hook's exception reaches the caller from both readers."""
    assert native is not None

    def pick(size: int) -> None:
        raise LookupError(size)

    for reader in (RequestReader(), native[0]()):
        reader.pick = pick
        with pytest.raises(LookupError):
            reader.read(grpc_message(b"\x0a\x01a") * 2)


def test_a_read_releases_the_chunk_and_a_failed_one_what_it_read() -> None:
    """A read releases the chunk; one that fails (here: the hook raises at the second message)
    also the messages it had read before the failure (the first one's token)."""
    assert native is not None
    token = object()
    chunk = grpc_message(b"\x0a\x01a") * 2
    asked: list[int] = []

    def pick(size: int) -> tuple[object, bool]:
        if asked:
            raise LookupError(size)
        asked.append(size)
        return token, False

    for walker_type in native:
        walker = walker_type()
        walker.pick = pick
        asked.clear()
        held = sys.getrefcount(chunk), sys.getrefcount(token)
        with pytest.raises(LookupError):
            walker.read(chunk)
        assert (sys.getrefcount(chunk), sys.getrefcount(token)) == held
        walker.pick = None
        assert len(walker.read(chunk)) == 2
        assert sys.getrefcount(chunk) == held[0]


def test_a_walker_dropped_mid_message_releases_what_it_holds() -> None:
    """A walker freed inside a message it copies releases the message's token and the bytes it
    was copying the message into (1 MiB here)."""
    assert native is not None
    token = object()
    for walker_type in native:
        tracemalloc.start()
        try:
            walker = walker_type()
            walker.pick = lambda size: (token, True)
            walker.capture_limit = 1 << 20
            held = sys.getrefcount(token)
            assert walker.read(grpc_message(bytes(1 << 20))[:50]) == []
            assert walker.copying and sys.getrefcount(token) == held + 1
            del walker
            gc.collect()
            assert sys.getrefcount(token) == held
            assert tracemalloc.get_traced_memory()[0] < 1 << 16
        finally:
            tracemalloc.stop()


def test_a_walker_leaves_the_collector_before_it_drops_its_references() -> None:
    """Code its references run when freed (a `__del__`) may run the cycle collector: the walker
    being freed must not be among the objects it tracks (it would free it a second time)."""
    assert native is not None

    def with_pick(walker_type: Any) -> Any:
        def make(watcher: Any) -> Any:
            walker = walker_type()
            walker.pick = watcher
            return walker

        return make

    assert [tracked_while_freed(with_pick(t)) for t in native] == [[False], [False]]


def test_a_prefix_gives_its_size_from_all_four_bytes() -> None:
    """The size `pick` is asked at a prefix, past 64 KiB and 16 MiB (no stream in the other
    tests is that long): each of the prefix's four size bytes counts, in C as in Python."""
    assert native is not None
    for size in (0x01020304, 0x00010203, 0x7F000000, 0x0000FF01, 0x00800000):
        prefix = b"\x00" + size.to_bytes(4, "big")
        for reader in (RequestReader(), ResponseReader(), native[0](), native[1]()):
            reader.pick = pick = Pick([None])
            assert reader.read(prefix + b"abc") == []
            assert pick.asked == [size] and reader.mid_message
