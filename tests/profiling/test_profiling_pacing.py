"""Profiles in slices: the real ONNX Runtime runner under a fake pacer that interrupts
chosen timed iterations; the experiment must drop exactly those and say so in the trace."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling import pacing
from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.gpu.owner import CUPTI_TRACER, MODEL_LEVEL_AFTER_CUPTI, PROCESS_OWNER
from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner
from sidecar.profiling.runners.timing import timed_loop
from sidecar.trace.spans import Level


@dataclass
class FakePacer:
    """Interrupts the timed runs whose number (counted over all loops) is in `interrupt`."""

    interrupt: set[int] = field(default_factory=set)
    waits: int = 0
    runs: int = 0

    def wait(self) -> None:
        self.waits += 1

    def begin(self) -> int:
        self.runs += 1
        return self.runs - 1

    def interrupted(self, mark: int, wall_ns: int) -> bool:
        return mark in self.interrupt


def test_interrupted_iterations_are_run_again_and_named_for_discarding() -> None:
    calls: list[int] = []
    with pacing.installed(FakePacer({1, 3})) as fake:
        pacing.take_loops()
        walls, _ = timed_loop(lambda: calls.append(1), iterations=4, warmup=2)
        (record,) = pacing.take_loops()
    assert len(walls) == 6 and len(calls) == 8  # 2 warm-up + 4 clean + 2 interrupted
    assert record == pacing.LoopRecord(runs=6, discarded=[1, 3])
    assert isinstance(fake, FakePacer) and fake.waits == 8  # one slice boundary per run


def test_a_loop_with_no_clean_run_keeps_them_and_says_so() -> None:
    with pacing.installed(FakePacer(set(range(100)))):
        pacing.take_loops()
        walls, _ = timed_loop(lambda: None, iterations=2, warmup=0)
        (record,) = pacing.take_loops()
    assert len(walls) == 2 * pacing.MAX_ATTEMPTS_PER_ITERATION
    assert record.discarded == [] and record.kept_interrupted == len(walls)


def test_the_experiment_drops_interrupted_iterations_and_records_them(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray]
) -> None:
    runner = OnnxRuntimeRunner(cnn_onnx)
    # M's timed runs are numbered 0..6 (5 clean + 2 interrupted), L's from 7 on
    with pacing.installed(FakePacer({0, 4, 8})) as fake:
        profile = run_experiment(runner, cnn_inputs, model="cnn", iterations=5, warmup=1)
    assert isinstance(fake, FakePacer) and fake.runs == 5 + 2 + 5 + 1
    assert profile.stats(Level.MODEL).iterations == 5
    assert profile.stats(Level.LAYER).iterations == 5
    assert profile.trace.attributes["iterations_discarded"] == {"model": 2, "layer": 1}
    assert "interrupted_iterations_kept" not in profile.trace.attributes
    assert profile.trace.attributes["experiment_wall_s"] > 0
    # every kept L iteration still has its own layers (the profiler's runs stayed aligned)
    layer_counts = {len(it.spans) for it in profile.runs[Level.LAYER].iterations}
    assert len(layer_counts) == 1 and layer_counts.pop() > 1


def test_without_a_pacer_nothing_is_discarded(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray]
) -> None:
    profile = run_experiment(OnnxRuntimeRunner(cnn_onnx), cnn_inputs, model="cnn", iterations=3)
    assert profile.trace.attributes["iterations_discarded"] == {"model": 0, "layer": 0}
    assert profile.stats(Level.MODEL).iterations == 3


def test_an_experiment_after_a_cupti_client_says_so(
    cnn_onnx: Path, cnn_inputs: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUPTI left attached slows later forwards (measured on an H100), so an M timed in a
    process where a CUPTI client ran is marked. FAKE: no GPU here; the owner's claim is set
    as `CuptiTracer.start()` sets it."""
    assert (
        MODEL_LEVEL_AFTER_CUPTI
        not in run_experiment(
            OnnxRuntimeRunner(cnn_onnx), cnn_inputs, model="cnn", iterations=2
        ).trace.attributes
    )
    monkeypatch.setattr(PROCESS_OWNER, "owner", CUPTI_TRACER)
    profile = run_experiment(OnnxRuntimeRunner(cnn_onnx), cnn_inputs, model="cnn", iterations=2)
    assert profile.trace.attributes[MODEL_LEVEL_AFTER_CUPTI] == CUPTI_TRACER
