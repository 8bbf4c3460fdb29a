"""A small OTLP/HTTP trace receiver (`POST /v1/traces`) for the backend's server spans.

Triton's OpenTelemetry trace mode exports OTLP/JSON over HTTP; OTLP/protobuf is accepted too
when `opentelemetry-proto` is installed (otherwise such payloads get a 415 saying so). Bodies
may be gzip-compressed. Parsed spans go to a callback; the receiver never raises into its
caller: bad payloads get a 4xx answer and are counted, callback failures are logged and counted.

It runs on stdlib `ThreadingHTTPServer` threads: it is off the serving path.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
JSON_CONTENT_TYPE = "application/json"
PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# google.rpc.Code values used in error bodies
_INVALID_ARGUMENT = 3
_RESOURCE_EXHAUSTED = 8
_UNIMPLEMENTED = 12


class OtlpPayloadError(ValueError):
    """An OTLP payload could not be decoded."""


class ProtobufNotSupportedError(OtlpPayloadError):
    """OTLP/protobuf needs the `opentelemetry-proto` package, which is not installed."""


@dataclass(frozen=True)
class OtlpEvent:
    """A timestamped event on a span (Triton's `QUEUE_START`, `COMPUTE_END`, ...)."""

    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class OtlpSpan:
    """One span as received over OTLP; ids are lowercase hex (`parent_span_id` None at a root)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    kind: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[OtlpEvent] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    status_code: int = 0
    status_message: str = ""


SpanCallback = Callable[[list[OtlpSpan]], None]


# --------------------------------------------------------------------------- OTLP/JSON


def _get(obj: Mapping[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    """OTLP/JSON uses lowerCamelCase; protobuf JSON parsers accept the snake_case names too."""
    if camel in obj:
        return obj[camel]
    return obj.get(snake, default)


def _json_id(value: Any, size: int, what: str) -> str | None:
    """Decode a trace/span id: hex per the OTLP/JSON spec, base64 as the protobuf JSON mapping."""
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise OtlpPayloadError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) == 2 * size:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) == size:
            return raw.hex()
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != size:
        raise OtlpPayloadError(f"{what} {value!r} is not {size} bytes of hex (or base64)")
    return raw.hex() if any(raw) else None


def _json_int(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise OtlpPayloadError(
            f"{what} must be an integer (or a string of one), got {value!r}"
        ) from None


def _json_any_value(value: Mapping[str, Any]) -> Any:
    if not isinstance(value, Mapping):
        raise OtlpPayloadError(f"attribute value must be an object, got {value!r}")
    if "stringValue" in value or "string_value" in value:
        return str(_get(value, "stringValue", "string_value"))
    if "boolValue" in value or "bool_value" in value:
        return bool(_get(value, "boolValue", "bool_value"))
    if "intValue" in value or "int_value" in value:
        return _json_int(_get(value, "intValue", "int_value"), "intValue")
    if "doubleValue" in value or "double_value" in value:
        return float(_get(value, "doubleValue", "double_value"))
    if "arrayValue" in value or "array_value" in value:
        values = _get(value, "arrayValue", "array_value").get("values", [])
        return [_json_any_value(v) for v in values]
    if "kvlistValue" in value or "kvlist_value" in value:
        return _json_attributes(_get(value, "kvlistValue", "kvlist_value").get("values", []))
    if "bytesValue" in value or "bytes_value" in value:
        return str(_get(value, "bytesValue", "bytes_value"))  # base64, kept as text (JSON-safe)
    return None


def _json_attributes(items: Any) -> dict[str, Any]:
    if not isinstance(items, list):
        raise OtlpPayloadError(f"attributes must be a list of key/value objects, got {items!r}")
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, Mapping) or "key" not in item:
            raise OtlpPayloadError(f"attribute without a key: {item!r}")
        out[str(item["key"])] = _json_any_value(item.get("value", {}))
    return out


def _json_kind(value: Any) -> int:
    if isinstance(value, str) and not value.isdigit():
        names = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
        short = value.removeprefix("SPAN_KIND_")
        return names.index(short) if short in names else 0
    return _json_int(value or 0, "span kind")


def _json_span(obj: Any, resource: dict[str, Any], scope: str) -> OtlpSpan:
    if not isinstance(obj, Mapping):
        raise OtlpPayloadError(f"a span must be an object, got {obj!r}")
    trace_id = _json_id(_get(obj, "traceId", "trace_id"), 16, "traceId")
    span_id = _json_id(_get(obj, "spanId", "span_id"), 8, "spanId")
    if trace_id is None or span_id is None:
        raise OtlpPayloadError(f"span {obj.get('name')!r} has no traceId or spanId")
    events = [
        OtlpEvent(
            name=str(event.get("name", "")),
            time_ns=_json_int(_get(event, "timeUnixNano", "time_unix_nano", 0), "timeUnixNano"),
            attributes=_json_attributes(event.get("attributes", [])),
        )
        for event in obj.get("events", [])
    ]
    status = obj.get("status") or {}
    return OtlpSpan(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=_json_id(_get(obj, "parentSpanId", "parent_span_id"), 8, "parentSpanId"),
        name=str(obj.get("name", "")),
        start_ns=_json_int(_get(obj, "startTimeUnixNano", "start_time_unix_nano", 0), "start"),
        end_ns=_json_int(_get(obj, "endTimeUnixNano", "end_time_unix_nano", 0), "end"),
        kind=_json_kind(obj.get("kind", 0)),
        attributes=_json_attributes(obj.get("attributes", [])),
        events=events,
        resource=resource,
        scope=scope,
        status_code=_json_kind(status.get("code", 0)) if isinstance(status, Mapping) else 0,
        status_message=str(status.get("message", "")) if isinstance(status, Mapping) else "",
    )


def parse_otlp_json(body: bytes) -> list[OtlpSpan]:
    """Spans of an OTLP/JSON `ExportTraceServiceRequest`."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OtlpPayloadError(f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, Mapping):
        raise OtlpPayloadError("an OTLP/JSON body must be an object with `resourceSpans`")
    spans: list[OtlpSpan] = []
    try:
        for resource_spans in _get(doc, "resourceSpans", "resource_spans", []):
            resource = _json_attributes(
                (resource_spans.get("resource") or {}).get("attributes", [])
            )
            for scope_spans in _get(resource_spans, "scopeSpans", "scope_spans", []):
                scope = str((scope_spans.get("scope") or {}).get("name", ""))
                spans.extend(
                    _json_span(span, resource, scope) for span in scope_spans.get("spans", [])
                )
    except (AttributeError, TypeError) as exc:
        raise OtlpPayloadError(f"body does not have the OTLP/JSON trace layout: {exc}") from None
    return spans


# --------------------------------------------------------------------------- OTLP/protobuf


def _proto_module() -> Any:
    try:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    except ImportError:
        raise ProtobufNotSupportedError(
            "OTLP/protobuf payloads need the `opentelemetry-proto` package "
            "(pip install 'opentelemetry-proto<1.27'); send OTLP/JSON instead"
        ) from None
    return trace_service_pb2


def protobuf_supported() -> bool:
    """Whether OTLP/protobuf payloads can be decoded here."""
    try:
        _proto_module()
    except ProtobufNotSupportedError:
        return False
    return True


def _proto_any_value(value: Any) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_proto_any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _proto_attributes(value.kvlist_value.values)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, which)


