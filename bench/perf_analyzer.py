"""NVIDIA's perf_analyzer (from the tritonclient 2.51 wheel) as a second load generator.

The sidecar's own tritonclient is newer and ships no perf_analyzer (the separate
`perf-analyzer` wheels need glibc 2.38), so unless one is on PATH the binary is taken once
from the tritonclient 2.51 wheel (`pip download`, nothing installed) into `.cache/`.
It needs `libb64.so.0d` and `libcudart.so.12`; both ship in `nvidia_pytriton.libs`
under hashed names, so they are linked under their plain names in a temporary folder.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

NEEDED = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


@dataclass(frozen=True)
class PerfAnalyzerResult:
    throughput: float
    p50_ms: float
    p99_ms: float


WHEEL_VERSION = "2.51.0"  # the tritonclient whose perf_analyzer runs on glibc 2.36
CACHE = Path(__file__).resolve().parent.parent / ".cache" / f"perf_analyzer-{WHEEL_VERSION}"


def find_binary() -> str | None:
    """`perf_analyzer` on PATH, else the one taken from the tritonclient 2.51 wheel."""
    found = shutil.which("perf_analyzer")
    if found is not None:
        return found
    binary = CACHE / "perf_analyzer"
    if not binary.exists():
        try:
            fetch(binary)
        except (OSError, subprocess.SubprocessError, KeyError, StopIteration) as exc:
            print(f"perf_analyzer: not on PATH, tritonclient {WHEEL_VERSION}'s not taken: {exc}")
            return None
    return str(binary)


def fetch(binary: Path) -> None:
    """Download the tritonclient 2.51 wheel (no dependencies) and keep only perf_analyzer."""
    with tempfile.TemporaryDirectory(prefix="xsp-pa-wheel-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", f"tritonclient=={WHEEL_VERSION}", "--dest", tmp],
            check=True, timeout=600,
        )  # fmt: skip
        wheel = next(Path(tmp).glob("tritonclient-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(f"tritonclient-{WHEEL_VERSION}.data/data/bin/perf_analyzer")
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, binary)


def library_dir(pytriton_libs: Path, into: Path) -> Path:
    for name, pattern in NEEDED.items():
        matches = sorted(pytriton_libs.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"{pattern} not found in {pytriton_libs}")
        link = into / name
        if not link.exists():
            link.symlink_to(matches[0])
    return into


def run(
    binary: str, address: str, concurrency: int, seconds: float, pytriton_libs: Path
) -> PerfAnalyzerResult:
    """perf_analyzer on `add_sub` (16 floats per input) at one concurrency."""
    with tempfile.TemporaryDirectory(prefix="xsp-pa-") as tmp:
        libs = library_dir(pytriton_libs, Path(tmp))
        report = Path(tmp) / "report.csv"
        cmd = [
            binary, "-m", "add_sub", "-i", "grpc", "-u", address,
            "--concurrency-range", f"{concurrency}:{concurrency}",
            "--shape", "INPUT0:16", "--shape", "INPUT1:16",
            "--measurement-interval", str(int(seconds * 1000)), "--percentile", "99",
            "-f", str(report),
        ]  # fmt: skip
        env = {"LD_LIBRARY_PATH": f"{libs}:{pytriton_libs}", "PATH": "/usr/bin:/bin"}
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=600)
        with report.open() as fh:
            row = next(csv.DictReader(fh))
    return PerfAnalyzerResult(
        throughput=float(row["Inferences/Second"]),
        p50_ms=float(row["p50 latency"]) / 1000.0,
        p99_ms=float(row["p99 latency"]) / 1000.0,
    )
