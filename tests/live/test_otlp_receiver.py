"""The OTLP/HTTP receiver over real HTTP on a free port, fed with a payload captured from a real
Triton 2.51 (tests/data/otlp/) and with protobuf built from it."""

from __future__ import annotations

import base64
import gzip
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from prometheus_client import CollectorRegistry

from sidecar.live.otlp_metrics import OtlpMetricsCollector
from sidecar.live.otlp_receiver import (
    REJECT_REASONS,
    OtlpPayloadError,
    OtlpReceiver,
    OtlpSpan,
    parse_otlp_json,
    parse_otlp_protobuf,
)
from sidecar.live.triton_spans import TritonSpanCollector
from tests.harness.metrics_text import sample_map, scrape_registry

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "otlp" / "triton-2.51-two-requests.json"


class Sink:
    """Collects what the receiver hands to its callback."""

    def __init__(self) -> None:
        self.batches: list[list[OtlpSpan]] = []
        self.lock = threading.Lock()

    def __call__(self, spans: list[OtlpSpan]) -> None:
        with self.lock:
            self.batches.append(spans)

    @property
    def spans(self) -> list[OtlpSpan]:
        return [s for batch in self.batches for s in batch]


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
def receiver(sink: Sink) -> Iterator[OtlpReceiver]:
    with OtlpReceiver(sink, port=0) as rec:
        yield rec