def _proto_attributes(items: Any) -> dict[str, Any]:
    return {item.key: _proto_any_value(item.value) for item in items}


def _proto_id(raw: bytes, size: int, what: str) -> str | None:
    if not raw or not any(raw):
        return None
    if len(raw) != size:
        raise OtlpPayloadError(f"{what} has {len(raw)} bytes, expected {size}")
    return raw.hex()


def parse_otlp_protobuf(body: bytes) -> list[OtlpSpan]:
    """Spans of a binary OTLP `ExportTraceServiceRequest` (needs `opentelemetry-proto`)."""
    trace_service_pb2 = _proto_module()
    from google.protobuf.message import DecodeError

    request = trace_service_pb2.ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpPayloadError(f"body is not an ExportTraceServiceRequest: {exc}") from None
    spans: list[OtlpSpan] = []
    for resource_spans in request.resource_spans:
        resource = _proto_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                trace_id = _proto_id(span.trace_id, 16, "trace_id")
                span_id = _proto_id(span.span_id, 8, "span_id")
                if trace_id is None or span_id is None:
                    raise OtlpPayloadError(f"span {span.name!r} has no trace_id or span_id")
                spans.append(
                    OtlpSpan(
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_span_id=_proto_id(span.parent_span_id, 8, "parent_span_id"),
                        name=span.name,
                        start_ns=int(span.start_time_unix_nano),
                        end_ns=int(span.end_time_unix_nano),
                        kind=int(span.kind),
                        attributes=_proto_attributes(span.attributes),
                        events=[
                            OtlpEvent(
                                e.name, int(e.time_unix_nano), _proto_attributes(e.attributes)
                            )
                            for e in span.events
                        ],
                        resource=resource,
                        scope=scope_spans.scope.name,
                        status_code=int(span.status.code),
                        status_message=span.status.message,
                    )
                )
    return spans


