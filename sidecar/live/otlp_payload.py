"""Decoding OTLP trace payloads (`ExportTraceServiceRequest`) into `OtlpSpan` records.

OTLP/JSON is decoded with the standard library; OTLP/protobuf needs `opentelemetry-proto`.
Every way a payload can be wrong ends in `OtlpPayloadError` with a short message: bad JSON,
values of the wrong type, integers out of range (times must fit SQLite's signed 64 bits),
nesting deeper than `MAX_ATTRIBUTE_DEPTH` or deeper than the JSON decoder allows.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


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

MAX_ATTRIBUTE_DEPTH = 16  # nested arrayValue/kvlistValue levels accepted
_INT64 = (-(2**63), 2**63 - 1)
# times are unsigned in OTLP, but the trace store (SQLite) holds signed 64-bit integers
_TIME_NS = (0, 2**63 - 1)


def _preview(value: Any, limit: int = 80) -> str:
    """A short repr for error messages: a payload's values can be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _check_range(number: int, what: str, bounds: tuple[int, int]) -> int:
    if not bounds[0] <= number <= bounds[1]:
        raise OtlpPayloadError(f"{what} {_preview(number)} is outside [{bounds[0]}, {bounds[1]}]")
    return number


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
        raise OtlpPayloadError(f"{what} {_preview(value)} is not {size} bytes of hex (or base64)")
    return raw.hex() if any(raw) else None


def _json_int(value: Any, what: str, bounds: tuple[int, int] = _INT64) -> int:
    """An integer given as a JSON number or a decimal string (OTLP writes 64-bit ints as text)."""
    try:
        if isinstance(value, float) and not value.is_integer():  # also inf and nan
            raise ValueError(value)
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise OtlpPayloadError(
            f"{what} must be an integer (or a string of one), got {_preview(value)}"
        ) from None
    return _check_range(number, what, bounds)


def _json_float(value: Any) -> float:
    if isinstance(value, bool):
        raise OtlpPayloadError(f"doubleValue must be a number, got {value!r}")
    try:
        return float(value)  # also "NaN", "Infinity", "-Infinity" as the JSON mapping writes them
    except (TypeError, ValueError, OverflowError):
        raise OtlpPayloadError(f"doubleValue must be a number, got {_preview(value)}") from None


def _json_any_value(value: Any, depth: int) -> Any:
    if not isinstance(value, Mapping):
        raise OtlpPayloadError(f"attribute value must be an object, got {_preview(value)}")
    if "stringValue" in value or "string_value" in value:
        return str(_get(value, "stringValue", "string_value"))
    if "boolValue" in value or "bool_value" in value:
        return bool(_get(value, "boolValue", "bool_value"))
    if "intValue" in value or "int_value" in value:
        return _json_int(_get(value, "intValue", "int_value"), "intValue")
    if "doubleValue" in value or "double_value" in value:
        return _json_float(_get(value, "doubleValue", "double_value"))
    nested = ("arrayValue", "array_value", "kvlistValue", "kvlist_value")
    if any(key in value for key in nested) and depth >= MAX_ATTRIBUTE_DEPTH:
        raise OtlpPayloadError(f"attribute values nest deeper than {MAX_ATTRIBUTE_DEPTH} levels")
    if "arrayValue" in value or "array_value" in value:
        values = _json_list(_get(value, "arrayValue", "array_value").get("values"), "values")
        return [_json_any_value(v, depth + 1) for v in values]
    if "kvlistValue" in value or "kvlist_value" in value:
        items = _get(value, "kvlistValue", "kvlist_value").get("values")
        return _json_attributes(items, depth + 1)
    if "bytesValue" in value or "bytes_value" in value:
        return str(_get(value, "bytesValue", "bytes_value"))  # base64, kept as text (JSON-safe)
    return None


def _json_list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpPayloadError(f"{what} must be a list, got {_preview(value)}")
    return value


