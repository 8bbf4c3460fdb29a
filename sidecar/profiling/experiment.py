"""The leveled experiment (XSP): one run per level, each level timed where it is deepest.

For every requested level (M always included) the runner executes warm-up + N iterations
with profilers enabled down to that level. Model latency statistics of each run become a
`LevelStats` with its overhead ratio (run latency / M latency). The timeline is the deepest
run's representative iteration (model latency closest to its median); each span on it gets
`duration_ns` = trimmed mean (20%) of that span over the iterations of the run where its
level is deepest: model spans from M (an ensemble's step spans: each step's own trimmed mean
in M, children of the ensemble's span), layers from L, kernels from K. Parents come from
interval containment one level up (the innermost of nested module calls); GPU activity is
placed through its launch, and on a GPU the layers of the timeline are then moved from
their host interval (kept as `host_start_ns`/`host_end_ns`) to their kernels' interval.

Each level's run and each iteration is a slice the process's pacer may hold back
(`sidecar.profiling.pacing`); iterations it reports interrupted are dropped before any
statistic (trace attribute `iterations_discarded`, per level), and `experiment_wall_s` is the
wall time the experiment took, waits included.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sidecar import __version__
from sidecar.profiling import flops, pacing
from sidecar.profiling.containment import assign_parents, number_siblings
from sidecar.profiling.gpu.attribution import attach_gpu_activity, retime_layers
from sidecar.profiling.gpu.metrics_level import record_overhead
from sidecar.profiling.gpu.owner import MODEL_LEVEL_AFTER_CUPTI, PROCESS_OWNER
from sidecar.profiling.peak import Peak
from sidecar.profiling.stats import median, representative_index, trimmed_mean
from sidecar.profiling.vocabulary import (
    ENSEMBLE_STEP,
    PARTIAL_REPLAY,
    Iteration,
    LevelRun,
    ProfilingError,
    Runner,
)
from sidecar.trace import schema
from sidecar.trace.spans import (
    ERROR,
    REPLAY_LEVELS,
    Level,
    LevelStats,
    Source,
    Span,
    Trace,
    new_span_id,
    new_trace_id,
)

Progress = Callable[[Level], None]
STEP = ENSEMBLE_STEP  # a model span that is an ensemble's step (`runners.ensemble`)


@dataclass
class LeveledProfile:
    """A finished leveled profile: what the store writes."""

    trace: Trace
    spans: list[Span]
    level_stats: list[LevelStats]
    runs: dict[Level, LevelRun] = field(default_factory=dict, repr=False)

    def stats(self, level: Level) -> LevelStats:
        for s in self.level_stats:
            if s.level is level:
                return s
        raise KeyError(f"level {level.value} was not captured")

    def spans_at(self, level: Level) -> list[Span]:
        return [s for s in self.spans if s.level is level]

    def pool_model_run(self, run: LevelRun) -> None:
        """Add a further M run's timed iterations to the model-level statistics (a repeat of
        a noisy batch size): the M `LevelStats` holds the pooled samples, the model spans
        and every level's overhead ratio follow its trimmed mean, and the trace attribute
        `model_runs` counts the M runs pooled."""
        if run.level is not Level.MODEL:
            raise ValueError(f"only M runs can be pooled, not {run.level.value}")
        old = self.stats(Level.MODEL)
        pooled = LevelRun(Level.MODEL, [Iteration(v) for v in old.samples_ns], old.warmup)
        pooled.iterations += run.iterations
        base = trimmed_mean(pooled.latencies_ns)
        self.level_stats = [
            _level_stats(self.trace.trace_id, pooled, base)
            if s.level is Level.MODEL
            else replace(s, overhead_ratio=trimmed_mean(s.samples_ns or [s.trimmed_mean_ns]) / base)
            for s in self.level_stats
        ]
        for span in self.spans_at(Level.MODEL):
            if STEP not in span.attributes:
                span.duration_ns = round(base)
        self.trace.attributes[schema.MODEL_RUNS] = (
            int(self.trace.attributes.get(schema.MODEL_RUNS, 1)) + 1
        )


def describe_inputs(inputs: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """`inputs` trace attribute: name, shape, dtype and a digest (never the data)."""
    return [
        {
            "name": name,
            "shape": list(arr.shape),
            "dtype": str(arr.dtype),
            "digest": "sha256:"
            + hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:32],
        }
        for name, arr in inputs.items()
    ]


def plan_levels(runner: Runner, levels: Sequence[Level]) -> tuple[list[Level], dict[str, str]]:
    """The levels to run (M first, in depth order) and notes for levels that cannot be."""
    wanted = {Level.MODEL, *levels}
    for level in wanted:
        if level not in REPLAY_LEVELS:
            raise ProfilingError(f"level {level.value!r} is not a replay level (use M, L, K)")
    supported = set(runner.supported_levels())
    notes = dict(runner.describe().notes)
    run = [lv for lv in REPLAY_LEVELS if lv in wanted and lv in supported]
    for lv in REPLAY_LEVELS:
        if lv in wanted and lv not in supported:
            notes.setdefault(lv.value, f"not captured: {runner.name} cannot profile this level")
    return run, notes


def run_experiment(
    runner: Runner,
    inputs: Mapping[str, np.ndarray],
    *,
    model: str,
    levels: Sequence[Level] = REPLAY_LEVELS,
    iterations: int = 20,
    warmup: int = 5,
    batch_size: int | None = None,
    peak: Peak | None = None,
    progress: Progress | None = None,
    trace_id: str | None = None,
) -> LeveledProfile:
    """Run the leveled experiment and assemble the trace."""
    plan, notes = plan_levels(runner, levels)
    cupti_before = PROCESS_OWNER.owner  # a CUPTI client that already ran in this process
    info = runner.describe()
    trace_id = trace_id or new_trace_id()
    created = time.time_ns()
    runs: dict[Level, LevelRun] = {}
    discarded: dict[str, int] = {}
    kept_interrupted: dict[str, int] = {}
    wall_started = time.perf_counter()
    gate = pacing.pacer()
    for level in plan:
        pacing.take_loops()  # forget loops run outside this experiment
        gate.wait()  # a slice boundary: the level's set-up (a profiling session) comes next
        run = runner.run(inputs, level, iterations, warmup)
        runs[level], discarded[level.value], kept_interrupted[level.value] = _drop_interrupted(
            run, pacing.take_loops()
        )
        if progress is not None:
            progress(level)

    base = trimmed_mean(runs[Level.MODEL].latencies_ns)
    level_stats = [_level_stats(trace_id, run, base) for run in runs.values()]
    deepest = runs[plan[-1]]
    rep = representative_index(deepest.latencies_ns)
    spans = _timeline(trace_id, deepest, rep, runs)
    assign_parents(spans)
    nest_steps(spans)
    attach_gpu_activity(spans)
    retime_layers(spans)
    number_siblings(spans)

    attributes: dict[str, Any] = {}
    for run in runs.values():
        attributes.update(run.attributes)
    record_overhead(attributes, base)
    attributes.setdefault(schema.LAYER_NAMES, "original")
    attributes.setdefault(schema.GRAPH_OPTIMIZATIONS, "enabled")
    attributes[schema.INPUTS] = describe_inputs(inputs)
    attributes[schema.LEVELS] = [lv.value for lv in plan]
    attributes[schema.KERNEL_LEVEL] = (  # a K run may say it found nothing to capture
        runs[Level.KERNEL].attributes.get(schema.KERNEL_LEVEL, "captured")
        if Level.KERNEL in runs
        else notes.get(Level.KERNEL.value, "not requested")
    )
    attributes[schema.REPRESENTATIVE_ITERATION] = rep
    attributes[schema.TIMELINE_RUN] = deepest.level.value
    attributes[schema.TRIM_PROPORTION] = 0.2
    attributes[schema.ITERATIONS_DISCARDED] = discarded
    if any(kept_interrupted.values()):
        attributes[schema.INTERRUPTED_ITERATIONS_KEPT] = kept_interrupted
    attributes[schema.EXPERIMENT_WALL_S] = round(time.perf_counter() - wall_started, 6)
    if cupti_before is not None:  # CUPTI left attached slows later forwards (gpu.owner)
        attributes[MODEL_LEVEL_AFTER_CUPTI] = cupti_before
    if peak is not None:  # the roofs, and when and under what load they were measured
        attributes.update(peak.trace_attributes())
    trace = Trace(
        trace_id=trace_id,
        model=model,
        created_ns=created,
        batch_size=batch_size,
        runtime=info.label,
        device=info.device,
        sample_reason="cli",
        sidecar_version=__version__,
        attributes=attributes,
    )
    if PARTIAL_REPLAY in attributes:  # a profile of part of the model: kept, as a failure
        trace.status, trace.error = ERROR, str(attributes[PARTIAL_REPLAY])
    return LeveledProfile(trace, spans, level_stats, runs)


def _drop_interrupted(run: LevelRun, loops: list[pacing.LoopRecord]) -> tuple[LevelRun, int, int]:
    """The run without the iterations its timed loop discarded (an interrupted iteration's
    timing is dropped, not trimmed), how many were dropped, and how many interrupted ones
    stay because no clean run came or the runner's iterations do not match its loop."""
    if len(loops) != 1:
        return run, 0, sum(len(loop.discarded) + loop.kept_interrupted for loop in loops)
    (loop,) = loops
    if not loop.discarded or loop.runs != len(run.iterations):
        return run, 0, len(loop.discarded) + loop.kept_interrupted
    drop = set(loop.discarded)
    kept = [it for i, it in enumerate(run.iterations) if i not in drop]
    return replace(run, iterations=kept), len(drop), loop.kept_interrupted


