"""The pending table of one inference stream, fed real Triton messages (built with
`service_pb2`) in the byte chunks the relay hands it.

Every test runs twice: with the C message walker (`sidecar/proxy/_messagewalk.c`) and with the
pure-Python readers alone (`stream_messages.native_readers = None`), the fallback where it is
not built."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2

from sidecar.proxy import stream_messages
from sidecar.proxy.inferences import StreamInferences
from sidecar.proxy.metrics import ProxyMetrics
from tests.harness.metrics_text import exemplars, scrape_registry, with_protocol
from tests.proxy.proxy_h2build import grpc_message

METHOD = "ModelStreamInfer"


@pytest.fixture(autouse=True, params=["c-walker", "pure-python"])
def message_walk(request: pytest.FixtureRequest) -> Iterator[str]:
    built = stream_messages.native_readers
    if request.param == "c-walker" and built is None:
        pytest.skip("the C message walker is not built here (no C compiler at install time)")
    if request.param == "pure-python":
        stream_messages.native_readers = None
    yield request.param
    stream_messages.native_readers = built


def request(model: str, ident: str = "", ask_final: bool = False) -> bytes:
    req = service_pb2.ModelInferRequest(model_name=model, id=ident)
    req.inputs.add(name="INPUT0", datatype="INT32", shape=[1])
    req.raw_input_contents.append(b"\0\0\0\0")
    if ask_final:
        req.parameters["triton_enable_empty_final_response"].bool_param = True
    return grpc_message(req.SerializeToString())


def response(
    model: str, ident: str = "", final: bool | None = None, data: bool = True, error: str = ""
) -> bytes:
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    inner = resp.infer_response
    inner.model_name = model
    inner.id = ident
    if final is not None:
        inner.parameters["triton_final_response"].bool_param = final
    if data:
        inner.outputs.add(name="TOKEN", datatype="INT32", shape=[1])
        inner.raw_output_contents.append(b"\1\0\0\0")
    return grpc_message(resp.SerializeToString())


def table(max_pending: int = 1024) -> tuple[StreamInferences, CollectorRegistry]:
    registry = CollectorRegistry()
    return StreamInferences(ProxyMetrics(registry), METHOD, max_pending), registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, with_protocol(name, labels))
    return 0.0 if got is None else got


def requests_total(registry: CollectorRegistry, model: str, code: str = "OK") -> float:
    return value(registry, "xsp_requests_total", method=METHOD, model=model, grpc_code=code)


def test_ids_match_out_of_order_and_models_mix() -> None:
    inf, reg = table()
    inf.request_data(request("a", "1") + request("b", "2"))
    inf.response_data(response("b", "2", final=True))
    inf.response_data(response("a", "1", final=True)[:7])  # cut mid-message: nothing yet
    assert requests_total(reg, "a") == 0 and requests_total(reg, "b") == 1
    inf.response_data(response("a", "1", final=True)[7:])
    assert requests_total(reg, "a") == 1 and not inf.pending
    assert value(reg, "xsp_responses_total", method=METHOD, model="a") == 1
    assert value(reg, "xsp_stream_anomalies_total", reason="unmatched") == 0


def test_decoupled_with_final_flag_counts_responses_and_gaps() -> None:
    inf, reg = table()
    inf.request_data(request("tok", ask_final=True))
    for _ in range(5):
        inf.response_data(response("tok", final=False))
    assert requests_total(reg, "tok") == 0  # not final yet
    inf.response_data(response("tok", final=True, data=False))  # the empty final response
    assert requests_total(reg, "tok") == 1
    assert value(reg, "xsp_responses_total", method=METHOD, model="tok") == 5
    gaps = value(reg, "xsp_response_gap_seconds_count", method=METHOD, model="tok")
    assert gaps == 4
    assert value(reg, "xsp_first_response_seconds_count", method=METHOD, model="tok") == 1
    assert value(reg, "xsp_final_response_unseen_total", method=METHOD, model="tok") == 0


def test_without_final_flag_a_request_ends_at_its_last_response() -> None:
    inf, reg = table()
    inf.request_data(request("tok", "x"))
    for _ in range(3):
        inf.response_data(response("tok", "x", final=False))
    inf.request_data(request("tok", "y"))
    inf.response_data(response("tok", "y", final=False))  # shows x is over
    assert requests_total(reg, "tok") == 1
    inf.close("OK", 1.0)  # and y at the stream's end
    assert requests_total(reg, "tok") == 2
    assert value(reg, "xsp_final_response_unseen_total", method=METHOD, model="tok") == 2
    assert value(reg, "xsp_responses_total", method=METHOD, model="tok") == 4


def test_in_order_without_ids_and_per_message_errors() -> None:
    inf, reg = table()
    inf.request_data(request("a") + request("nope") + request("a"))
    error = "Request for unknown model: 'nope' is not found"
    inf.response_data(response("a", final=True))
    inf.response_data(response("", data=False, error=error))
    inf.response_data(response("a", final=True))
    assert requests_total(reg, "a") == 2
    assert requests_total(reg, "nope", "UNKNOWN") == 1
    assert not inf.pending


def test_bad_input_is_counted_and_never_raises() -> None:
    inf, reg = table()
    inf.request_data(grpc_message(b"\xff\xff\xff"))  # not a protobuf message
    inf.request_data(grpc_message(b"compressed", compressed=True))
    inf.response_data(response("m", "no-such-id", final=True))
    inf.response_data(grpc_message(b"\x0f"))  # wire type 7
    assert value(reg, "xsp_stream_anomalies_total", reason="unreadable") == 3
    assert value(reg, "xsp_stream_anomalies_total", reason="unmatched") == 1
    inf.request_data(request("m")[:9])  # cut inside a message, then the client cancels
    inf.close("CANCELLED", 0.5)
    assert value(reg, "xsp_stream_anomalies_total", reason="cut") == 1
    assert value(reg, "xsp_stream_anomalies_total", reason="cancelled") == 1
    assert requests_total(reg, "_unknown", "CANCELLED") == 2  # the two unreadable requests
    assert value(reg, "xsp_streams_total", method=METHOD, grpc_code="CANCELLED") == 1
    assert value(reg, "xsp_stream_messages_total", method=METHOD, direction="request") == 2
    assert value(reg, "xsp_streams_open", method=METHOD) == -1  # opened by the relay, not here


def _relay_bytes() -> int:
    """Bytes traced as allocated by the relay's code (threads left by other tests in the
    same process allocate too; they must not count)."""
    keep = [tracemalloc.Filter(True, "*sidecar/proxy/*")]
    return sum(
        s.size for s in tracemalloc.take_snapshot().filter_traces(keep).statistics("filename")
    )


def test_pending_table_is_bounded() -> None:
    """40,000 messages on one stream and 300,000 responses to one request: the table never
    holds more than its bound, memory stays flat, overflow is counted."""
    bound = 256
    inf, reg = table(bound)
    one = request("m", ask_final=True)
    chunk = one * 1000
    tracemalloc.start()
    for i in range(40):
        inf.request_data(chunk)
        assert len(inf.pending) <= bound
        if i == 9:
            after_ten = _relay_bytes()
    grown = _relay_bytes() - after_ten
    assert len(inf.pending) == bound
    assert value(reg, "xsp_stream_anomalies_total", reason="overflow") == 40_000 - bound
    assert requests_total(reg, "m", "UNKNOWN") == 40_000 - bound
    inf.close("OK", 1.0)
    assert not inf.pending

    tracemalloc.stop()
    assert grown < 64 * 1024  # 30,000 messages past the first 10,000 left no trace

    inf, reg = table(bound)
    inf.request_data(request("tok", ask_final=True))
    token = response("tok", final=False) * 10_000
    for _ in range(30):
        inf.response_data(token)
        assert len(inf.pending) == 1
    inf.response_data(response("tok", final=True, data=False))
    assert value(reg, "xsp_responses_total", method=METHOD, model="tok") == 300_000
    assert value(reg, "xsp_response_gap_seconds_count", method=METHOD, model="tok") == 299_999
    assert requests_total(reg, "tok") == 1


def test_a_sampled_stream_leaves_no_exemplar_on_the_inference_histogram() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    metrics.record(METHOD, "m", "OK", 0.002, 10, 10)  # one inference of the stream
    metrics.record_exemplar(METHOD, "m", 30.0, "00" * 16)  # the stream's whole life
    metrics.record("ModelInfer", "m", "OK", 0.002, 10, 10)
    metrics.record_exemplar("ModelInfer", "m", 0.002, "11" * 16)
    found = exemplars(
        scrape_registry(registry, openmetrics=True), "xsp_request_duration_seconds_bucket"
    )
    assert [labels["method"] for labels, _ in found] == ["ModelInfer"]


def test_model_labels_stay_bounded_on_one_stream() -> None:
    """Each model's labels are looked up once per stream; past `max_models` names the extra
    ones count under `_other` as unary calls do, and the stream's lookup table stays bounded."""
    registry = CollectorRegistry()
    inf = StreamInferences(ProxyMetrics(registry, max_models=2), METHOD)
    names = ["a", "b", "c", "d", "a", "c", "", "b"]
    for name in names:
        inf.request_data(request(name))
        inf.response_data(response(name or "x"))
    assert requests_total(registry, "a") == 2 and requests_total(registry, "b") == 2
    assert requests_total(registry, "_other") == 3  # c, d, c
    assert requests_total(registry, "_unknown") == 1  # the empty name
    assert value(registry, "xsp_responses_total", method=METHOD, model="_other") == 3
    count = value(registry, "xsp_request_duration_seconds_count", method=METHOD, model="_other")
    assert count == 3
    assert len(inf._labels) <= 2
