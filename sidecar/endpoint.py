"""Addresses: `Endpoint` (where the sidecar listens or connects), and the one translation of
"that address is taken" into `PortInUseError`, whose message names the flag to change.

`serve` exits 2 with that message on one line: see `sidecar.serve.run_sidecar`.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """A TCP `host:port` or a Unix socket path."""

    host: str = ""
    port: int = 0
    unix_path: str | None = None

    def __str__(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"

    @property
    def grpc_target(self) -> str:
        """The address as a gRPC channel target (`unix:path`, `host:port`, `[v6]:port`)."""
        if self.unix_path:
            return f"unix:{self.unix_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class PortInUseError(OSError):
    """A listening address is already taken by another process; `strerror` says which."""


def port_in_use(address: str, what: str, flag: str) -> PortInUseError:
    """The error for `what` (e.g. "/metrics") that cannot listen on `address`, set by `flag`."""
    return PortInUseError(
        errno.EADDRINUSE,
        f"cannot listen on {address} for {what}: the address is already in use "
        f"(choose another with {flag}, or stop the process using it)",
    )


@contextmanager
def translate_bind_errors(address: str, what: str, flag: str) -> Iterator[None]:
    """Raise `port_in_use(address, what, flag)` for an `EADDRINUSE` raised inside; any other
    error passes unchanged."""
    try:
        yield
    except PortInUseError:
        raise
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise port_in_use(address, what, flag) from None
        raise
