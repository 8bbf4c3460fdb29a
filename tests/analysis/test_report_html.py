"""The HTML report: embedded plots are real PNGs, and the page renders in headless Chromium."""

from __future__ import annotations

import base64
import html as html_lib
import io
import json
import re
import shutil
import subprocess
import sys
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from analysis.analyses.common import AnalysisResult
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB, REPO, q, trace_attr

SCRIPT = REPO / "analysis" / "report.py"
CHROMIUM = (
    shutil.which("chromium")
    or shutil.which("chromium-browser")
    or shutil.which("chromium-headless-shell")
)


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


NO_CHROMIUM = "chromium is not installed (apt-get install chromium-headless-shell)"


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
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


# The page measures itself: every element that sticks out of the viewport (a table may
# scroll inside its own `.tw` box, so what is inside one is left out), and every element
# whose content is wider than its box (scrolls or is clipped), with its section.
OVERFLOW_PROBE = """<script>
window.addEventListener('load', () => {
  const w = window.innerWidth;
  const outside = [], wider = [];
  const where = (el) => el.tagName + ':' + ((el.closest('section') || {}).id || 'top');
  for (const el of document.querySelectorAll('body *')) {
    const boxed = el.parentElement.closest('.tw') !== null;
    if (!boxed && el.getBoundingClientRect().right > w + 1) outside.push(where(el));
    if (!boxed && el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1) {
      wider.push({at: where(el), box: el.className, scroll: el.scrollWidth,
                  client: el.clientWidth});
    }
  }
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify({scrollWidth: document.documentElement.scrollWidth,
                                    innerWidth: w, outside: outside, wider: wider});
  document.body.appendChild(pre);
});
</script>"""


def _probe(page: Path, tmp_path: Path, width: int) -> dict[str, Any]:
    probed = tmp_path / "probe.html"
    probed.write_text(page.read_text().replace("</body>", OVERFLOW_PROBE + "</body>"))
    cmd = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},900",
        "--virtual-time-budget=5000", "--dump-dom", probed.as_uri(),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    found = re.search(r"<pre id=\"probe\">(.*?)</pre>", res.stdout, re.S)
    assert found, res.stderr[-2000:]
    probe: dict[str, Any] = json.loads(html_lib.unescape(found.group(1)))
    assert probe["innerWidth"] == width
    return probe


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
@pytest.mark.parametrize("width", [1400, 1024])
def test_page_does_not_overflow(report: Path, tmp_path: Path, width: int) -> None:
    probe = _probe(report, tmp_path, width)
    assert probe["scrollWidth"] <= width, probe  # no horizontal scroll of the page
    assert probe["outside"] == [], probe  # nothing runs off it
    # only a table's own box may be narrower than what it holds (it scrolls)
    assert {w["box"] for w in probe["wider"]} <= {"tw"}, probe["wider"]
    if width == 1400:  # the widest summary table fits a 1400 px page whole
        assert not [w for w in probe["wider"] if w["at"] in ("DIV:A15", "DIV:A1")], probe


def test_not_captured_reason_is_said_once(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(CPU_DB), "--format", "html", "--no-plots"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (reason,) = trace_attr(CPU_DB, "kernel_level")
    assert res.stdout.count(escape(reason)) == 1  # A8 says it; A9-A13 and the rest refer
    assert res.stdout.count("same reason as <a href='#A8'>A8</a>") == 6
    # ...and A8 lists them, each a link
    others = ["A9", "A10", "A11", "A12", "A13", "time_breakdown"]
    links = ", ".join(f"<a href='#{k}'>{k.replace('_', ' ')}</a>" for k in others)
    assert f"{escape(reason)}&quot; (the same for {links})</p>" in res.stdout


def _figures(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Keep the matplotlib figures the HTML renderer makes instead of encoding them."""
    from analysis.render import html as render_html

    kept: list[object] = []
    monkeypatch.setattr(render_html, "_png", lambda fig: kept.append(fig) or "data:,")
    return kept


def test_a3_plots_every_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from analysis.render import html as render_html
    from analysis.trace_analysis import TraceAnalysis

    figs = _figures(monkeypatch)
    res = TraceAnalysis.from_paths([GPU_DB]).result("A3")
    render_html.plot_layer_latency(res)
    (fig,) = figs  # one chart per model
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # type: ignore[attr-defined]
    batches = sorted({int(b) for (b,) in q(GPU_DB, "SELECT batch_size FROM traces")})
    assert labels == [f"batch {b}" for b in batches] and len(batches) > 3


def _fake_a3(batches: list[int], layers: int) -> AnalysisResult:
    """An in-memory A3 result (a fake: the plot is the stage under test)."""
    rows = [
        {"model": "m", "batch_size": b, "idx": i, "name": f"/blocks.{i}/conv/Conv",
         "type": "Conv", "original_nodes": "", "latency_ms": 0.01 * b * (1 + i % 3),
         "latency_share": 1 / layers}
        for b in batches
        for i in range(layers)
    ]  # fmt: skip
    return AnalysisResult("A3", "Layer latency in execution order", pd.DataFrame(rows))


@pytest.mark.parametrize("layers", [8, 120])  # bars for a small model, lines for a large one
def test_a3_plots_all_of_many_batch_sizes(monkeypatch: pytest.MonkeyPatch, layers: int) -> None:
    from analysis.render import html as render_html

    figs = _figures(monkeypatch)
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    render_html.plot_layer_latency(_fake_a3(batches, layers))
    (fig,) = figs
    ax = fig.axes[0]  # type: ignore[attr-defined]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [f"batch {b}" for b in batches]
    drawn = len(ax.patches) if layers == 8 else sum(len(line.get_xdata()) for line in ax.lines)
    assert drawn == len(batches) * layers  # every layer at every batch size
    assert fig.get_size_inches()[1] < 20  # type: ignore[attr-defined]


def test_live_legend_does_not_cover_the_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    from analysis.render import html as render_html
    from analysis.trace_analysis import TraceAnalysis

    figs = _figures(monkeypatch)
    render_html.plot_live(TraceAnalysis.from_paths([LIVE_DB]).result("live_breakdown"))
    (fig,) = figs
    ax = fig.axes[0]  # type: ignore[attr-defined]
    fig.canvas.draw()  # type: ignore[attr-defined]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches]
    assert bars and not any(legend.overlaps(b) for b in bars)
