"""An HTTP response's error class: the gRPC code name (`streams.GRPC_CODES`) its status means.

Both protocols' calls are counted under one `grpc_code` label. A 2xx is OK. An error status
maps as google.rpc's HTTP mapping does (`_BY_STATUS`); where one status stands for several
codes (Triton answers INVALID_ARG, UNKNOWN, ALREADY_EXISTS and CANCELLED alike with 400, and
versions before 2.4x every error), the JSON error body `{"error": "..."}` Triton and
TF-Serving send says which (`_BY_TEXT`), so an HTTP call is counted as its gRPC twin is.
"""

from __future__ import annotations

import json

MAX_ERROR_TEXT = 1024  # characters of an error body's text kept for `StreamEnd.grpc_message`

_BY_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
    404: "NOT_FOUND", 405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED", 409: "ABORTED",
    412: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 416: "OUT_OF_RANGE",
    429: "RESOURCE_EXHAUSTED", 431: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
    500: "INTERNAL", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}  # fmt: skip
# (phrase in the lowercased error text, code) for the statuses that stand for several codes
_BY_TEXT = (
    ("is not found", "NOT_FOUND"),
    ("unknown model", "NOT_FOUND"),
    ("not found", "NOT_FOUND"),
    ("already exists", "ALREADY_EXISTS"),
    ("cancelled", "CANCELLED"),
    ("deadline exceeded", "DEADLINE_EXCEEDED"),
    ("timed out", "DEADLINE_EXCEEDED"),
    ("unavailable", "UNAVAILABLE"),
    ("not ready", "UNAVAILABLE"),
    ("unsupported", "UNIMPLEMENTED"),
    ("not implemented", "UNIMPLEMENTED"),
)
_AMBIGUOUS = frozenset({400, 500})


def error_text(body: bytes) -> str:
    """The `error` text of a JSON error body (bounded), else the body's start as text."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return doc["error"][:MAX_ERROR_TEXT]
    return body[:MAX_ERROR_TEXT].decode("utf-8", "replace").strip()


def grpc_code(status: int, text: str = "") -> str:
    """The gRPC code name of a final response's `status` and its error `text`."""
    if 200 <= status < 300:
        return "OK"
    if status in _AMBIGUOUS and text:
        lowered = text.lower()
        for phrase, named in _BY_TEXT:
            if phrase in lowered:
                return named
    code = _BY_STATUS.get(status)
    if code is not None:
        return code
    if 400 <= status < 500:
        return "FAILED_PRECONDITION"
    if status >= 500:
        return "INTERNAL"
    return "UNKNOWN"  # a final 1xx or 3xx: no error class says what it is
