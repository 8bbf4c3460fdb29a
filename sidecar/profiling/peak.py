"""This machine's peak FLOP/s and memory bandwidth from a short micro-benchmark, cached.

Used to draw a roofline without GPU counters. A float32 matmul (numpy's BLAS) gives the
compute roof, a large array copy the memory roof (read + write bytes). Results are cached
in `$XSP_CACHE_DIR/peak.json` (default `~/.cache/xsp-sidecar`), keyed by CPU and numpy.

Load can only make a micro-benchmark slower, never faster, so a peak is the best of several
rounds, each round's matmul and copy interleaved so that a burst of load hits only some of
them; the load average when it was measured is recorded with it. A peak measured under
load (`BUSY`) is measured again when the machine is quieter, a new measurement never lowers
a cached one, and `remeasure_if_beaten` measures again when a layer ran faster than the
peak. API: `get_peak()` -> `Peak`; `Peak.trace_attributes()` for the trace.

Beside the two roofs, a peak holds the cache levels' bandwidth roofs (`cache_roofs`: L1, L2,
L3 and DRAM over working sets that fit each). A peak cached before they existed gets them
measured on its next use, the rest of it kept.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.cache_roofs import CacheRoofs, measure_cache_roofs
from sidecar.trace import schema

CACHE_ENV = "XSP_CACHE_DIR"
BUSY = 0.5  # 1-minute load average per CPU above which a measurement counts as under load
ROUNDS = 5


@dataclass(frozen=True)
class Peak:
    """Measured roofs of one machine, and the conditions they were measured under."""

    flops_per_s: float
    dram_bytes_per_s: float
    source: str = "cpu-microbenchmark"
    machine: str = ""
    measured_ns: int = 0
    load_per_cpu: float | None = None  # 1-minute load average / CPUs when measured
    rounds: int = 0
    cache_sizes_bytes: dict[str, int] | None = None  # L1, L2, L3 (cache_roofs)
    cache_bytes_per_s: dict[str, float] | None = None  # L1, L2, L3 and DRAM
    cache_source: str | None = None

    @property
    def under_load(self) -> bool:
        return self.load_per_cpu is not None and self.load_per_cpu > BUSY

    def trace_attributes(self) -> dict[str, Any]:
        """What a trace records about its peak (the report shows the source and date)."""
        attrs: dict[str, Any] = {
            schema.PEAK_FLOPS_PER_S: self.flops_per_s,
            schema.PEAK_DRAM_BYTES_PER_S: self.dram_bytes_per_s,
            schema.PEAK_SOURCE: self.source,
            schema.PEAK_MEASURED_NS: self.measured_ns,
            schema.PEAK_ROUNDS: self.rounds,
        }
        if self.load_per_cpu is not None:
            attrs[schema.PEAK_LOAD_PER_CPU] = round(self.load_per_cpu, 3)
        if self.cache_bytes_per_s:
            attrs[schema.PEAK_CACHE_BYTES_PER_S] = dict(self.cache_bytes_per_s)
            attrs[schema.CACHE_SIZES_BYTES] = dict(self.cache_sizes_bytes or {})
            attrs[schema.PEAK_CACHE_SOURCE] = self.cache_source
        return attrs

    def with_cache(self, roofs: CacheRoofs) -> Peak:
        """This peak with the cache levels' roofs (the better of these and any it has)."""
        have = self.cache_bytes_per_s or {}
        best = {k: max(v, have.get(k, 0.0)) for k, v in roofs.bytes_per_s.items()}
        return replace(
            self,
            cache_sizes_bytes=dict(roofs.sizes_bytes),
            cache_bytes_per_s=best,
            cache_source=roofs.source,
        )


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


def load_per_cpu() -> float | None:
    """The 1-minute load average divided by the CPU count (None where unknown)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def _best_time(fn: Callable[[], object], budget_s: float, min_reps: int = 2) -> float:
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def measure(budget_s: float = 1.5, rounds: int = ROUNDS) -> Peak:
    """Run the micro-benchmarks (about `budget_s` seconds in `rounds` interleaved rounds,
    then the cache levels' roofs) and return the best roofs seen."""
    load = load_per_cpu()
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)  # warm BLAS threads
    src = np.ones(16 * 1024 * 1024, dtype=np.float32)  # 64 MiB, far larger than caches
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t_mm = t_copy = float("inf")
    share = budget_s / max(1, rounds)
    for _ in range(max(1, rounds)):
        t_mm = min(t_mm, _best_time(lambda: np.matmul(a, b, out=c), share * 0.6))
        t_copy = min(t_copy, _best_time(lambda: np.copyto(dst, src), share * 0.4))
    return Peak(
        2.0 * n**3 / t_mm,
        2.0 * src.nbytes / t_copy,
        "cpu-microbenchmark",
        machine_key(),
        time.time_ns(),
        load,
        max(1, rounds),
    ).with_cache(measure_cache_roofs())


def _read(path: Path, key: str) -> Peak | None:
    try:
        data = json.loads(path.read_text())
        peak = Peak(**data)
    except (OSError, ValueError, TypeError):
        return None
    return peak if peak.machine == key else None


def write_cache(path: Path, peak: Any) -> None:
    """Store a measured peak (a dataclass) as JSON, atomically; a read-only home is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(peak), indent=2))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home must not stop profiling


def best_of(old: Peak | None, new: Peak) -> Peak:
    """Keep the higher roof of two measurements of one machine (load only slows one down);
    the record says when and under what load the compute roof was measured."""
    if old is None or old.machine != new.machine:
        return new
    dram = max(old.dram_bytes_per_s, new.dram_bytes_per_s)
    best = replace(old if old.flops_per_s > new.flops_per_s else new, dram_bytes_per_s=dram)
    caches = [p for p in (old, new) if p.cache_bytes_per_s]
    for p in caches:
        roofs = CacheRoofs(p.cache_sizes_bytes or {}, p.cache_bytes_per_s or {})
        best = best.with_cache(replace(roofs, source=p.cache_source or roofs.source))
    return best


def get_peak(
    refresh: bool = False,
    path: Path | None = None,
    measure_fn: Callable[[], Peak] = measure,
    measure_cache_fn: Callable[[], CacheRoofs] = measure_cache_roofs,
) -> Peak:
    """The cached peak for this machine, measuring (and caching) it when absent, stale,
    asked for, or measured under load while the machine is quieter now; a cached peak
    without cache roofs gets them (`measure_cache_fn`)."""
    path = path or cache_dir() / "peak.json"
    cached = _read(path, machine_key())
    if cached is not None and not refresh:
        now = load_per_cpu()
        quieter = now is not None and now <= BUSY
        if not (cached.under_load and quieter):
            if not cached.cache_bytes_per_s:
                cached = cached.with_cache(measure_cache_fn())
                write_cache(path, cached)
            return cached
    peak = best_of(cached, measure_fn())
    write_cache(path, peak)
    return peak


def remeasure_if_beaten(
    peak: Peak,
    achieved_flops_per_s: float,
    path: Path | None = None,
    measure_fn: Callable[[], Peak] = measure,
) -> Peak:
    """A layer ran at `achieved_flops_per_s`: if that beats the peak, measure again (the
    peak was taken under load, or on a worse day) and keep the better one. The result can
    still be below the layer (estimated FLOPs can be too high); the report flags that."""
    if achieved_flops_per_s <= peak.flops_per_s or peak.source != "cpu-microbenchmark":
        return peak
    path = path or cache_dir() / "peak.json"
    better = best_of(peak, measure_fn())
    if better.machine == machine_key():
        write_cache(path, better)
    return better