def _level_stats(trace_id: str, run: LevelRun, base_ns: float) -> LevelStats:
    lat = run.latencies_ns
    tm = trimmed_mean(lat)
    return LevelStats(
        trace_id=trace_id,
        level=run.level,
        iterations=len(lat),
        warmup=run.warmup,
        trimmed_mean_ns=round(tm),
        median_ns=round(median(lat)),
        min_ns=min(lat),
        max_ns=max(lat),
        overhead_ratio=tm / base_ns if base_ns else float("nan"),
        samples_ns=list(lat),
    )


def _durations(run: LevelRun | None, level: Level) -> dict[str, int]:
    """Trimmed-mean duration of each span key of `level` over the run's iterations."""
    if run is None:
        return {}
    samples: dict[str, list[int]] = {}
    for it in run.iterations:
        for raw in it.spans:
            if raw.level is level:
                samples.setdefault(raw.key, []).append(raw.duration_ns)
    return {k: round(trimmed_mean(v)) for k, v in samples.items()}


def nest_steps(spans: Sequence[Span]) -> None:
    """An ensemble's step model spans (attribute `ensemble_step`) are children of the
    ensemble's own model span (the model span that is no step)."""
    models = [s for s in spans if s.level is Level.MODEL]
    top = next((s for s in models if STEP not in s.attributes), None)
    if top is None:
        return
    for span in models:
        if STEP in span.attributes:
            span.parent_id = top.span_id


