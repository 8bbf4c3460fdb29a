"""NVIDIA's perf_analyzer (from the tritonclient 2.51 wheel) as a second load generator.

The binary needs `libb64.so.0d` and `libcudart.so.12`; both ship in `nvidia_pytriton.libs`
under hashed names, so they are linked under their plain names in a temporary folder.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

NEEDED = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


@dataclass(frozen=True)
class PerfAnalyzerResult:
    throughput: float
    p50_ms: float
    p99_ms: float


def find_binary() -> str | None:
    return shutil.which("perf_analyzer")


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
