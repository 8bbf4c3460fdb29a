"""Bandwidth roofs of this CPU's cache levels (L1, L2, L3) and of DRAM, measured.

A layer whose tensors fit in a cache reads them at that cache's bandwidth, so on a roofline
drawn with the DRAM roof alone it runs "above the roof" by design. As the Empirical Roofline
Toolkit does, one kernel is timed over working sets sized for each level (half its size, so
that the buffer stays resident), and each layer is later judged against the roof of the
smallest level that holds its working set (`analysis.analyses.roofline.memory_roof`).

The kernel: numpy's max-reduction along the rows of a read-only view that repeats one buffer
(stride 0), so one numpy call reads the buffer many times and Python's per-call cost does not
hide the L1 figure. It measures one core's read bandwidth, the best of repeated timings within
a time budget (load only slows a run down). Cache sizes come from
`/sys/devices/system/cpu/cpu0/cache` (Linux), else from `os.sysconf`.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided

LEVELS = ("L1", "L2", "L3")
SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
SOURCE = "measured (one core, read)"
_SYSCONF = {
    "L1": "SC_LEVEL1_DCACHE_SIZE",
    "L2": "SC_LEVEL2_CACHE_SIZE",
    "L3": "SC_LEVEL3_CACHE_SIZE",
}
_STREAM_BYTES = 64 * 2**20  # bytes one timed call reads, whatever the buffer's size
_MIN_DRAM_BYTES = 64 * 2**20


@dataclass(frozen=True)
class CacheRoofs:
    """Per level (`L1`, `L2`, `L3`, `DRAM`): its size in bytes (caches only) and the
    bandwidth measured over a working set that fits it."""

    sizes_bytes: dict[str, int] = field(default_factory=dict)
    bytes_per_s: dict[str, float] = field(default_factory=dict)
    source: str = SOURCE


def _size(text: str) -> int:
    """`32K`, `1024K`, `32M` or a plain byte count, as sysfs writes a cache's size."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a cache size: {text!r}")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def cache_sizes(root: Path = SYSFS) -> dict[str, int]:
    """The data (or unified) cache size of each level cpu0 has, in bytes: sysfs first, then
    `os.sysconf`; levels neither knows are left out."""
    sizes: dict[str, int] = {}
    for index in sorted(root.glob("index*")):
        try:
            number = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and 1 <= number <= len(LEVELS) and size > 0:
            sizes[f"L{number}"] = size
    for level, name in _SYSCONF.items():
        if level in sizes:
            continue
        try:
            value = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if value > 0:
            sizes[level] = int(value)
    return sizes


def read_bandwidth(working_set: int, budget_s: float = 0.1, min_reps: int = 3) -> float:
    """Bytes per second read from a buffer of `working_set` bytes, read again and again:
    the best of at least `min_reps` timed calls within `budget_s` seconds."""
    x = np.ones(max(working_set // 4, 16), dtype=np.float32)
    rows = max(1, _STREAM_BYTES // x.nbytes)
    view = as_strided(x, shape=(rows, x.size), strides=(0, x.itemsize), writeable=False)
    out = np.empty(rows, dtype=np.float32)
    np.maximum.reduce(view, axis=1, out=out)  # touch the buffer: it is resident from here
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        np.maximum.reduce(view, axis=1, out=out)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return rows * x.nbytes / best


def measure_cache_roofs(budget_s: float = 0.6, sizes: dict[str, int] | None = None) -> CacheRoofs:
    """Read bandwidth over half of each cache level and over a buffer four times the largest
    (at least 64 MiB) for DRAM, in about `budget_s` seconds."""
    sizes = dict(cache_sizes() if sizes is None else sizes)
    share = budget_s / (len(sizes) + 1)
    bandwidth = {level: read_bandwidth(size // 2, share) for level, size in sizes.items()}
    dram = max([_MIN_DRAM_BYTES, *(4 * s for s in sizes.values())])
    bandwidth["DRAM"] = read_bandwidth(dram, share)
    return CacheRoofs(sizes, bandwidth)
