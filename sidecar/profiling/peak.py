"""This machine's peak FLOP/s and memory bandwidth from a short micro-benchmark, cached.

Used to draw a roofline without GPU counters. A float32 matmul (numpy's BLAS) gives the
compute roof, a large array copy the memory roof (read + write bytes). Results are cached
in `$XSP_CACHE_DIR/peak.json` (default `~/.cache/xsp-sidecar`), keyed by CPU and numpy.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CACHE_ENV = "XSP_CACHE_DIR"


@dataclass(frozen=True)
class Peak:
    """Measured roofs of one machine."""

    flops_per_s: float
    dram_bytes_per_s: float
    source: str = "cpu-microbenchmark"
    machine: str = ""
    measured_ns: int = 0


def cache_dir() -> Path:
    """`$XSP_CACHE_DIR` or `~/.cache/xsp-sidecar`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "xsp-sidecar"


def machine_key() -> str:
    """CPU model, core count and numpy version: what the cached peak depends on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | cpus={os.cpu_count()} | numpy={np.__version__}"


def _best_rate(work: float, fn: object, budget_s: float, min_reps: int = 2) -> float:
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return work / best


def measure(budget_s: float = 1.5) -> Peak:
    """Run the micro-benchmarks (about `budget_s` seconds) and return the roofs."""
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)  # warm BLAS threads
    flops = _best_rate(2.0 * n**3, lambda: np.matmul(a, b, out=c), budget_s * 0.6)
    src = np.ones(16 * 1024 * 1024, dtype=np.float32)  # 64 MiB, far larger than caches
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bw = _best_rate(2.0 * src.nbytes, lambda: np.copyto(dst, src), budget_s * 0.4)
    return Peak(flops, bw, "cpu-microbenchmark", machine_key(), time.time_ns())


def get_peak(refresh: bool = False, path: Path | None = None) -> Peak:
    """The cached peak for this machine, measuring (and caching) it when absent or stale."""
    path = path or cache_dir() / "peak.json"
    key = machine_key()
    if not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("machine") == key:
                return Peak(**data)
        except (OSError, ValueError, TypeError):
            pass
    peak = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(peak), indent=2))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home must not stop profiling
    return peak
