"""The relay's own answers to requests it does not forward.

Each is a complete HTTP/1.1 response with a Triton-style JSON body `{"error": "..."}` and
`Connection: close`: the relay closes the connection after it (the request stream's framing
cannot be trusted any more, or the backend cannot be reached). The reason names are the label
values of `xsp_http_refused_total{reason}`.
"""

from __future__ import annotations

import json

MALFORMED = "malformed"  # not HTTP/1.x the parser accepts: 400
HEADER_TOO_LARGE = "header_too_large"  # header block over HttpLimits.header_bytes: 431
BODY_TOO_LARGE = "body_too_large"  # body over HttpLimits.body_bytes: 413
HEADER_TIMEOUT = "header_timeout"  # header block not complete in time (slowloris): 408
SMUGGLING = "smuggling"  # ambiguous framing (Content-Length with Transfer-Encoding...): 400
UPGRADE = "upgrade"  # an upgrade request with a body (llhttp would not parse it): 400
BACKEND_UNAVAILABLE = "backend_unavailable"  # the backend connection failed: 503

REASONS = (
    MALFORMED, HEADER_TOO_LARGE, BODY_TOO_LARGE, HEADER_TIMEOUT, SMUGGLING, UPGRADE,
    BACKEND_UNAVAILABLE,
)  # fmt: skip

STATUS = {
    MALFORMED: (400, "Bad Request"),
    HEADER_TOO_LARGE: (431, "Request Header Fields Too Large"),
    BODY_TOO_LARGE: (413, "Payload Too Large"),
    HEADER_TIMEOUT: (408, "Request Timeout"),
    SMUGGLING: (400, "Bad Request"),
    UPGRADE: (400, "Bad Request"),
    BACKEND_UNAVAILABLE: (503, "Service Unavailable"),
}
MAX_MESSAGE = 1024  # characters of a refusal's error text


def refusal(reason: str, message: str) -> bytes:
    """The response refusing one request for `reason` (a `REASONS` name)."""
    status, phrase = STATUS[reason]
    body = json.dumps({"error": message[:MAX_MESSAGE]}).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
