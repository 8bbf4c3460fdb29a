"""A sampled HTTP request as a replay job's message: its body and what decoding it needs.

The HTTP sampling hook packs the request (`pack`) where the gRPC hook hands over the request's
protobuf message; the job method's decoder (`kserve_http_decode`, `tf_rest_decode`) unpacks it
(`unpack`). The packed bytes are a magic, a 4-byte big-endian length and a small JSON header,
then the body unchanged:

- `json_length`: how many of the body's first bytes are JSON, the rest being binary tensors
  (Triton's `Inference-Header-Content-Length`); null: the whole body is JSON;
- `target`: the request target (path and query) as received: the decoders read the model
  version (`/versions/{v}`) and TF-Serving's version label (`/labels/{l}`) from it, since
  neither is in the body;
- `encoding`: the body's `Content-Encoding` (`gzip`, `deflate`; "" for none), undone by `unpack`.

Records of the relay's process stay light: this module imports only the standard library.
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import NamedTuple

MAGIC = b"xsp-http\x01"
_HEADER_LIMIT = 64 << 10  # a packed header's JSON: a request target and two small fields
ENCODINGS = ("", "identity", "gzip", "deflate")


class HttpMessageError(ValueError):
    """The bytes are not a packed HTTP request, or its body cannot be read as packed."""


class HttpMessage(NamedTuple):
    """An unpacked HTTP request: its JSON part, its binary part (b"" where none), its target."""

    json: bytes
    binary: bytes
    target: str = ""


def pack(body: bytes, json_length: int | None, *, target: str = "", encoding: str = "") -> bytes:
    """The job message of an HTTP request: `body` (de-chunked, as sent), `json_length` (see the
    module docstring; None: all JSON), its `target` and `Content-Encoding`. Raises
    `HttpMessageError` where `json_length` cannot describe the body or the encoding is not one
    `unpack` undoes."""
    encoding = encoding.strip().lower()
    if encoding not in ENCODINGS:
        raise HttpMessageError(f"the body's Content-Encoding {encoding!r} cannot be decoded")
    if json_length is not None and json_length < 0:
        raise HttpMessageError(f"a JSON length of {json_length} bytes")
    if json_length is not None and not encoding and json_length > len(body):
        raise HttpMessageError(
            f"the JSON part is said to be {json_length} bytes, the body has {len(body)}"
        )
    header = json.dumps(
        {"json_length": json_length, "target": target, "encoding": encoding},
        separators=(",", ":"),
    ).encode()
    return b"".join((MAGIC, len(header).to_bytes(4, "big"), header, body))


def unpack(message: bytes) -> HttpMessage:
    """A packed request's JSON and binary parts (its body decompressed) and its target."""
    start = len(MAGIC) + 4
    if message[: len(MAGIC)] != MAGIC or len(message) < start:
        raise HttpMessageError("the message is not an HTTP request packed by http_message.pack")
    size = int.from_bytes(message[len(MAGIC) : start], "big")
    if size > _HEADER_LIMIT or start + size > len(message):
        raise HttpMessageError("the packed HTTP request's header is cut short")
    try:
        header = json.loads(message[start : start + size])
        json_length, target, encoding = header["json_length"], header["target"], header["encoding"]
    except (ValueError, KeyError, TypeError):
        raise HttpMessageError("the packed HTTP request's header is not readable") from None
    body = _decoded(bytes(message[start + size :]), encoding)
    if json_length is None:
        return HttpMessage(body, b"", target)
    if not isinstance(json_length, int) or not 0 <= json_length <= len(body):
        raise HttpMessageError(
            f"the JSON part is said to be {json_length} bytes (Inference-Header-Content-Length), "
            f"the body has {len(body)}"
        )
    return HttpMessage(body[:json_length], body[json_length:], target)


def _decoded(body: bytes, encoding: str) -> bytes:
    try:
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            try:
                return zlib.decompress(body)
            except zlib.error:  # a raw deflate stream, as some clients send
                return zlib.decompress(body, -zlib.MAX_WBITS)
    except (OSError, EOFError, zlib.error) as exc:
        raise HttpMessageError(
            f"the {encoding}-encoded body cannot be decompressed: {exc}"
        ) from None
    return body


def target_path(target: str) -> str:
    """The path of a request target (its query cut; an absolute-form target's host too)."""
    path = target.partition("?")[0]
    if not path.startswith("/") and "://" in path:
        path = "/" + path.partition("://")[2].partition("/")[2]
    return path