# --------------------------------------------------------------------------- HTTP server


def _status_protobuf(code: int, message: str) -> bytes:
    """A `google.rpc.Status{code, message}` encoded by hand (no googleapis dependency)."""
    text = message.encode()
    out = bytearray([0x08])  # field 1, varint
    out += _varint(code)
    out.append(0x12)  # field 2, length-delimited
    out += _varint(len(text))
    out += text
    return bytes(out)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


@dataclass
class ReceiverStats:
    """Counters of the receiver (payloads are HTTP requests; spans are what they held)."""

    accepted: int = 0
    rejected: int = 0
    spans: int = 0
    callback_errors: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: the exporter reuses its connection

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("otlp %s: " + format, self.address_string(), *args)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _reject(self, status: int, reason: str, message: str, as_protobuf: bool) -> None:
        self.server.owner._count_rejected(reason)
        log.warning("rejected OTLP payload from %s: %s", self.address_string(), message)
        if status == HTTPStatus.UNSUPPORTED_MEDIA_TYPE:
            code = _UNIMPLEMENTED
        elif status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
            code = _RESOURCE_EXHAUSTED
        else:
            code = _INVALID_ARGUMENT
        if as_protobuf:
            self._send(status, PROTOBUF_CONTENT_TYPE, _status_protobuf(code, message))
        else:
            body = json.dumps({"code": code, "message": message}).encode()
            self._send(status, JSON_CONTENT_TYPE, body)

    def do_GET(self) -> None:
        self._reject(
            HTTPStatus.METHOD_NOT_ALLOWED, "method", f"use POST {TRACES_PATH}", as_protobuf=False
        )

    def do_POST(self) -> None:
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        as_protobuf = content_type == PROTOBUF_CONTENT_TYPE
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.strip().isdigit():
            self.close_connection = True
            self._reject(
                HTTPStatus.LENGTH_REQUIRED, "length", "Content-Length is required", as_protobuf
            )
            return
        length = int(length_header)
        owner = self.server.owner
        if length > owner.max_body_bytes:
            self.close_connection = True
            self._reject(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "too_large",
                f"body of {length} bytes is over the limit of {owner.max_body_bytes}",
                as_protobuf,
            )
            return
        body = self.rfile.read(length)
        if self.path.split("?")[0] != TRACES_PATH:
            self._reject(HTTPStatus.NOT_FOUND, "path", f"only {TRACES_PATH} is served", as_protobuf)
            return
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding == "gzip":
            try:
                body = _gunzip(body, owner.max_body_bytes)
            except (OSError, EOFError, zlib.error, OtlpPayloadError) as exc:
                self._reject(
                    HTTPStatus.BAD_REQUEST, "encoding", f"bad gzip body: {exc}", as_protobuf
                )
                return
        elif encoding not in ("", "identity"):
            self._reject(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                "encoding",
                f"Content-Encoding {encoding!r} is not supported (use gzip or none)",
                as_protobuf,
            )
            return
        try:
            if content_type == JSON_CONTENT_TYPE:
                spans = parse_otlp_json(body)
            elif as_protobuf:
                spans = parse_otlp_protobuf(body)
            else:
                self._reject(
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                    "content_type",
                    f"Content-Type {content_type!r} is not supported; use {JSON_CONTENT_TYPE} "
                    f"or {PROTOBUF_CONTENT_TYPE}",
                    as_protobuf=False,
                )
                return
        except ProtobufNotSupportedError as exc:
            self._reject(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "protobuf", str(exc), as_protobuf=False)
            return
        except OtlpPayloadError as exc:
            self._reject(HTTPStatus.BAD_REQUEST, "malformed", str(exc), as_protobuf)
            return
        owner._deliver(spans)
        if as_protobuf:
            self._send(
                HTTPStatus.OK, PROTOBUF_CONTENT_TYPE, b""
            )  # empty ExportTraceServiceResponse
        else:
            self._send(HTTPStatus.OK, JSON_CONTENT_TYPE, b"{}")


