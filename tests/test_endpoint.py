"""A taken listening address becomes one `PortInUseError` naming the flag to change."""

from __future__ import annotations

import errno
import socket

import pytest

from sidecar.endpoint import Endpoint, PortInUseError, translate_bind_errors


def test_endpoint_text() -> None:
    assert str(Endpoint("127.0.0.1", 8011)) == "127.0.0.1:8011"
    assert str(Endpoint(unix_path="/tmp/x.sock")) == "unix:/tmp/x.sock"


def test_a_taken_port_names_what_and_the_flag() -> None:
    with socket.socket() as busy, socket.socket() as other:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with (
            pytest.raises(PortInUseError) as info,
            translate_bind_errors(f"127.0.0.1:{port}", "/metrics", "--metrics-port"),
        ):
            other.bind(("127.0.0.1", port))
    assert info.value.errno == errno.EADDRINUSE
    assert info.value.strerror == (
        f"cannot listen on 127.0.0.1:{port} for /metrics: the address is already in use "
        "(choose another with --metrics-port, or stop the process using it)"
    )
    assert info.value.__suppress_context__


def test_other_errors_pass_unchanged() -> None:
    error = OSError(errno.EACCES, "Permission denied")
    with pytest.raises(OSError) as info, translate_bind_errors("0.0.0.0:80", "x", "--x"):
        raise error
    assert info.value is error and not isinstance(info.value, PortInUseError)
