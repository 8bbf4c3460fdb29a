from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.profiling import peak


def test_peak_is_measured_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XSP_CACHE_DIR", str(tmp_path))
    first = peak.get_peak()
    assert first.flops_per_s > 1e8 and first.dram_bytes_per_s > 1e8
    cached = json.loads((tmp_path / "peak.json").read_text())
    assert cached["machine"] == peak.machine_key()
    # a second call reads the file: prove it by editing the cached value
    cached["flops_per_s"] = 123.0
    (tmp_path / "peak.json").write_text(json.dumps(cached))
    assert peak.get_peak().flops_per_s == 123.0
