"""A throw-away self-signed certificate for `localhost`, made by the openssl command."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files under `tmp`; skips the test where openssl is missing."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key_path), "-out", str(cert_path), "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert_path, key_path
