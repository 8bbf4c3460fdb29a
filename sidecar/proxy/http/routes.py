"""What the HTTP relay asks of the backend's record: the call a request line names.

`sidecar.backends.base.Backend.http_route(verb, target)` (the record's `http_routes`) answers
with an `HttpCall(method, model)`: the method label (the gRPC short name of the same call, or
`_unknown`) and the percent-decoded model name (None where the route names none). The relay
depends only on that shape, spelled here as a Protocol.
"""

from __future__ import annotations

from typing import Protocol


class RoutedCall(Protocol):
    """`HttpCall`'s fields the relay reads."""

    @property
    def method(self) -> str: ...

    @property
    def model(self) -> str | None: ...


class HttpRoutes(Protocol):
    """A backend record's HTTP routes (`Backend.http_route`)."""

    def http_route(self, verb: bytes, target: bytes) -> RoutedCall: ...
