"""HPACK for the relay, against the `hpack` library as the peers: decoding blocks in step with
a real encoder, injected fields that leave both dynamic tables alone, skimmed oversize blocks."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hpack import Decoder, Encoder

from sidecar.proxy.frames import ScanError
from sidecar.proxy.headers import (
    SKIM_STRING_LIMIT,
    HeaderDecoder,
    RawHeaders,
    encode_literal_without_indexing,
)

Fields = list[tuple[bytes, bytes]]


def request(model: bytes, extra: Sequence[tuple[bytes, bytes]] = ()) -> Fields:
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
        (b":authority", b"triton:8001"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"x-model-hint", model),
        *extra,
    ]


def path_of(headers: RawHeaders) -> bytes:
    return dict(headers)[b":path"]


def decoder() -> HeaderDecoder[bytes]:
    return HeaderDecoder(path_of)


def test_blocks_decode_in_step_with_the_encoder_and_repeat_from_the_cache() -> None:
    client, relay = Encoder(), decoder()
    for round_ in range(3):
        for model in (b"resnet", b"bert", b"resnet"):
            fields = request(model, [(b"x-round", str(round_).encode())])
            block = client.encode(fields)
            headers, summary = relay.decode(block)
            assert headers == fields
            assert summary == b"/inference.GRPCInferenceService/ModelInfer"
    # the table is warm: the same fields now encode to one fully indexed block, every time
    block = client.encode(request(b"resnet"))
    assert client.encode(request(b"resnet")) == block
    first, second = relay.decode(block), relay.decode(block)
    assert first == second and first[0] == request(b"resnet")


def test_responses_and_their_trailers_share_the_table() -> None:
    server, relay = Encoder(), HeaderDecoder(lambda headers: dict(headers).get(b"grpc-status"))
    response = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    trailers = [(b"grpc-status", b"5"), (b"grpc-message", b"model 'x' not found")]
    for _ in range(3):
        assert relay.decode(server.encode(response)) == (response, None)
        assert relay.decode(server.encode(trailers)) == (trailers, b"5")
    ok = [(b"grpc-status", b"0")]
    assert relay.decode(server.encode(ok)) == (ok, b"0")


def test_an_injected_traceparent_leaves_both_tables_in_step() -> None:
    client, relay, backend = Encoder(), decoder(), Decoder()
    traceparent = ("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
    for i in range(20):
        fields = request(f"model-{i % 4}".encode(), [(b"x-request-id", str(i).encode())])
        block = client.encode(fields)
        assert relay.decode(block)[0] == fields
        if i % 2:  # sampled: the relay appends the field to the client's block
            block += encode_literal_without_indexing([traceparent])
            fields = [*fields, (b"traceparent", traceparent[1].encode())]
        assert backend.decode(block, raw=True) == fields
        assert backend.header_table.dynamic_entries == client.header_table.dynamic_entries


def test_literal_without_indexing_encoding() -> None:
    long_value = "v" * 300  # a length past the 7-bit prefix
    fields: list[tuple[str | bytes, str | bytes]] = [
        ("traceparent", "00-1-2-01"), (b"x-bin", b"\x00\xff"), ("x-long", long_value),
    ]  # fmt: skip
    encoded = encode_literal_without_indexing(fields)
    peer = Decoder()
    decoded = peer.decode(encoded, raw=True)
    assert decoded == [(b"traceparent", b"00-1-2-01"), (b"x-bin", b"\x00\xff"),
                       (b"x-long", long_value.encode())]  # fmt: skip
    assert len(peer.header_table.dynamic_entries) == 0
    assert encoded[0] == 0x00  # RFC 7541 6.2.2, new name
    for bad in [("Traceparent", "x"), ("", "x")]:
        with pytest.raises(ValueError, match="lowercase"):
            encode_literal_without_indexing([bad])


def test_an_undecodable_block_raises_scan_error_and_reset_recovers() -> None:
    client, relay = Encoder(), decoder()
    assert relay.decode(client.encode(request(b"a")))[0] == request(b"a")
    with pytest.raises(ScanError) as info:
        relay.decode(b"\xff\xff\xff\xff\xff\xff")  # an index far past any table
    assert info.value.reason == "hpack"
    relay.reset()
    # entries the peer added before the reset are gone: a block using them cannot be decoded
    with pytest.raises(ScanError):
        relay.decode(client.encode(request(b"a")))
    # a fresh peer (or entries added from now on) decodes exactly
    fresh = Encoder()
    for model in (b"b", b"c", b"b"):
        assert relay.decode(fresh.encode(request(model)))[0] == request(model)


def test_table_size_updates_follow_the_acknowledged_setting() -> None:
    client, relay = Encoder(), decoder()
    assert relay.table_size == 4096
    relay.decode(client.encode(request(b"a")))
    client.header_table_size = 256  # the encoder announces the smaller table in its next block
    relay.set_max_table_size(256)
    assert relay.decode(client.encode(request(b"b")))[0] == request(b"b")
    assert relay.table_size == 256
    client.header_table_size = 8192  # more than the receiving peer allowed
    with pytest.raises(ScanError):
        relay.decode(client.encode(request(b"c")))


def _oversize_block(client: Encoder, size: int) -> tuple[Fields, bytes]:
    fields = request(b"huge", [(b"x-small-1", b"one"), (b"x-payload", b"p" * size),
                               (b"x-small-2", b"two")])  # fmt: skip
    return fields, client.encode(fields, huffman=False)


@pytest.mark.parametrize("size", [3000, 5000, SKIM_STRING_LIMIT + 10])
def test_an_oversize_block_is_skimmed_and_the_table_stays_in_step(size: int) -> None:
    client, relay = Encoder(), decoder()
    assert relay.decode(client.encode(request(b"warm")))[0] == request(b"warm")
    _, block = _oversize_block(client, size)
    skimmer = relay.skimmer()
    rng = random.Random(size)
    pos = 0
    while pos < len(block):  # fed as frames arrive: pieces of any size
        step = rng.randint(1, 700)
        skimmer.feed(block[pos : pos + step])
        pos += step
    assert skimmer.complete
    # the next blocks refer to what the skimmed block added (or evicted): they decode exactly
    for model in (b"huge", b"warm", b"next"):
        fields = request(model, [(b"x-small-1", b"one"), (b"x-small-2", b"two")])
        assert relay.decode(client.encode(fields))[0] == fields


@pytest.mark.parametrize(
    "block",
    [
        b"\x82\xbe",  # an indexed field: the static :method GET, then dynamic entry 62
        b"\x7f\x00\x01v",  # a literal added under the name of dynamic entry 63
    ],
)
def test_a_skimmed_block_that_refers_to_a_missing_entry_fails(block: bytes) -> None:
    skimmer = decoder().skimmer()  # its table is empty
    skimmer.feed(block)
    assert skimmer.failed and not skimmer.complete


def test_a_skimmed_block_cut_inside_a_field_is_not_complete() -> None:
    client, relay = Encoder(), decoder()
    _, block = _oversize_block(client, 3000)
    skimmer = relay.skimmer()
    skimmer.feed(block[:-2])
    assert not skimmer.failed and not skimmer.complete
