"""The HTML report: embedded plots are real PNGs, and the page renders in headless Chromium."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import sys
from html import escape
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB, REPO, trace_attr

SCRIPT = REPO / "analysis" / "report.py"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(GPU_DB), str(LIVE_DB), str(CPU_DB),
         "--format", "html", "--out", str(out), "--base", "model=small_cnn",
         "--new", "model=tiny_resnet"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return out / "report.html"


def _colours(img: Image.Image) -> int:
    arr = np.asarray(img.convert("RGB")).reshape(-1, 3)
    return len(np.unique(arr, axis=0))


def test_plots_are_non_trivial_pngs(report: Path) -> None:
    html = report.read_text()
    uris = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,([^']+)'>", html)
    plotted = {key.split()[0] for key, _ in uris}
    # batch curve, layer latency, latency by type, rooflines, live, time breakdown, comparison
    assert {"A1", "A3", "A6", "A9", "A14", "live_breakdown", "time_breakdown",
            "comparison"} <= plotted  # fmt: skip
    for key, data in uris:
        raw = base64.b64decode(data)
        assert raw.startswith(b"\x89PNG\r\n\x1a\n"), key
        assert len(raw) > 8_000, key
        img = Image.open(io.BytesIO(raw))
        img.verify()
        img = Image.open(io.BytesIO(raw))
        assert img.width > 300 and img.height > 150
        assert _colours(img) > 30, f"{key} plot looks blank"
    # the CPU models' missing kernel level is explained...
    (reason,) = trace_attr(CPU_DB, "kernel_level")
    assert "kernel level not captured in" in html and escape(reason) in html
    assert "<span class=est>(estimated)</span>" in html  # ...and estimates labelled


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    cmd = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
        "--window-size=1200,2400", f"--screenshot={shot}", report.as_uri(),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), res.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 2400)
    arr = np.asarray(img)
    non_white = (arr.min(axis=2) < 240).mean()
    assert non_white > 0.03  # tables and plots, not an empty page
    # the first plot (A1) is in view: anti-aliased lines and markers give many colours
    assert _colours(img) > 200
