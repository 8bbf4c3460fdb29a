"""Check that the relay's C extensions are built: `python -m sidecar.proxy.native_check`.

Prints one line where all of `native.EXTENSIONS` import, else one per extension. With
`--require`, exits 1 when one does not import where a C compiler exists, naming it and
showing its build error: the lines of `--log` (pip's output) that name its source, or else
those of a fresh `setup.py build_ext` in a scratch folder (pip hides an optional extension's
failed build). scripts/setup.sh runs
it after every install, so a C build that fails makes CI fail; setup.py keeps the
extensions optional so that installing without a compiler still works (pure-Python relay).

The check imports the extensions whatever `XSP_NATIVE` says: it is about the build.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from sidecar.proxy.native import EXTENSIONS

SOURCES = Path(__file__).resolve().parent
SETUP_PY = SOURCES.parent.parent / "setup.py"  # present in a checkout, not in an install
SHOWN = 30  # build-error lines shown per extension


def import_error(name: str) -> str | None:
    """Why `sidecar.proxy.<name>` does not import, or None where it does."""
    try:
        importlib.import_module(f"sidecar.proxy.{name}")
    except ImportError as exc:
        return str(exc)
    return None


def compiler() -> str | None:
    """The C compiler setuptools would use, where it is on PATH."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(cc[0]) if cc else None


def error_lines(text: str, name: str) -> list[str]:
    """The lines of a build's output about extension `name`: compiler diagnostics of its
    source and the warning that its build failed."""
    source = f"{name}.c"
    keep = [
        line
        for line in text.splitlines()
        if source in line or f"sidecar.proxy.{name}" in line or "error:" in line.lower()
    ]
    return keep[:SHOWN]


def rebuild(name: str) -> str:
    """Build the extensions from this checkout into a scratch folder; its output."""
    if not SETUP_PY.is_file():
        return f"(no setup.py beside {SOURCES}: cannot rebuild {name} to show its error)"
    with tempfile.TemporaryDirectory(prefix="xsp-native-") as tmp:
        done = subprocess.run(
            [sys.executable, str(SETUP_PY), "build_ext", "--build-temp", tmp, "--build-lib", tmp],
            cwd=SETUP_PY.parent,
            capture_output=True,
            text=True,
            check=False,
        )
    return done.stdout + done.stderr


def build_error(name: str, log: Path | None) -> list[str]:
    """The build error of extension `name`: from `log` where it has one, else rebuilt."""
    if log is not None and log.is_file():
        lines = error_lines(log.read_text(errors="replace"), name)
        if lines:
            return [f"(from {log})", *lines]
    return ["(from a rebuild: setup.py build_ext)", *error_lines(rebuild(name), name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--require", action="store_true", help="exit 1 if one is missing")
    parser.add_argument("--log", type=Path, help="the install's output (pip's log)")
    args = parser.parse_args(argv)
    errors = {name: import_error(name) for name in EXTENSIONS}
    missing = [name for name, error in errors.items() if error is not None]
    if not missing:
        print(f"==> relay C extensions built: {', '.join(EXTENSIONS)}")
        return 0
    for name, error in errors.items():
        print(f"sidecar.proxy.{name}: " + ("built" if error is None else f"MISSING ({error})"))
    if not args.require:
        return 0
    cc = compiler()
    if cc is None:
        print("no C compiler: the relay runs its pure-Python paths (not an error here)")
        return 0
    for name in missing:
        print(f"\nerror: the C extension sidecar.proxy.{name} did not build ({cc} exists):")
        for line in build_error(name, args.log):
            print(f"  {line}")
    print(f"\nnot built: {', '.join(missing)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
