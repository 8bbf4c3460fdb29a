"""The stream message scan against protobuf's own decoding (`service_pb2`) of random messages."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from sidecar.proxy.stream_messages import (
    MESSAGE_HEAD,
    MessageSplitter,
    read_request,
    read_response,
)
from tests.proxy.proxy_h2build import grpc_message

texts = st.text(max_size=40)
param_values = st.one_of(
    st.booleans().map(lambda v: ("bool_param", v)),
    st.integers(-(2**40), 2**40).map(lambda v: ("int64_param", v)),
    texts.map(lambda v: ("string_param", v)),
)
param_keys = st.one_of(
    st.sampled_from(["triton_enable_empty_final_response", "triton_final_response"]), texts
)
params = st.dictionaries(param_keys, param_values, max_size=4)


def _set_params(target: object, values: dict[str, tuple[str, object]]) -> None:
    for key, (kind, value) in values.items():
        setattr(target[key], kind, value)  # type: ignore[index]


@settings(max_examples=300, deadline=None)
@given(model=texts, ident=texts, values=params, tensor=st.integers(0, 3000))
def test_request_fields_match_protobuf(
    model: str, ident: str, values: dict[str, tuple[str, object]], tensor: int
) -> None:
    req = service_pb2.ModelInferRequest(model_name=model, id=ident)
    _set_params(req.parameters, values)
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[tensor])
    req.raw_input_contents.append(np.zeros(tensor, np.float32).tobytes())
    wire = req.SerializeToString()
    fields = read_request(wire[:MESSAGE_HEAD], len(wire) <= MESSAGE_HEAD)
    parsed = service_pb2.ModelInferRequest.FromString(req.SerializeToString())
    flag = parsed.parameters.get("triton_enable_empty_final_response")
    assert fields.model == parsed.model_name
    assert fields.id == parsed.id
    asked = flag is not None and flag.WhichOneof("parameter_choice") == "bool_param"
    assert fields.final_flag_asked == (asked and flag.bool_param)


@settings(max_examples=300, deadline=None)
@given(error=texts, model=texts, ident=texts, values=params, outputs=st.integers(0, 2))
def test_response_fields_match_protobuf(
    error: str, model: str, ident: str, values: dict[str, tuple[str, object]], outputs: int
) -> None:
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    inner = resp.infer_response
    inner.model_name = model
    inner.id = ident
    _set_params(inner.parameters, values)
    for i in range(outputs):
        inner.outputs.add(name=f"OUT{i}", datatype="INT32", shape=[1])
        inner.raw_output_contents.append(np.array([i], np.int32).tobytes())
    parsed = service_pb2.ModelStreamInferResponse.FromString(resp.SerializeToString())
    fields = read_response(resp.SerializeToString())
    assert fields.error == parsed.error_message
    assert fields.model == parsed.infer_response.model_name
    assert fields.id == parsed.infer_response.id
    flag = parsed.infer_response.parameters.get("triton_final_response")
    if flag is None:
        assert fields.final is None
    elif flag.WhichOneof("parameter_choice") == "bool_param":
        assert fields.final is flag.bool_param
    else:
        assert fields.final is False
    assert fields.has_outputs == bool(parsed.infer_response.outputs)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * MESSAGE_HEAD), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 5000), max_size=30),
)
def test_splitter_cuts_messages_anywhere(sizes: list[int], cuts: list[int]) -> None:
    bodies = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    wire = b"".join(grpc_message(body) for body in bodies)
    splitter = MessageSplitter()
    got = []
    pos = 0
    for cut in [*cuts, len(wire)]:
        got += splitter.feed(wire[pos : pos + cut])
        pos += cut
        if pos >= len(wire):
            break
    assert [m.size for m in got] == [len(b) + 5 for b in bodies]
    assert [m.head for m in got] == [b[:MESSAGE_HEAD] for b in bodies]
    assert not splitter.mid_message
    assert not any(m.compressed for m in got)


def test_splitter_one_message_per_chunk_and_empty_messages() -> None:
    splitter = MessageSplitter()
    small, big = b"\x0a\x01m", bytes(MESSAGE_HEAD + 10)
    got = [m for body in (small, b"", big, small) for m in splitter.feed(grpc_message(body))]
    assert [(m.head, m.size, m.complete) for m in got] == [
        (small, 8, True),
        (b"", 5, True),
        (big[:MESSAGE_HEAD], MESSAGE_HEAD + 15, False),
        (small, 8, True),
    ]
    assert splitter.feed(grpc_message(small, compressed=True))[0].compressed