def post(
    receiver: OtlpReceiver,
    body: bytes,
    content_type: str = "application/json",
    path: str = "/v1/traces",
    headers: dict[str, str] | None = None,
) -> tuple[int, str, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{receiver.port}{path}",
        data=body,
        method="POST",
        headers={"Content-Type": content_type, **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def to_protobuf(spans: list[OtlpSpan]) -> bytes:
    """Encode spans as a binary ExportTraceServiceRequest (one resource, one scope)."""
    request = trace_service_pb2.ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in spans[0].resource.items():
        attribute = resource_spans.resource.attributes.add()
        attribute.key = key
        attribute.value.string_value = value
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = spans[0].scope
    for span in spans:
        out = scope_spans.spans.add()
        out.trace_id = bytes.fromhex(span.trace_id)
        out.span_id = bytes.fromhex(span.span_id)
        if span.parent_span_id:
            out.parent_span_id = bytes.fromhex(span.parent_span_id)
        out.name = span.name
        out.kind = span.kind
        out.start_time_unix_nano = span.start_ns
        out.end_time_unix_nano = span.end_ns
        for key, value in span.attributes.items():
            attribute = out.attributes.add()
            attribute.key = key
            if isinstance(value, str):
                attribute.value.string_value = value
            else:
                attribute.value.int_value = value
        for event in span.events:
            out_event = out.events.add()
            out_event.name = event.name
            out_event.time_unix_nano = event.time_ns
    return request.SerializeToString()


def test_parse_captured_triton_payload() -> None:
    spans = parse_otlp_json(FIXTURE.read_bytes())
    assert sorted(s.name for s in spans) == sorted(
        ["InferRequest", "simple_cnn", "compute", "InferRequest", "add_sub", "compute"]
    )
    root = next(s for s in spans if s.name == "InferRequest" and s.trace_id.startswith("0af7"))
    assert root.parent_span_id == "b7ad6b7169203331"  # the span id sent in traceparent
    model = next(s for s in spans if s.name == "simple_cnn")
    assert model.attributes["triton.model_name"] == "simple_cnn"
    assert model.attributes["triton.model_version"] == 1
    assert model.parent_span_id == root.span_id
    assert [e.name for e in model.events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert all(s.end_ns > s.start_ns > 0 for s in spans)
    assert spans[0].resource["service.name"] == "triton-inference-server"


def test_json_payload_reaches_callback(receiver: OtlpReceiver, sink: Sink) -> None:
    status, content_type, body = post(receiver, FIXTURE.read_bytes())
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body) == {}
    assert [s.span_id for s in sink.spans] == [
        s.span_id for s in parse_otlp_json(FIXTURE.read_bytes())
    ]
    stats = receiver.stats()
    assert (stats.accepted, stats.rejected, stats.spans) == (1, 0, 6)


def test_protobuf_payload_same_spans_as_json(receiver: OtlpReceiver, sink: Sink) -> None:
    expected = parse_otlp_json(FIXTURE.read_bytes())
    status, content_type, body = post(receiver, to_protobuf(expected), "application/x-protobuf")
    assert (status, content_type) == (200, "application/x-protobuf")
    response = trace_service_pb2.ExportTraceServiceResponse()
    response.ParseFromString(body)
    assert not response.HasField("partial_success")
    assert sink.spans == expected


def test_gzip_body(receiver: OtlpReceiver, sink: Sink) -> None:
    status, _, _ = post(
        receiver, gzip.compress(FIXTURE.read_bytes()), headers={"Content-Encoding": "gzip"}
    )
    assert status == 200
    assert len(sink.spans) == 6


@pytest.mark.parametrize(
    ("body", "content_type", "headers", "status", "reason"),
    [
        (b"{not json", "application/json", {}, 400, "malformed"),
        (
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            "application/json",
            {},
            400,
            "malformed",
        ),
        (b"\xff\xff\xff", "application/x-protobuf", {}, 400, "malformed"),
        (b"not gzip", "application/json", {"Content-Encoding": "gzip"}, 400, "encoding"),
        (b"{}", "application/json", {"Content-Encoding": "br"}, 415, "encoding"),
        (b"{}", "text/plain", {}, 415, "content_type"),
    ],
)
def test_bad_payloads_rejected_and_counted(
    receiver: OtlpReceiver,
    sink: Sink,
    body: bytes,
    content_type: str,
    headers: dict[str, str],
    status: int,
    reason: str,
) -> None:
    got, _, answer = post(receiver, body, content_type, headers=headers)
    assert got == status
    assert answer  # a Status body that says what was wrong
    stats = receiver.stats()
    assert (stats.accepted, stats.rejected) == (0, 1)
    assert stats.rejected_by_reason == {reason: 1}
    assert sink.spans == []


def test_malformed_json_error_body_explains(receiver: OtlpReceiver) -> None:
    _, content_type, answer = post(receiver, b"[1, 2]")
    assert content_type == "application/json"
    error = json.loads(answer)
    assert error["code"] == 3 and "resourceSpans" in error["message"]


def test_wrong_path_and_too_large(sink: Sink) -> None:
    with OtlpReceiver(sink, port=0, max_body_bytes=100) as receiver:
        assert post(receiver, b"{}", path="/v1/metrics")[0] == 404
        assert post(receiver, FIXTURE.read_bytes())[0] == 413
        stats = receiver.stats()
    assert stats.rejected_by_reason == {"path": 1, "too_large": 1}


def test_callback_failure_is_counted_not_raised(tmp_path: Path) -> None:
    def explode(spans: list[OtlpSpan]) -> None:
        raise RuntimeError("store is down")

    with OtlpReceiver(explode, port=0) as receiver:
        assert post(receiver, FIXTURE.read_bytes())[0] == 200
        stats = receiver.stats()
    assert (stats.accepted, stats.callback_errors) == (1, 1)


def test_port_zero_and_restart(sink: Sink) -> None:
    receiver = OtlpReceiver(sink, port=0)
    with pytest.raises(RuntimeError, match="not started"):
        _ = receiver.port
    receiver.start()
    try:
        assert receiver.port > 0
        assert receiver.url == f"http://127.0.0.1:{receiver.port}/v1/traces"
    finally:
        receiver.stop()
    receiver.stop()  # idempotent


def test_port_in_use_is_a_clear_error(receiver: OtlpReceiver, sink: Sink) -> None:
    with pytest.raises(OSError, match="--otlp-port"):
        OtlpReceiver(sink, port=receiver.port).start()


def test_ids_accept_base64_and_reject_wrong_sizes() -> None:
    doc = json.loads(FIXTURE.read_text())
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    hex_trace_id = span["traceId"]
    span["traceId"] = base64.b64encode(bytes.fromhex(hex_trace_id)).decode()
    assert parse_otlp_json(json.dumps(doc).encode())[0].trace_id == hex_trace_id
    span["spanId"] = "abcd"
    with pytest.raises(OtlpPayloadError, match="spanId"):
        parse_otlp_json(json.dumps(doc).encode())
    with pytest.raises(OtlpPayloadError, match="ExportTraceServiceRequest"):
        parse_otlp_protobuf(b"\x0a\xff")


def test_protobuf_without_opentelemetry_proto_is_415(
    receiver: OtlpReceiver, sink: Sink, monkeypatch: pytest.MonkeyPatch
) -> None:
    # make the real package unimportable, as on an install without it
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.collector.trace.v1", None)
    body = to_protobuf(parse_otlp_json(FIXTURE.read_bytes()))
    status, content_type, answer = post(receiver, body, "application/x-protobuf")
    assert (status, content_type) == (415, "application/json")
    assert "opentelemetry-proto" in json.loads(answer)["message"]
    assert receiver.stats().rejected_by_reason == {"protobuf": 1}
    assert sink.spans == []
    # JSON still works
    assert post(receiver, FIXTURE.read_bytes())[0] == 200


# --------------------------------------------------------------------------- hardening (issue 9)


def rejected(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("xsp_otlp_rejected_total", {"reason": reason})


@pytest.fixture
def scraped(receiver: OtlpReceiver) -> CollectorRegistry:
    """A fresh registry that exports the receiver's counters (no global state)."""
    registry = CollectorRegistry()
    OtlpMetricsCollector(receiver, TritonSpanCollector(lambda trace: None), registry)
    return registry


def _one_span(**changes: object) -> bytes:
    doc = json.loads(FIXTURE.read_text())
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span.update(changes)
    return json.dumps(doc).encode()


def _nested_attribute(depth: int) -> dict[str, object]:
    value: dict[str, object] = {"stringValue": "leaf"}
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return {"key": "deep", "value": value}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            _one_span(attributes=[{"key": "x", "value": {"doubleValue": "abc"}}]), id="double-abc"
        ),
        pytest.param(_one_span(startTimeUnixNano=1e999), id="time-1e999"),
        pytest.param(_one_span(endTimeUnixNano=-5), id="time-negative"),
        pytest.param(_one_span(endTimeUnixNano=str(2**64)), id="time-over-int64"),
        pytest.param(_one_span(startTimeUnixNano=1.5), id="time-fraction"),
        pytest.param(
            _one_span(attributes=[{"key": "x", "value": {"intValue": "9" * 30}}]), id="int-huge"
        ),
        pytest.param(b'{"resourceSpans": [' + b"1" * 5000 + b"]}", id="5000-digit-literal"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="json-100k-deep"),
        pytest.param(_one_span(attributes=[_nested_attribute(40)]), id="attribute-40-deep"),
        pytest.param(_one_span(events="not a list"), id="events-not-list"),
        pytest.param(b'{"resourceSpans": {"a": 1}}', id="resource-spans-object"),
    ],
)
def test_malformed_values_get_400_and_are_counted(
    receiver: OtlpReceiver, sink: Sink, scraped: CollectorRegistry, body: bytes
) -> None:
    status, content_type, answer = post(receiver, body)
    assert (status, content_type) == (400, "application/json")
    assert json.loads(answer)["code"] == 3
    assert len(json.loads(answer)["message"]) < 400  # a preview, not the payload echoed back
    assert rejected(scraped, "malformed") == 1
    assert scraped.get_sample_value("xsp_otlp_accepted_payloads_total") == 0
    assert sink.spans == []
    assert post(receiver, FIXTURE.read_bytes())[0] == 200  # the receiver still serves
    assert scraped.get_sample_value("xsp_otlp_accepted_spans_total") == 6


