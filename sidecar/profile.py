"""A standalone leveled (model -> layer -> kernel) profile of one model file.

`run_profile(options)` is `xsp-sidecar profile`: pick the runner for the file, measure the
peak, run the leveled experiment for each batch size, store the traces and print the summary
(text or JSON). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.experiment import LeveledProfile, run_experiment
from sidecar.profiling.inputs import (
    InputError,
    InputSpec,
    load_npz,
    onnx_input_specs,
    parse_input_spec,
    random_inputs,
)
from sidecar.profiling.levels import parse_levels
from sidecar.profiling.peak import Peak, remeasure_if_beaten
from sidecar.profiling.runners.base import ProfilingError
from sidecar.profiling.runners.select import ModelFormat, format_of, runner_for
from sidecar.profiling.stats import BatchDecision, decide_batch, trimmed_mean_rse
from sidecar.profiling.summary import as_dict, render, render_sweep
from sidecar.trace.spans import Level

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileOptions:
    """What to profile and how; the command's flags, as given (parsed by `run_profile`)."""

    model_path: Path
    levels: str
    iterations: int
    warmup: int
    input_specs: tuple[str, ...] = ()  # NAME:SHAPE:DTYPE
    inputs_file: str | None = None  # .npz
    batch_sizes: str | None = None  # "1,2,4,8"; None: the inputs' own batch
    db: str | None = None
    optimizations: bool = True
    measure_peak: bool = True
    refresh_peak: bool = False
    json: bool = False
    device: str = "cpu"
    model_name: str | None = None


def model_name(path: Path, given: str | None) -> str:
    """The name a profile is stored under: given, else Triton's folder name, else the stem."""
    if given:
        return given
    folder = path.resolve().parent
    if folder.name.isdigit() and (folder.parent / "config.pbtxt").is_file():
        return folder.parent.name
    return path.stem


def run_profile(options: ProfileOptions) -> int:
    """Profile, store and print; returns the process exit code."""
    try:
        return _run(options)
    except (ProfilingError, InputError, ValueError) as exc:
        print(f"xsp-sidecar profile: error: {exc}", file=sys.stderr)
        return 2