def _timeline(
    trace_id: str, deepest: LevelRun, rep: int, runs: Mapping[Level, LevelRun]
) -> list[Span]:
    model_ns = round(trimmed_mean(runs[Level.MODEL].latencies_ns))
    stats = {lv: _durations(runs.get(lv), lv) for lv in REPLAY_LEVELS}
    spans: list[Span] = []
    for raw in deepest.iterations[rep].spans:
        attrs = dict(raw.attributes)
        if raw.level is Level.MODEL and STEP not in attrs:
            duration = model_ns
        else:  # an ensemble's step: its own trimmed mean over the M run, as a layer's
            found = stats[raw.level].get(raw.key)
            duration = found if found is not None else raw.duration_ns
            if found is None:
                attrs[schema.DURATION_SOURCE] = "timeline"
        if raw.level is Level.LAYER:
            op = attrs.get(
                schema.RUNTIME_OP_TYPE, attrs.get(schema.OP_TYPE, raw.kind)
            )  # not Conv+Relu
            flops.annotate(attrs, str(op), flops.dtype_size(attrs.get(schema.DTYPE)))
        spans.append(
            Span(
                trace_id=trace_id,
                span_id=new_span_id(),
                parent_id=None,
                level=raw.level,
                name=raw.name,
                kind=raw.kind,
                start_ns=raw.start_ns,
                end_ns=raw.end_ns,
                source=Source.REPLAY,
                duration_ns=duration,
                run_level=deepest.level,
                attributes=attrs,
            )
        )
    return spans
