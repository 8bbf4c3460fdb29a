"""An ensemble's requests read as its steps, end to end: the real Triton (in OpenTelemetry
trace mode, pointed at the sidecar's OTLP receiver) serves the sample ensemble `ens_cnn`
(`pre`, a Python preprocessing step, then `simple_cnn`); forced profiles through the real
`xsp-sidecar serve` are stored as profiles (status ok) holding Triton's model span per step
and the replay of the ensemble as its graph (ensemble -> step -> that step's levels), and
`analysis/report.py` shows each step's queue and compute phases, the time between steps, the
step that dominates and each step's replay against its live compute_infer."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from analysis import report
from sidecar.trace.spans import Level, Source
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import wait_until
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.ensemble_models import ENSEMBLE, STEPS, add_ensemble
from tests.harness.triton.model_repo import build_model_repository
from tests.harness.triton.server import TritonServer
from tests.harness.triton.tracing import traced_server

pytestmark = [pytest.mark.triton, pytest.mark.slow]
FORCED = 3


@pytest.fixture(scope="module")
def ensemble_triton(
    tmp_path_factory: pytest.TempPathFactory, otlp_port: int
) -> Iterator[TritonServer]:
    """A traced `tritonserver` with the sample models and the ensemble `ens_cnn`."""
    root = tmp_path_factory.mktemp("ensemble-triton")
    repo = add_ensemble(build_model_repository(root / "models"))
    otlp_url = f"http://127.0.0.1:{otlp_port}/v1/traces"
    with traced_server(repo, root / "tritonserver.log", otlp_url, 100) as server:
        yield server


def ens_infer(client: grpcclient.InferenceServerClient, headers: dict[str, str]) -> None:
    raw = grpcclient.InferInput("RAW", [1, 3, 32, 32], "FP32")
    raw.set_data_from_numpy(np.full((1, 3, 32, 32), 255.0, np.float32))
    result = client.infer(ENSEMBLE, [raw], headers=headers)
    assert result.as_numpy("LOGITS").shape == (1, 10)


def test_forced_profiles_of_an_ensemble_are_replayed_as_its_steps_in_the_report(
    ensemble_triton: TritonServer, tmp_path: Path, otlp_port: int
) -> None:
    db = tmp_path / "traces.db"
    args = [
        "--model-repository", str(ensemble_triton.model_repository), "--db", str(db),
        "--otlp-port", str(otlp_port), "--sample-rate", "0", "--sample-budget", "10",
        "--duty-cycle", "1", "--iterations", "3", "--warmup", "1", "--levels", "M,L",
    ]  # fmt: skip
    proc = SidecarProcess(ensemble_triton.grpc_address, tmp_path / "sidecar.log", args=args)
    with proc:
        client = grpcclient.InferenceServerClient(proc.address)
        for _ in range(FORCED):
            ens_infer(client, headers={"x-xsp-profile": "1"})
        store = TraceStore(db)

        def with_steps() -> list[str]:
            out = []
            for t in store.list_traces():
                models = {s.name for s in store.spans(t.trace_id)
                          if s.source is Source.BACKEND and s.kind == "model"}  # fmt: skip
                if t.status == "ok" and {ENSEMBLE, *STEPS} <= models:
                    out.append(t.trace_id)
            return out

        done = lambda: proc.metric("xsp_profiles_total", model=ENSEMBLE) >= FORCED  # noqa: E731
        assert wait_until(done, 180), proc.log_tail()
        assert len(store.list_traces()) == FORCED, proc.log_tail()
        # Triton 2.51 now and then exports no trace at all (see tests/live/)
        assert wait_until(lambda: len(with_steps()) >= 2, 120), proc.log_tail()
        assert proc.metric("xsp_profiles_total", model=ENSEMBLE, outcome="error") == 0
        assert proc.metric("xsp_profiles_total", model=ENSEMBLE, outcome="ok") == FORCED
        for trace in store.list_traces():
            assert trace.status == "ok", trace.error
            assert trace.attributes["model_format"] == "ensemble"
            _assert_replayed_as_steps(store, trace.trace_id)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert report.main([str(db), "--format", "json"]) == 0, err.getvalue()
    doc = json.loads(out.getvalue())
    rows = {(r["model"], r["step"], r["phase"]): r for r in doc["live_breakdown"]["rows"]}
    traced = len(with_steps())
    for n, step in enumerate(STEPS, start=1):
        for phase in ("queue", "compute_infer"):
            row = rows[(ENSEMBLE, f"{n}. {step}", phase)]
            assert row["requests"] == traced and row["mean_ms"] >= 0, row
    assert rows[(ENSEMBLE, "2. simple_cnn", "compute_infer")]["mean_ms"] > 0
    assert rows[(ENSEMBLE, "", "between_steps")]["requests"] == traced
    assert rows[(ENSEMBLE, "", "client_total")]["requests"] == FORCED
    (dominant,) = [f for f in doc["findings"] if f["rule"] == "dominant_step"]
    assert dominant["subject"] == ENSEMBLE
    steps = {r["step"]: 0.0 for r in doc["live_breakdown"]["rows"] if r["step"]}
    for r in doc["live_breakdown"]["rows"]:
        if r["step"]:  # a step's time: its phases' medians summed
            steps[r["step"]] += r["p50_ms"]
    top = max(steps, key=lambda s: steps[s]).split(". ", 1)[1]
    assert dominant["finding"].startswith(f"{ENSEMBLE}: step {top} takes ")
    assert not [k for k, v in doc.items() if isinstance(v, dict) and v.get("status") == "error"]
    for key in ("A2", "A3"):  # the replay's layers, each under its step
        assert [r["step"] for r in doc[key]["rows"]] == sorted(
            (r["step"] for r in doc[key]["rows"]), key=STEPS.index
        )
        assert {r["step"] for r in doc[key]["rows"]} == set(STEPS)
    notes = "\n".join(doc["fidelity"]["notes"])
    for step in STEPS:  # each step's replay against that step's live compute_infer
        assert f"ensemble step {ENSEMBLE}/{step}: replay p50 " in notes, notes
        assert "vs its live compute_infer p50" in notes


def _assert_replayed_as_steps(store: TraceStore, trace_id: str) -> None:
    """ensemble -> step -> that step's levels, the ensemble's latency its own M statistic."""
    models = store.spans(trace_id, Level.MODEL)
    (top,) = [s for s in models if s.name == ENSEMBLE]
    steps = {s.name: s for s in models if s.parent_id == top.span_id}
    assert set(steps) == set(STEPS)
    assert {s.attributes["ensemble_step"] for s in steps.values()} == {
        f"{ENSEMBLE}/{step}" for step in STEPS
    }
    layers = store.spans(trace_id, Level.LAYER)
    assert {s.parent_id for s in layers} == {s.span_id for s in steps.values()}
    stats = {s.level: s for s in store.level_stats(trace_id)}
    assert set(stats) == {Level.MODEL, Level.LAYER}
    assert top.duration_ns == stats[Level.MODEL].trimmed_mean_ns
