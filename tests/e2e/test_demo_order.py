"""Both demos in one output folder, one after the other, in either order (issue 26): each
backend builds a model folder of its own from scratch (`triton-models/`, `tfserving-models/`),
so Triton never meets the TF-Serving demo's SavedModels. Small runs: few requests, one forced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.tfserving]


def run_demo(backend: str, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "tests.harness.demo", "--backend", backend, "--out", str(out),
        "--requests", "5", "--forced", "1", "--rest-requests", "5",
    ]  # fmt: skip
    return subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        timeout=300,
    )  # fmt: skip


def test_both_demos_run_in_one_folder_in_either_order(tmp_path: Path) -> None:
    """TF-Serving, Triton, TF-Serving again: each order once (three runs, not four)."""
    out = tmp_path / "demo-out"
    order = ("tfserving", "triton", "tfserving")
    for at, backend in enumerate(order):
        run = run_demo(backend, out)
        assert run.returncode == 0, f"{backend} after {order[:at]}:\n{run.stdout[-4000:]}"
        assert "Traceback" not in run.stdout, run.stdout[-4000:]
        assert "==> done. Results:" in run.stdout, run.stdout[-4000:]
    assert sorted(p.name for p in (out / "triton-models").iterdir()) == [
        "add_sub", "ens_cnn", "pre", "simple_cnn", "sleep",
    ]  # fmt: skip
    assert sorted(p.name for p in (out / "tfserving-models").iterdir()) == [
        "keras_cnn", "keras_transformer",
    ]  # fmt: skip