def test_nan_and_infinity_doubles_are_accepted(receiver: OtlpReceiver, sink: Sink) -> None:
    attributes = [
        {"key": "a", "value": {"doubleValue": "NaN"}},
        {"key": "b", "value": {"doubleValue": "-Infinity"}},
    ]
    assert post(receiver, _one_span(attributes=attributes))[0] == 200
    value = sink.spans[0].attributes
    assert value["a"] != value["a"] and value["b"] == float("-inf")


def test_gzip_bomb_is_413(sink: Sink) -> None:
    bomb = gzip.compress(b"{" + b" " * 10_000 + b"}")
    with OtlpReceiver(sink, port=0, max_body_bytes=1000) as receiver:
        status, _, _ = post(receiver, bomb, headers={"Content-Encoding": "gzip"})
        assert status == 413
        assert receiver.stats().rejected_by_reason == {"too_large": 1}


def _open(receiver: OtlpReceiver, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def _answer(sock: socket.socket) -> bytes:
    """Everything the receiver sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what}")
        time.sleep(0.02)


STALLED_HEADERS = (
    b"POST /v1/traces HTTP/1.1\r\nHost: otlp\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n"
)


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(STALLED_HEADERS, id="no-body"),
        pytest.param(STALLED_HEADERS + b'{"resourceSpans": [', id="part-of-body"),
        pytest.param(b"POST /v1/traces HTTP/1.1\r\nHost: otlp\r\n", id="part-of-headers"),
        pytest.param(b"POST /v1/tr", id="part-of-request-line"),
    ],
)
def test_stalled_request_gets_408_and_its_thread_ends(sink: Sink, sent: bytes) -> None:
    with OtlpReceiver(sink, port=0, read_timeout_s=0.5) as receiver:
        baseline = threading.active_count()
        stalled = [_open(receiver, sent) for _ in range(5)]
        answers = [_answer(sock) for sock in stalled]  # returns only once the server closes
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0][:100]
        assert b"did not arrive whole within 0.5 s" in answers[0]
        _wait_for(lambda: threading.active_count() == baseline, "back to the baseline threads")
        assert receiver.active_connections == 0
        assert receiver.stats().rejected_by_reason == {"timeout": 5}
        assert post(receiver, FIXTURE.read_bytes())[0] == 200


def test_idle_keepalive_connection_is_closed_and_not_counted(sink: Sink) -> None:
    with OtlpReceiver(sink, port=0, read_timeout_s=0.5) as receiver:
        baseline = threading.active_count()
        assert _answer(_open(receiver)) == b""
        _wait_for(lambda: threading.active_count() == baseline, "back to the baseline threads")
        assert receiver.stats().rejected == 0


def test_connections_over_the_cap_get_503_and_threads_return(sink: Sink) -> None:
    with OtlpReceiver(sink, port=0, read_timeout_s=60, max_connections=3) as receiver:
        registry = CollectorRegistry()
        OtlpMetricsCollector(receiver, TritonSpanCollector(lambda trace: None), registry)
        baseline = threading.active_count()
        stalled = [_open(receiver, STALLED_HEADERS) for _ in range(3)]
        _wait_for(lambda: receiver.active_connections == 3, "3 connections open")
        assert registry.get_sample_value("xsp_otlp_connections_active") == 3
        refused = [_answer(_open(receiver, STALLED_HEADERS)) for _ in range(20)]
        assert all(a.startswith(b"HTTP/1.1 503 ") for a in refused)
        assert b"Retry-After: 1" in refused[0]
        assert threading.active_count() == baseline  # no thread per connection
        assert rejected(registry, "overloaded") == 20
        for sock in stalled:  # the clients go away mid-body
            sock.shutdown(socket.SHUT_WR)
            assert _answer(sock).startswith(b"HTTP/1.1 400 ")
        _wait_for(lambda: threading.active_count() == baseline, "back to the baseline threads")
        assert rejected(registry, "truncated") == 3
        assert post(receiver, FIXTURE.read_bytes())[0] == 200


def test_stop_ends_stalled_connections(sink: Sink) -> None:
    baseline = threading.active_count()
    receiver = OtlpReceiver(sink, port=0, read_timeout_s=600).start()
    stalled = [_open(receiver, STALLED_HEADERS) for _ in range(3)]
    _wait_for(lambda: receiver.active_connections == 3, "3 connections open")
    receiver.stop()  # must not wait for the clients
    assert threading.active_count() == baseline
    for sock in stalled:
        sock.close()


@pytest.mark.parametrize(
    ("sent", "status", "reason"),
    [
        (b"GARBAGE\r\n\r\n", 400, "bad_request"),
        (b"PUT /v1/traces HTTP/1.1\r\nHost: otlp\r\n\r\n", 405, "method"),
        (b"GET /v1/traces HTTP/1.1\r\nHost: otlp\r\n\r\n", 405, "method"),
        (b"POST /v1/traces HTTP/1.1\r\nHost: otlp\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 400, ""),
    ],
)
def test_http_level_refusals_are_answered_and_counted(
    receiver: OtlpReceiver, scraped: CollectorRegistry, sent: bytes, status: int, reason: str
) -> None:
    sock = _open(receiver, sent)
    sock.shutdown(socket.SHUT_WR)
    answer = _answer(sock)  # HTTP/1.0 when aiohttp could not parse the request
    assert answer.startswith(b"HTTP/1.") and answer.split(b" ")[1] == str(status).encode()
    assert rejected(scraped, reason or "bad_request") == 1


def test_metrics_over_a_real_http_scrape(sink: Sink) -> None:
    def explode(spans: list[OtlpSpan]) -> None:
        raise RuntimeError("store is down")

    registry = CollectorRegistry()
    with OtlpReceiver(explode, port=0) as receiver:
        OtlpMetricsCollector(receiver, TritonSpanCollector(lambda trace: None), registry)
        assert post(receiver, FIXTURE.read_bytes())[0] == 200
        assert post(receiver, b"{", "application/json")[0] == 400
        text = scrape_registry(registry, timeout=10)
    samples = sample_map(text)
    assert samples[("xsp_otlp_accepted_payloads_total", ())] == 1
    assert samples[("xsp_otlp_accepted_spans_total", ())] == 6
    assert samples[("xsp_otlp_callback_errors_total", ())] == 1
    assert samples[("xsp_otlp_rejected_total", (("reason", "malformed"),))] == 1
    # every reason is exported, so the label set is fixed
    assert {
        dict(labels)["reason"] for name, labels in samples if name == "xsp_otlp_rejected_total"
    } == set(REJECT_REASONS)


def test_too_large_body_is_answered_not_reset(sink: Sink) -> None:
    # urllib sends the whole body before it reads: the 413 must still reach it
    with OtlpReceiver(sink, port=0, max_body_bytes=1000) as receiver:
        status, content_type, answer = post(receiver, b" " * (4 << 20))
        assert (status, content_type) == (413, "application/json")
        assert "over the limit of 1000" in json.loads(answer)["message"]
        assert receiver.stats().rejected_by_reason == {"too_large": 1}
