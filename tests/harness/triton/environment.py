"""A private virtual environment holding NVIDIA's `tritonserver` binary (from `nvidia-pytriton`).

The wheel pins `numpy<2` and brings its own client; keeping it in its own venv keeps the
sidecar's environment free of those constraints. The venv's Python also runs the Python
backend's models, so the packages those models import (ONNX Runtime) are installed into it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.harness import REPO_ROOT

log = logging.getLogger(__name__)

TRITON_PACKAGES = ("nvidia-pytriton>=0.5,<0.8", "onnxruntime>=1.17,<2", "numpy<2")
HOME_ENV = "XSP_TRITON_HOME"


class TritonSetupError(RuntimeError):
    """The local Triton environment could not be created or is incomplete."""


def default_home() -> Path:
    """Where the Triton venv lives: `$XSP_TRITON_HOME`, else `.triton/` in this checkout."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser().resolve()
    return REPO_ROOT / ".triton"


@dataclass(frozen=True)
class TritonEnvironment:
    """Paths needed to start the bundled `tritonserver`."""

    venv: Path
    server_binary: Path
    backend_dir: Path
    library_dir: Path

    @property
    def bin_dir(self) -> Path:
        return self.venv / "bin"

    def process_env(self) -> dict[str, str]:
        """Environment for `tritonserver`: bundled libraries, and the venv first on PATH (the
        Python backend stub finds its interpreter's packages that way; PYTHONPATH is ignored)."""
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.library_dir), env.get("LD_LIBRARY_PATH", "")) if p
        )
        env["PATH"] = os.pathsep.join((str(self.bin_dir), env.get("PATH", "")))
        env["VIRTUAL_ENV"] = str(self.venv)
        return env


def _site_packages(venv: Path) -> Path:
    candidates = sorted((venv / "lib").glob("python3*/site-packages"))
    if not candidates:
        raise TritonSetupError(
            f"no site-packages under {venv}/lib; delete {venv} and run `bash scripts/setup.sh` "
            "again"
        )
    return candidates[0]


def locate(venv: Path) -> TritonEnvironment:
    """Find the server binary, backends and bundled libraries inside an installed venv."""
    site = _site_packages(venv)
    root = site / "pytriton" / "tritonserver"
    env = TritonEnvironment(
        venv=venv,
        server_binary=root / "bin" / "tritonserver",
        backend_dir=root / "backends",
        library_dir=site / "nvidia_pytriton.libs",
    )
    # the venv's own interpreter too: the Python backend's stub finds its packages through it
    for path in (venv / "pyvenv.cfg", env.server_binary, env.backend_dir, env.library_dir):
        if not path.exists():
            raise TritonSetupError(
                f"{path} is missing: the nvidia-pytriton install in {venv} is incomplete; "
                f"delete {venv} and run `bash scripts/setup.sh` again"
            )
    _install_python_backend_stub(root, venv)
    return env


def _install_python_backend_stub(root: Path, venv: Path) -> None:
    """Copy the stub built for the venv's Python version next to the Python backend."""
    target = root / "backends" / "python" / "triton_python_backend_stub"
    if target.exists():
        return
    version = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonSetupError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    shutil.copy2(stub, target)


def ensure_environment(home: Path | None = None, *, python: str | None = None) -> TritonEnvironment:
    """Create (once) and return the Triton venv under `home`."""
    home = home or default_home()
    venv = home / "venv"
    marker = venv / ".xsp-ready"
    if not marker.exists():
        log.info("creating the Triton environment in %s (one time, ~30 s)", venv)
        home.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                [python or sys.executable, "-m", "venv", "--clear", str(venv)], check=True
            )
            subprocess.run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    *TRITON_PACKAGES,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        except subprocess.CalledProcessError as exc:
            tail = "\n".join(((exc.stderr or "") + (exc.stdout or "")).splitlines()[-20:])
            raise TritonSetupError(
                f"installing {' '.join(TRITON_PACKAGES)} into {venv} failed "
                f"(exit {exc.returncode}); check that PyPI is reachable:\n{tail}"
            ) from None
        marker.write_text("ok\n")
    return locate(venv)


def main() -> int:
    """`python -m tests.harness.triton.environment`: create the Triton venv and say where it is."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        env = ensure_environment()
    except TritonSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"tritonserver: {env.server_binary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
