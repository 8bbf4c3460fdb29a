"""The short version of `bench/soak.py`: every attack of the soak, for one timed round.

A real `tritonserver` and a real `xsp-sidecar serve` (sampling, trace DB, OTLP receiver,
admin API); the script exits 0 only when file descriptors, threads, RSS and /metrics series
are back within 10 % of their start, no well-formed request failed, and a forced profile
made after the attacks was stored.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_soak_leaves_the_sidecar_as_it_found_it() -> None:
    result = subprocess.run(
        [sys.executable, str(SOAK), "--duration", "20", "--settle", "15"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "[ok] fds within 10%" in result.stdout
