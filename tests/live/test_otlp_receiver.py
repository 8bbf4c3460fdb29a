"""The OTLP/HTTP receiver over real HTTP on a free port, fed with a payload captured from a real
Triton 2.51 (tests/data/otlp/) and with protobuf built from it."""

from __future__ import annotations

import base64
import gzip
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from sidecar.live.otlp_receiver import (
    OtlpPayloadError,
    OtlpReceiver,
    OtlpSpan,
    parse_otlp_json,
    parse_otlp_protobuf,
)

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
