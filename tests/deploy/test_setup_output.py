"""`scripts/setup.sh` run again with nothing changed says so in a few lines: no reinstall, no
setuptools warnings, no pip banners.

It runs the real script in a scratch copy of the checkout's set-up inputs (the script and
pyproject.toml) whose `.venv` is the environment running the tests and whose `tests/` is the
checkout's (the harness that prepares Triton), so it reuses that environment's set-up stamp and
the checkout's Triton and never touches the checkout.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)


def _installed_by_this_setup() -> bool:
    """The running environment's stamp says this pyproject.toml and setup.sh installed it (if
    not, the script would reinstall into it, which a test must not do)."""
    stamp = VENV / ".xsp-setup-stamp"
    if not stamp.is_file():
        return False
    inputs = b"".join((ROOT / name).read_bytes() for name in setup_inputs())
    want = f"{hashlib.sha256(inputs).hexdigest()} Python {platform.python_version()}"
    return stamp.read_text().strip() == want


def setup_inputs() -> list[str]:
    """What setup.sh hashes into its stamp, in its order: pyproject.toml, setup.py, the script,
    the relay's C sources (the shell's sorted globs)."""
    proxy = ROOT / "sidecar" / "proxy"
    c_sources = [f"sidecar/proxy/{p.name}" for p in sorted(proxy.glob("*.c"))]
    headers = [f"sidecar/proxy/{p.name}" for p in sorted(proxy.glob("*.h"))]
    return ["pyproject.toml", "setup.py", "scripts/setup.sh", *c_sources, *headers]


@pytest.mark.skipif(
    not _installed_by_this_setup(),
    reason="the test environment was not set up by this checkout's scripts/setup.sh",
)
def test_second_setup_run_is_quiet(tmp_path: Path) -> None:
    for name in setup_inputs():
        if name.startswith("sidecar/"):
            continue  # the package itself, linked below
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    # the C sources it hashes, and the package whose built extensions its last check imports
    # (`python -m sidecar.proxy.native_check` runs in the copy)
    (tmp_path / "sidecar").symlink_to(ROOT / "sidecar", target_is_directory=True)
    (tmp_path / ".venv").symlink_to(VENV, target_is_directory=True)
    # its last step runs `python -m tests.harness.triton.environment`, which finds the
    # checkout's `.triton/` through the link
    (tmp_path / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    run = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    lines = output.splitlines()
    assert "==> .venv is up to date" in lines[0], output
    assert len(lines) <= 4, output
    for noise in ("WARNING", "warning: ", "Successfully installed", "Requirement already",
                  "[notice]", "Obtaining file", "Building editable"):  # fmt: skip
        assert noise not in output, output
