"""The HTTP relay's parts on their own: the readers over any cut of the byte stream, chunk
framing, status classes, refusals and the metrics' protocol label."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar.proxy.http import HttpLimits, refusals
from sidecar.proxy.http.calls import CallBook, extra_header_bytes
from sidecar.proxy.http.chunked import ChunkedFramer, FramingError
from sidecar.proxy.http.request_reader import RequestReader
from sidecar.proxy.http.response_reader import BrokenResponse, ResponseReader
from sidecar.proxy.http.status import error_text, grpc_code
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import HeaderDecision, RequestStart, StreamEnd
from tests.harness.metrics_text import sample_value, scrape_registry
from tests.proxy.http_harness import TritonRoutesStandIn

BODY = b'{"inputs": []}' * 20
REQUESTS = [
    b"POST /v2/models/a/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
    % (len(BODY), BODY),
    b"GET /v2/models/b%20c HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v2/models/a/versions/2/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n",
    b"GET /v2/health/ready HTTP/1.1\r\n\r\n",
]
RESPONSES = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst",
    b'HTTP/1.1 404 Not Found\r\nContent-Length: 36\r\n\r\n{"error":"model \'b c\' is not found"}',
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
]


class Observer:
    def __init__(self) -> None:
        self.starts: list = []
        self.bodies: list = []
        self.ends: list = []

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        self.starts.append(start)
        return HeaderDecision(extra_headers=[("x-s", "1")], capture_body=True)

    def on_request_body(self, sid: int, model: str | None, body: bytes) -> None:
        self.bodies.append((sid, model, body))

    def on_stream_end(self, end: StreamEnd) -> None:
        self.ends.append(end)


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_cut_of_a_pipelined_stream_reads_alike(points: list[int]) -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    observer = Observer()
    book = CallBook(metrics, observer, 7)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    responses = ResponseReader(book)
    stream = b"".join(REQUESTS)
    forwarded = bytearray()
    for piece in cuts(stream, points):
        out = reader.feed(piece)
        forwarded += piece if out is None else b"".join(out)
    assert reader.refused is None
    added = [r.replace(b"\r\n\r\n", b"\r\nx-s: 1\r\n\r\n", 1) for r in REQUESTS]
    assert bytes(forwarded) == b"".join(added)
    assert [s.stream_id for s in observer.starts] == [1, 2, 3, 4]
    assert [s.method for s in observer.starts] == [
        "ModelInfer", "ModelMetadata", "ModelInfer", "ServerReady"
    ]  # fmt: skip
    assert observer.bodies == [(1, "a", BODY), (2, "b c", b""), (3, "a", b"hello world"),
                               (4, None, b"")]  # fmt: skip
    for piece in cuts(b"".join(RESPONSES), points[::-1]):
        responses.feed(piece)
    assert not book.open
    codes = [(e.stream_id, e.grpc_code, e.grpc_message) for e in observer.ends]
    assert codes == [(1, "OK", ""), (2, "NOT_FOUND", "model 'b c' is not found"),
                     (3, "OK", ""), (4, "OK", "")]  # fmt: skip
    assert [(e.request_bytes, e.response_bytes) for e in observer.ends] == [
        (len(BODY), 5), (0, 36), (11, 3), (0, 0)
    ]  # fmt: skip
    assert metrics.http.codes[("ModelInfer", "a", "OK")] == 2
    assert metrics.http_open == 0


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"GARBAGE\r\n\r\n", refusals.MALFORMED),
        (b"GET / HTTP/1.1\nHost: x\n\n", refusals.MALFORMED),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
         refusals.SMUGGLING),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", refusals.SMUGGLING),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", refusals.SMUGGLING),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", refusals.HEADER_TOO_LARGE),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000, refusals.HEADER_TOO_LARGE),
        (b"POST / HTTP/1.1\r\nContent-Length: 300000000\r\n\r\n", refusals.BODY_TOO_LARGE),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n20000\r\n" + b"a" * 0x20000,
         refusals.BODY_TOO_LARGE),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", refusals.MALFORMED),
        (b"POST / HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\nContent-Length: 2\r\n\r\n",
         refusals.UPGRADE),
    ],
)  # fmt: skip
def test_refusals_forward_nothing_of_the_refused_request(data: bytes, reason: str) -> None:
    book = CallBook(ProxyMetrics(CollectorRegistry()), None, 1)
    reader = RequestReader(HttpLimits(body_bytes=1 << 16), book, TritonRoutesStandIn())
    first = REQUESTS[1]
    out = reader.feed(first + data)
    assert reader.refused is not None and reader.refused.reason == reason
    forwarded = b"".join(out or [])
    assert forwarded.startswith(first)
    if reason not in (refusals.BODY_TOO_LARGE, refusals.MALFORMED) or b"Transfer" not in data:
        assert forwarded == first  # a chunked body found bad part-way is cut there
    assert reader.feed(b"GET / HTTP/1.1\r\n\r\n") == []  # nothing after a refusal


def test_upgrade_without_body_is_relayed_and_parsing_goes_on() -> None:
    book = CallBook(ProxyMetrics(CollectorRegistry()), None, 1)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    upgrade = b"GET /v2/health/ready HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    assert reader.feed(upgrade + REQUESTS[0]) is None
    assert reader.refused is None and len(book.open) == 2


def test_the_common_chunks_read_as_any_cut() -> None:
    """The readers' fast paths (a whole request, a header block then its body, a whole 200
    response, a chunk each) give what the general path gives for the same bytes."""
    head, body = REQUESTS[0].split(b"\r\n\r\n", 1)
    ours = [head + b"\r\n\r\n", body, REQUESTS[0], REQUESTS[1], REQUESTS[3]]
    answers = [RESPONSES[0], RESPONSES[0], RESPONSES[1], RESPONSES[3]]
    seen = []
    for chunks in (ours, [b"".join(ours)]):  # one chunk: no fast path
        metrics = ProxyMetrics(CollectorRegistry())
        observer = Observer()
        book = CallBook(metrics, observer, 7)
        reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
        forwarded = b"".join(
            c if (out := reader.feed(c)) is None else b"".join(out) for c in chunks
        )
        responses = ResponseReader(book)
        for answer in answers if len(chunks) > 1 else [b"".join(answers)]:
            responses.feed(answer)
        assert not book.open and reader.refused is None
        ends = [(e.stream_id, e.grpc_code, e.request_bytes, e.response_bytes, e.grpc_message)
                for e in observer.ends]  # fmt: skip
        seen.append((forwarded, observer.bodies, ends, dict(metrics.http.codes)))
    assert seen[0] == seen[1]
    assert seen[0][0].count(b"x-s: 1\r\n") == 4


def test_a_last_requests_body_in_a_later_chunk_is_forwarded() -> None:
    for cut in (0, 5):  # the body whole (fast path), or in two chunks
        book = CallBook(ProxyMetrics(CollectorRegistry()), None, 1)
        reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
        head = (
            b"POST /v2/models/a/infer HTTP/1.1\r\nConnection: close\r\nContent-Length: 10\r\n\r\n"
        )
        assert reader.feed(head) is None
        body = b"0123456789"
        pieces = [body[:cut], body[cut:]] if cut else [body]
        out = [p if (o := reader.feed(p)) is None else b"".join(o) for p in pieces]
        assert b"".join(out) == body and reader.refused is None
        assert reader.feed(b"GET / HTTP/1.1\r\n\r\n") == []  # after the last request
        assert len(book.open) == 1 and book.open[0].request_bytes == 10


def test_connection_close_drops_what_follows() -> None:
    book = CallBook(ProxyMetrics(CollectorRegistry()), None, 1)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    last = b"GET /v2 HTTP/1.1\r\nConnection: close\r\n\r\n"
    assert b"".join(reader.feed(last + b"junk after close") or []) == last
    assert reader.refused is None


def test_broken_responses() -> None:
    for data in (b"NOT HTTP\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"):
        book = CallBook(ProxyMetrics(CollectorRegistry()), None, 1)
        with pytest.raises(BrokenResponse):
            ResponseReader(book).feed(data)  # garbage, or a response with no request open


def test_head_response_and_until_close() -> None:
    book = CallBook(ProxyMetrics(CollectorRegistry()), None, 1)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    responses = ResponseReader(book)
    reader.feed(b"HEAD /v2 HTTP/1.1\r\n\r\nGET /v2 HTTP/1.1\r\n\r\nGET /v2 HTTP/1.0\r\n\r\n")
    responses.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n")  # no body: HEAD
    responses.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    responses.feed(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
    assert len(book.open) == 1
    responses.eof()
    assert not book.open
    assert book.metrics.http.stats[("ServerMetadata", "_unknown")].response_bytes == 15


def test_chunk_framer() -> None:
    framer = ChunkedFramer(capture=True)
    data = b"3\r\nabc\r\n0\r\n\r\nNEXT"
    assert framer.advance(data, 0) == len(data) - 4 and framer.done
    assert framer.payload() == b"abc" and framer.size == 3
    with pytest.raises(FramingError):
        ChunkedFramer().advance(b"x" * 20_000, 0)


def test_status_classes() -> None:
    assert grpc_code(200) == "OK" and grpc_code(204) == "OK"
    assert grpc_code(400, "Request for unknown model: 'x' is not found") == "NOT_FOUND"
    assert grpc_code(400, "unexpected inference input 'WRONG'") == "INVALID_ARGUMENT"
    assert grpc_code(404) == "NOT_FOUND" and grpc_code(503) == "UNAVAILABLE"
    assert grpc_code(500, "Servable not found for request") == "NOT_FOUND"
    assert grpc_code(500) == "INTERNAL" and grpc_code(418) == "FAILED_PRECONDITION"
    assert grpc_code(302) == "UNKNOWN"
    assert error_text(b'{"error": "boom"}') == "boom"
    assert error_text(b"plain text") == "plain text"
    assert len(error_text(json.dumps({"error": "x" * 5000}).encode())) == 1024


def test_refusal_bytes() -> None:
    answer = refusals.refusal(refusals.HEADER_TOO_LARGE, "too big")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 ") and b"Connection: close" in head
    assert json.loads(body) == {"error": "too big"}
    assert set(refusals.STATUS) == set(refusals.REASONS)


def test_extra_header_lines() -> None:
    assert extra_header_bytes([("traceparent", "00-1")]) == b"traceparent: 00-1\r\n"
    for bad in ([("x", "a\r\nInjected: 1")], [("", "v")], [("a:b", "v")]):
        with pytest.raises(ValueError):
            extra_header_bytes(bad)


def test_protocol_label_and_refused_family() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    metrics.record("ModelInfer", "m", "OK", 0.001, 10, 20)
    metrics.http.record("ModelInfer", "m", "OK", 0.002, 30, 40)
    metrics.http_refused.labels("smuggling").inc()
    metrics.http_open = 2
    text = scrape_registry(registry)
    for protocol, request_bytes in (("grpc", 10), ("http", 30)):
        labels = {"method": "ModelInfer", "model": "m", "protocol": protocol}
        assert sample_value(text, "xsp_requests_total", grpc_code="OK", **labels) == 1
        assert sample_value(text, "xsp_request_duration_seconds_count", **labels) == 1
        assert sample_value(text, "xsp_request_bytes_total", **labels) == request_bytes
    assert sample_value(text, "xsp_http_refused_total", reason="smuggling") == 1
    assert sample_value(text, "xsp_http_refused_total", reason="malformed") == 0
    assert sample_value(text, "xsp_requests_in_flight") == 2
    metrics.record_exemplar("ModelInfer", "m", 0.002, "ab" * 16, protocol="http")
    assert metrics.http.stats[("ModelInfer", "m")].exemplars is not None
    assert metrics.stats[("ModelInfer", "m")].exemplars is None


class Raising:
    """An observer whose every hook raises."""

    def on_request_headers(self, start: RequestStart) -> HeaderDecision:
        raise RuntimeError("headers")

    def on_request_body(self, sid: int, model: str | None, body: bytes) -> None:
        raise RuntimeError("body")

    def on_stream_end(self, end: StreamEnd) -> None:
        raise RuntimeError("end")


def test_observer_errors_are_counted_and_the_call_goes_on() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    book = CallBook(metrics, Raising(), 1)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    assert reader.feed(REQUESTS[0]) is None
    ResponseReader(book).feed(RESPONSES[0])
    assert metrics.observer_errors["request_headers"] == 1
    assert metrics.observer_errors["stream_end"] == 1
    assert metrics.http.codes == {("ModelInfer", "a", "OK"): 1}

    class BadField(Observer):
        def on_request_headers(self, start: RequestStart) -> HeaderDecision:
            return HeaderDecision(extra_headers=[("x", "a\r\nb: c")], capture_body=True)

        def on_request_body(self, sid: int, model: str | None, body: bytes) -> None:
            raise RuntimeError("body")

    book = CallBook(metrics, BadField(), 2)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    assert reader.feed(REQUESTS[0]) is None  # the field is dropped, the request unchanged
    assert metrics.observer_errors["request_headers"] == 2
    assert metrics.observer_errors["request_body"] == 1


def test_a_chunked_body_past_the_capture_limit_is_not_delivered() -> None:
    from sidecar.proxy.streams import HeaderDecision as Decision

    class Small(Observer):
        def on_request_headers(self, start: RequestStart) -> HeaderDecision:
            return Decision(capture_body=True, capture_limit=5)

    observer = Small()
    book = CallBook(ProxyMetrics(CollectorRegistry()), observer, 1)
    reader = RequestReader(HttpLimits(), book, TritonRoutesStandIn())
    reader.feed(REQUESTS[2] + REQUESTS[0])  # 11 bytes chunked, then a Content-Length body
    assert observer.bodies == []


@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=6), st.integers(0, 3))
def test_no_input_escapes_the_readers(junk: bytes, points: list[int], where: int) -> None:
    book = CallBook(ProxyMetrics(CollectorRegistry()), Observer(), 1)
    reader = RequestReader(
        HttpLimits(header_bytes=256, body_bytes=512), book, TritonRoutesStandIn()
    )
    valid = REQUESTS[where]
    stream = valid[: len(valid) // 2] + junk + valid[len(valid) // 2 :] + junk
    for piece in cuts(stream, points):
        out = reader.feed(piece)
        assert out is None or isinstance(out, list)
    responses = ResponseReader(book)
    try:
        for piece in cuts(junk + RESPONSES[where], points):
            responses.feed(piece)
    except BrokenResponse:
        pass
    book.close("CANCELLED")
    assert book.metrics.http_open == 0