def _batches(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    try:
        sizes = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise InputError(f"bad --batch-size {text!r}: expected e.g. 1,2,4,8") from None
    if not sizes or sizes[0] < 1:
        raise InputError(f"bad --batch-size {text!r}: sizes must be positive integers")
    return list(sizes)


def _inputs(options: ProfileOptions, batch: int | None) -> dict[str, np.ndarray]:
    path = options.model_path
    if options.inputs_file and options.input_specs:
        raise InputError("give either --input or --inputs, not both")
    if options.inputs_file:
        arrays = load_npz(options.inputs_file)
        if batch is not None:
            for name, arr in arrays.items():
                if arr.ndim == 0 or arr.shape[0] != batch:
                    raise InputError(
                        f"--inputs array {name!r} has shape {arr.shape}, not batch {batch}; a "
                        "batch sweep needs --input specs (or the model's own input shapes)"
                    )
        return arrays
    specs: list[InputSpec]
    if options.input_specs:
        specs = [parse_input_spec(t) for t in options.input_specs]
        if batch is not None:
            specs = [s.with_batch(batch) for s in specs]
    elif format_of(path) is ModelFormat.ONNX:
        specs = onnx_input_specs(path, batch or 1)
    else:
        raise InputError(
            f"{path.name} does not declare its inputs; pass --input NAME:SHAPE:DTYPE "
            "(e.g. --input INPUT__0:1x3x224x224:float32) or --inputs FILE.npz"
        )
    return random_inputs(specs)


def _run(options: ProfileOptions) -> int:
    path = options.model_path
    levels = parse_levels(options.levels)
    batches = _batches(options.batch_sizes)
    device = options.device
    runner = runner_for(path, device=device, optimizations=options.optimizations)
    peak = None
    gpu_peak_attrs: dict[str, Any] = {}
    if options.measure_peak and device.startswith("cuda"):
        from sidecar.profiling.gpu.gpu_peak import get_gpu_peak

        gpu_peak = get_gpu_peak(device)
        peak, gpu_peak_attrs = gpu_peak.peak, gpu_peak.trace_attributes()
    elif options.measure_peak:
        from sidecar.profiling.peak import get_peak

        peak = get_peak(refresh=options.refresh_peak)
    store = _open_store(options.db)
    results: list[LeveledProfile] = []
    try:
        from tqdm import tqdm

        steps = len(batches) * len({Level.MODEL, *levels})
        with tqdm(
            total=steps, desc=f"profiling {path.name}", unit="run", file=sys.stderr, disable=None
        ) as bar:
            for batch in batches:
                inputs = _inputs(options, batch)
                bar.set_postfix(batch=batch or "-")
                result = run_experiment(
                    runner,
                    inputs,
                    model=model_name(path, options.model_name),
                    levels=levels,
                    iterations=options.iterations,
                    warmup=options.warmup,
                    batch_size=batch or _batch_of(inputs),
                    peak=peak,
                    progress=lambda _level: bar.update(1),
                )
                result.trace.attributes["model_path"] = str(path)
                result.trace.attributes.update(gpu_peak_attrs)
                if peak is not None and not gpu_peak_attrs:
                    peak = _check_peak(peak, result)
                if store is not None:
                    store.write_trace(result.trace, result.spans, result.level_stats)
                results.append(result)
    finally:
        if store is not None:
            store.close()
    _report(options, results)
    return 0


def _check_peak(peak: Peak, result: LeveledProfile) -> Peak:
    """Record the CPU peak with the trace; measure it again first if a layer beat it."""
    achieved = max(
        (
            float(s.attributes["flops"]) / ((s.duration_ns or 1) / 1e9)
            for s in result.spans_at(Level.LAYER)
            if isinstance(s.attributes.get("flops"), int | float) and (s.duration_ns or 0) > 0
        ),
        default=0.0,
    )
    if achieved > peak.flops_per_s:
        log.info(
            "a layer ran at %.4g GFLOP/s, above the cached peak of %.4g: measuring it again",
            achieved / 1e9,
            peak.flops_per_s / 1e9,
        )
        peak = remeasure_if_beaten(peak, achieved)
    result.trace.attributes.update(peak.trace_attributes())
    return peak


def _batch_of(inputs: dict[str, np.ndarray]) -> int | None:
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else None


def _open_store(db: str | None) -> Any:
    if db is None:
        return None
    from sidecar.trace.store import TraceStore

    return TraceStore(db)


def sweep_decision(results: list[LeveledProfile]) -> BatchDecision | None:
    """XSP A1's optimal batch over a batch sweep (the rule the report uses too)."""
    if len(results) < 2:
        return None
    stats = {r.trace.batch_size or 1: r.stats(Level.MODEL) for r in results}
    return decide_batch(
        {b: s.trimmed_mean_ns for b, s in stats.items()},
        {b: trimmed_mean_rse(s.samples_ns) for b, s in stats.items()},
    )


def _report(options: ProfileOptions, results: list[LeveledProfile]) -> None:
    sweep = [(r.trace.batch_size or 1, r.stats(Level.MODEL).trimmed_mean_ns / 1e6) for r in results]
    decision = sweep_decision(results)
    if options.json:
        doc: dict[str, Any] = {"profiles": [as_dict(r) for r in results]}
        if decision is not None:
            doc["optimal_batch"] = decision.optimal if decision.status == "decided" else None
            doc["batch_decision"] = decision.to_dict()
        if options.db:
            doc["db"] = options.db
        print(json.dumps(doc, indent=2))
        return
    for r in results:
        print(render(r))
        print()
    if decision is not None:
        print(render_sweep(sweep, decision))
    print(
        f"stored {len(results)} trace(s) in {options.db}"
        if options.db
        else "not stored (pass --db traces.db to keep the traces)"
    )
