"""Cache levels' bandwidth roofs: sizes read from sysfs, bandwidth measured on this machine,
recorded with the peak and in the trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.profiling import cache_roofs, peak


def _sysfs(root: Path, entries: list[tuple[int, str, str]]) -> Path:
    for i, (level, kind, size) in enumerate(entries):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_cache_sizes_come_from_sysfs_data_and_unified_caches(tmp_path: Path) -> None:
    root = _sysfs(
        tmp_path,
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
         (3, "Unified", "32M")],
    )  # fmt: skip
    assert cache_roofs.cache_sizes(root) == {"L1": 48 * 2**10, "L2": 2 * 2**20, "L3": 32 * 2**20}


def test_this_machines_caches_grow_with_their_level() -> None:
    sizes = cache_roofs.cache_sizes()
    if not sizes:
        pytest.skip("this machine names no cache sizes (neither sysfs nor sysconf)")
    ordered = [sizes[k] for k in cache_roofs.LEVELS if k in sizes]
    assert ordered == sorted(ordered), f"cache sizes out of order: {sizes}"


def test_l1_reads_faster_than_dram_on_this_machine() -> None:
    roofs = cache_roofs.measure_cache_roofs(budget_s=0.4)
    bw = roofs.bytes_per_s
    assert set(roofs.sizes_bytes) <= set(bw) and "DRAM" in bw
    if "L1" not in bw:
        pytest.skip("this machine names no L1 size")
    gbps = {k: round(v / 1e9, 1) for k, v in bw.items()}
    assert bw["L1"] > bw["DRAM"], (
        f"a buffer resident in L1 read slower than one four times the last-level cache "
        f"(GB/s: {gbps}): the kernel no longer measures cache bandwidth"
    )


def test_a_cached_peak_without_cache_roofs_gets_them_and_the_trace_records_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "peak.json"
    old = peak.Peak(90e9, 20e9, "cpu-microbenchmark", peak.machine_key(), 1, 0.1, 5)
    path.write_text(json.dumps(old.__dict__))  # as cached before cache roofs existed
    monkeypatch.setattr(peak, "load_per_cpu", lambda: 0.1)
    got = peak.get_peak(path=path)
    assert got.flops_per_s == 90e9 and got.dram_bytes_per_s == 20e9  # the rest kept
    assert got.cache_bytes_per_s is not None and "DRAM" in got.cache_bytes_per_s
    assert got.cache_sizes_bytes == cache_roofs.cache_sizes()
    assert json.loads(path.read_text())["cache_bytes_per_s"] == got.cache_bytes_per_s
    attrs = got.trace_attributes()
    assert attrs["peak_cache_bytes_per_s"] == got.cache_bytes_per_s
    assert attrs["cache_sizes_bytes"] == got.cache_sizes_bytes
    assert attrs["peak_cache_source"] == cache_roofs.SOURCE
    assert attrs["peak_dram_bytes_per_s"] == 20e9  # unchanged


def test_a_new_measurement_keeps_each_levels_best() -> None:
    a = peak.Peak(90e9, 20e9, machine=peak.machine_key()).with_cache(
        cache_roofs.CacheRoofs({"L1": 32768}, {"L1": 80e9, "DRAM": 20e9})
    )
    b = peak.Peak(95e9, 19e9, machine=peak.machine_key()).with_cache(
        cache_roofs.CacheRoofs({"L1": 32768}, {"L1": 60e9, "DRAM": 25e9})
    )
    best = peak.best_of(a, b)
    assert best.flops_per_s == 95e9 and best.dram_bytes_per_s == 20e9
    assert best.cache_bytes_per_s == {"L1": 80e9, "DRAM": 25e9}