def _json_attributes(items: Any, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in _json_list(items, "attributes"):
        if not isinstance(item, Mapping) or "key" not in item:
            raise OtlpPayloadError(f"attribute without a key: {_preview(item)}")
        out[str(item["key"])] = _json_any_value(item.get("value") or {}, depth)
    return out


def _json_kind(value: Any) -> int:
    if isinstance(value, str) and not value.isdigit():
        names = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
        short = value.removeprefix("SPAN_KIND_")
        return names.index(short) if short in names else 0
    return _json_int(value or 0, "span kind")


def _json_span(obj: Any, resource: dict[str, Any], scope: str) -> OtlpSpan:
    if not isinstance(obj, Mapping):
        raise OtlpPayloadError(f"a span must be an object, got {_preview(obj)}")
    trace_id = _json_id(_get(obj, "traceId", "trace_id"), 16, "traceId")
    span_id = _json_id(_get(obj, "spanId", "span_id"), 8, "spanId")
    if trace_id is None or span_id is None:
        raise OtlpPayloadError(f"span {_preview(obj.get('name'))} has no traceId or spanId")
    events = [
        OtlpEvent(
            name=str(event.get("name", "")),
            time_ns=_json_int(
                _get(event, "timeUnixNano", "time_unix_nano", 0), "timeUnixNano", _TIME_NS
            ),
            attributes=_json_attributes(event.get("attributes")),
        )
        for event in _json_list(obj.get("events"), "events")
    ]
    status = obj.get("status") or {}
    return OtlpSpan(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=_json_id(_get(obj, "parentSpanId", "parent_span_id"), 8, "parentSpanId"),
        name=str(obj.get("name", "")),
        start_ns=_json_int(
            _get(obj, "startTimeUnixNano", "start_time_unix_nano", 0), "start", _TIME_NS
        ),
        end_ns=_json_int(_get(obj, "endTimeUnixNano", "end_time_unix_nano", 0), "end", _TIME_NS),
        kind=_json_kind(obj.get("kind", 0)),
        attributes=_json_attributes(obj.get("attributes")),
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
    except RecursionError:
        raise OtlpPayloadError("body nests JSON deeper than the decoder allows") from None
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: also a >4300-digit integer
        raise OtlpPayloadError(f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, Mapping):
        raise OtlpPayloadError("an OTLP/JSON body must be an object with `resourceSpans`")
    spans: list[OtlpSpan] = []
    try:
        for resource_spans in _json_list(
            _get(doc, "resourceSpans", "resource_spans"), "resourceSpans"
        ):
            resource = _json_attributes((resource_spans.get("resource") or {}).get("attributes"))
            for scope_spans in _json_list(
                _get(resource_spans, "scopeSpans", "scope_spans"), "scopeSpans"
            ):
                scope = str((scope_spans.get("scope") or {}).get("name", ""))
                spans.extend(
                    _json_span(span, resource, scope)
                    for span in _json_list(scope_spans.get("spans"), "spans")
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


def _proto_any_value(value: Any, depth: int) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which in ("array_value", "kvlist_value") and depth >= MAX_ATTRIBUTE_DEPTH:
        raise OtlpPayloadError(f"attribute values nest deeper than {MAX_ATTRIBUTE_DEPTH} levels")
    if which == "array_value":
        return [_proto_any_value(v, depth + 1) for v in value.array_value.values]
    if which == "kvlist_value":
        return _proto_attributes(value.kvlist_value.values, depth + 1)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, which)


def _proto_attributes(items: Any, depth: int = 0) -> dict[str, Any]:
    return {item.key: _proto_any_value(item.value, depth) for item in items}


def _proto_id(raw: bytes, size: int, what: str) -> str | None:
    if not raw or not any(raw):
        return None
    if len(raw) != size:
        raise OtlpPayloadError(f"{what} has {len(raw)} bytes, expected {size}")
    return raw.hex()


def _proto_time(value: int, what: str) -> int:
    return _check_range(int(value), what, _TIME_NS)


def parse_otlp_protobuf(body: bytes) -> list[OtlpSpan]:
    """Spans of a binary OTLP `ExportTraceServiceRequest` (needs `opentelemetry-proto`)."""
    trace_service_pb2 = _proto_module()
    from google.protobuf.message import DecodeError

    request = trace_service_pb2.ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RecursionError) as exc:
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
                        start_ns=_proto_time(span.start_time_unix_nano, "start_time_unix_nano"),
                        end_ns=_proto_time(span.end_time_unix_nano, "end_time_unix_nano"),
                        kind=int(span.kind),
                        attributes=_proto_attributes(span.attributes),
                        events=[
                            OtlpEvent(
                                e.name,
                                _proto_time(e.time_unix_nano, "time_unix_nano"),
                                _proto_attributes(e.attributes),
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
