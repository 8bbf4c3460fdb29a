"""A2 and A3 of an ensemble, per step: a real leveled replay of the sample ensemble `ens_cnn`
(its Python step `pre`, then the ONNX `simple_cnn`) stored by the real store beside a plain
replay of `simple_cnn`, read by the real report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.analyses.common import Frames
from analysis.analyses.layer_level import layer_latency, layer_table
from analysis.load.tracedb import TraceFilter, load_traces
from sidecar.backends.model_repository import find_model
from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.runners.select import runner_for
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.analysis.test_live_only import run_report
from tests.harness.triton.ensemble_models import ENSEMBLE, STEPS, add_ensemble
from tests.harness.triton.model_repo import build_model_repository

BATCH = 2


def _replay(repo: Path, model: str, inputs: dict[str, np.ndarray], store: TraceStore) -> str:
    location = find_model(repo, model)
    runner = runner_for(location.path, location.format, find=find_model)
    profile = run_experiment(
        runner, inputs, model=model, levels=(Level.MODEL, Level.LAYER), iterations=4,
        warmup=1, batch_size=BATCH,
    )  # fmt: skip
    store.write_trace(profile.trace, profile.spans, profile.level_stats)
    return profile.trace.trace_id


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The store and the ensemble trace's id."""
    tmp = tmp_path_factory.mktemp("ensemble-layers")
    repo = add_ensemble(build_model_repository(tmp / "models"))
    raw = np.random.default_rng(0).uniform(0, 255, (BATCH, 3, 32, 32)).astype(np.float32)
    path = tmp / "traces.db"
    with TraceStore(path) as store:
        tid = _replay(repo, ENSEMBLE, {"RAW": raw}, store)
        _replay(repo, "simple_cnn", {"input": raw / 255 - 0.5}, store)
    return path, tid


def _owners(path: Path, tid: str) -> dict[str, str]:
    """Per layer name of the ensemble's trace: the step whose span is its stored parent."""
    with TraceStore(path) as store:
        spans = store.spans(tid)
    steps = {s.span_id: s.name for s in spans if s.level is Level.MODEL and s.parent_id}
    return {s.name: steps[s.parent_id or ""] for s in spans if s.level is Level.LAYER}


def test_a2_gives_each_layer_of_an_ensemble_its_step(db: tuple[Path, str]) -> None:
    path, tid = db
    res = layer_table(Frames(load_traces([path], TraceFilter())))
    table = res.table
    assert list(table.columns[:3]) == ["model", "batch_size", "step"]
    ens = table[table["model"] == ENSEMBLE]
    calls = ens["name"].astype(str).str.replace(r"#\d+$", "", regex=True)  # a repeat: `#n`
    assert dict(zip(calls, ens["step"], strict=True)) == _owners(path, tid)
    assert list(dict.fromkeys(ens["step"])) == list(STEPS)  # the steps in their order
    for _, rows in ens.groupby("step"):
        assert list(rows["idx"]) == sorted(rows["idx"])
        assert rows["latency_share"].sum() == pytest.approx(1.0)  # of the step's time
    assert "Gemm" in set(ens.loc[ens["step"] == "simple_cnn", "type"])
    plain = table[table["model"] == "simple_cnn"]
    assert set(plain["step"]) == {""} and plain["latency_share"].sum() == pytest.approx(1.0)
    assert any(n.startswith("ensembles: a row per replayed step's layer") for n in res.notes)


def test_a3_lists_an_ensembles_layers_step_by_step_in_the_report(db: tuple[Path, str]) -> None:
    path, _ = db
    a3 = layer_latency(Frames(load_traces([path], TraceFilter()))).table
    ens = a3[a3["model"] == ENSEMBLE]
    first_cnn = int(np.flatnonzero(ens["step"].to_numpy() == "simple_cnn")[0])
    assert set(ens["step"].iloc[:first_cnn]) == {"pre"}
    assert set(ens["step"].iloc[first_cnn:]) == {"simple_cnn"}
    rc, out, err = run_report(str(path), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    for key in ("A3", "A4"):  # A4: the same layers' memory, in the same order
        steps = [(r["step"], r["idx"]) for r in doc[key]["rows"] if r["model"] == ENSEMBLE]
        assert steps == list(zip(ens["step"], ens["idx"], strict=True)), key
    rc, html, err = run_report(str(path), "--format", "html")
    assert rc == 0 and "Layer latency in execution order" in html, err