def _gunzip(body: bytes, limit: int) -> bytes:
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = decompressor.decompress(body, limit + 1)
    if len(out) > limit or decompressor.unconsumed_tail:
        raise OtlpPayloadError(f"decompressed body is over the limit of {limit} bytes")
    if not decompressor.eof:
        raise OtlpPayloadError("gzip stream is truncated")
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: OtlpReceiver) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


class OtlpReceiver:
    """Accepts OTLP/HTTP trace exports on `host:port` (port 0 picks a free one) and hands each
    payload's spans to `on_spans`.

    Use as a context manager or call `start()` / `stop()`; `port` is the bound port once
    started; `stats()` returns a snapshot of the counters.
    """

    def __init__(
        self,
        on_spans: SpanCallback,
        host: str = "127.0.0.1",
        port: int = 4318,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.on_spans = on_spans
        self.host = host
        self.requested_port = port
        self.max_body_bytes = max_body_bytes
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stats = ReceiverStats()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the OTLP receiver is not started; call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The endpoint to give an exporter, e.g. Triton's `opentelemetry,url=`."""
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    def start(self) -> OtlpReceiver:
        if self._server is not None:
            return self
        try:
            self._server = _Server((self.host, self.requested_port), self)
        except OSError as exc:
            raise OSError(
                f"cannot listen for OTLP on {self.host}:{self.requested_port}: {exc.strerror}; "
                "pick another --otlp-port"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="otlp-receiver",
            daemon=True,
        )
        self._thread.start()
        log.info("OTLP receiver listening on %s", self.url)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(
                accepted=self._stats.accepted,
                rejected=self._stats.rejected,
                spans=self._stats.spans,
                callback_errors=self._stats.callback_errors,
                rejected_by_reason=dict(self._stats.rejected_by_reason),
            )

    def _count_rejected(self, reason: str) -> None:
        with self._lock:
            self._stats.rejected += 1
            self._stats.rejected_by_reason[reason] = (
                self._stats.rejected_by_reason.get(reason, 0) + 1
            )

    def _deliver(self, spans: list[OtlpSpan]) -> None:
        with self._lock:
            self._stats.accepted += 1
            self._stats.spans += len(spans)
        if not spans:
            return
        try:
            self.on_spans(spans)
        except Exception:  # telemetry never raises into the exporter's request
            log.exception("the OTLP span callback failed; %d spans lost", len(spans))
            with self._lock:
                self._stats.callback_errors += 1

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
