"""A standalone leveled (model -> layer -> kernel) profile of one model file.

`run_profile(options)` is `xsp-sidecar profile`: pick the runner for the file, measure the
peak, run the leveled experiment for each batch size, measure again the batch sizes an
uncertain optimal-batch decision names (`profiling.sweep.settle`), store the traces and print
the summary (text or JSON). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.backends.model_repository import find_model
from sidecar.profiling.experiment import LeveledProfile, run_experiment
from sidecar.profiling.formats import ModelFormat, format_of, savedmodel_dir, savedmodel_name
from sidecar.profiling.gpu.gpu_peak import GpuPeak, get_gpu_peak, roof_attributes
from sidecar.profiling.inputs import (
    InputError,
    InputSpec,
    config_input_specs,
    load_npz,
    onnx_input_specs,
    parse_input_spec,
    random_inputs,
    savedmodel_input_specs,
)
from sidecar.profiling.levels import parse_levels
from sidecar.profiling.peak import Peak, remeasure_if_beaten
from sidecar.profiling.runners.select import runner_for
from sidecar.profiling.server_config import (
    ReplaySettings,
    batching_records,
    config_beside,
    read_config,
    replay_settings,
    server_summary,
    sweep_sizes,
)
from sidecar.profiling.summary import as_dict, render, render_sweep
from sidecar.profiling.sweep import Settled, batch_of, settle
from sidecar.profiling.vocabulary import ProfilingError
from sidecar.trace import schema
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
    max_rounds: int = 2  # repeats of the batch sizes an uncertain sweep decision names
    ncu_metrics: bool = False  # Nsight Compute's metrics level after K (PyTorch on CUDA)


def model_name(path: Path, given: str | None) -> str:
    """The name a profile is stored under: given, else Triton's folder name (or a
    TF-Serving model folder's), else the stem."""
    if given:
        return given
    if format_of(path) is ModelFormat.SAVEDMODEL and savedmodel_dir(path) is not None:
        return savedmodel_name(path)
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
    elif format_of(path) is ModelFormat.SAVEDMODEL and savedmodel_dir(path) is not None:
        try:
            specs = savedmodel_input_specs(savedmodel_dir(path) or path, batch or 1)
        except InputError as exc:
            raise InputError(f"{exc}; give its shape with --input NAME:SHAPE:DTYPE") from None
    elif format_of(path) is ModelFormat.PYTHON and (beside := config_beside(path)) is not None:
        specs = config_input_specs(read_config(beside), batch or 1)  # model.py declares none
    else:
        raise InputError(
            f"{path.name} does not declare its inputs; pass --input NAME:SHAPE:DTYPE "
            "(e.g. --input INPUT__0:1x3x224x224:float32) or --inputs FILE.npz"
        )
    return random_inputs(specs)


@dataclass(frozen=True)
class ServerSide:
    """What the model's `config.pbtxt` (beside its version folder) makes of the profile."""

    settings: ReplaySettings
    attributes: dict[str, Any]  # `replay_settings` and `server_config`, for every trace
    sweep: list[int]  # the default batch sweep, empty when the config does not batch


def server_side(options: ProfileOptions) -> ServerSide | None:
    """The model's server configuration, None when no `config.pbtxt` sits beside it; a
    config that does not parse is a `ServerConfigError` (exit code 2)."""
    path = options.model_path
    config_path = config_beside(path)
    fmt = format_of(path)
    if config_path is None or fmt is None:
        return None
    config = read_config(config_path)
    available: list[str] = []
    if fmt is ModelFormat.ONNX:
        import onnxruntime as ort

        available = ort.get_available_providers()
    settings = replay_settings(
        config,
        fmt,
        device=options.device,
        device_reason=f"--device {options.device}",
        available_providers=available,
        optimizations=options.optimizations,
    )
    sweep: list[int] = []
    records = settings.record_dicts()
    if sweep_sizes(config):  # the server batches this model
        how = "the default batch sweep (--batch-size not given)"
        if options.batch_sizes is not None:
            how = "--batch-size given"
        elif options.inputs_file:
            how = "--inputs given (its arrays' own batch)"
        else:
            sweep = sweep_sizes(config)
        records += [asdict(r) for r in batching_records(config, how, bool(sweep))]
    attributes = {schema.REPLAY_SETTINGS: records, schema.SERVER_CONFIG: server_summary(config)}
    return ServerSide(settings, attributes, sweep)


def _run(options: ProfileOptions) -> int:
    path = options.model_path
    levels = parse_levels(options.levels)
    batches = _batches(options.batch_sizes)
    if options.max_rounds < 0:
        raise InputError(f"bad --max-rounds {options.max_rounds}: must be 0 or more")
    device = options.device
    server = server_side(options)
    if server is not None and server.sweep:
        batches = list(server.sweep)
        print(
            f"batch sizes from config.pbtxt: {', '.join(map(str, batches))} (1, "
            "dynamic_batching's preferred_batch_size and max_batch_size)",
            file=sys.stderr,
        )
    runner = runner_for(
        path,
        device=device,
        optimizations=options.optimizations,
        ncu_metrics=options.ncu_metrics,
        settings=server.settings if server is not None else None,
        find=find_model,  # a model.py's BLS callees, an ensemble's steps: Triton's layout
    )
    peak = None
    gpu_peak: GpuPeak | None = None
    if options.measure_peak and device.startswith("cuda"):
        gpu_peak = get_gpu_peak(device, refresh=options.refresh_peak)
        peak = gpu_peak.peak
    elif options.measure_peak:
        from sidecar.profiling.peak import get_peak

        peak = get_peak(refresh=options.refresh_peak)
    store = _open_store(options.db)
    results: list[LeveledProfile] = []
    inputs_by_batch: dict[int, dict[str, np.ndarray]] = {}
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
                result.trace.attributes[schema.MODEL_PATH] = str(path)
                if server is not None:
                    result.trace.attributes.update(server.attributes)
                if gpu_peak is not None:
                    result.trace.attributes.update(roof_attributes(gpu_peak, result.spans))
                elif peak is not None:
                    peak = _check_peak(peak, result)
                if store is not None:
                    store.write_trace(result.trace, result.spans, result.level_stats)
                results.append(result)
                if batch is not None:
                    inputs_by_batch[batch] = inputs
        settled = settle(
            results,
            runner,
            inputs_by_batch.__getitem__,
            iterations=options.iterations,
            warmup=options.warmup,
            max_rounds=options.max_rounds,
            on_round=lambda r: print(r.describe(options.max_rounds), file=sys.stderr),
        )
        if store is not None and settled is not None:  # the pooled samples, for the report
            for r in results:
                if batch_of(r) in settled.remeasured:
                    store.write_trace(r.trace, r.spans_at(Level.MODEL), r.level_stats)
    finally:
        if store is not None:
            store.close()
    _report(options, results, settled)
    return 0


def _check_peak(peak: Peak, result: LeveledProfile) -> Peak:
    """Record the CPU peak with the trace; measure it again first if a layer beat it."""
    achieved = max(
        (
            float(s.attributes[schema.FLOPS]) / ((s.duration_ns or 1) / 1e9)
            for s in result.spans_at(Level.LAYER)
            if isinstance(s.attributes.get(schema.FLOPS), int | float) and (s.duration_ns or 0) > 0
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


def suggested_command(options: ProfileOptions, add: Sequence[int]) -> str:
    """The same `xsp-sidecar profile` command line with the batch sizes in `add` swept too."""
    sizes = sorted({b for b in _batches(options.batch_sizes) if b is not None} | set(add))
    args = ["xsp-sidecar", "profile", str(options.model_path)]
    args += ["--batch-size", ",".join(map(str, sizes))]
    args += ["--levels", options.levels, "--iterations", str(options.iterations)]
    args += ["--warmup", str(options.warmup), "--max-rounds", str(options.max_rounds)]
    for spec in options.input_specs:
        args += ["--input", spec]
    for flag, value in (
        ("--db", options.db),
        ("--device", None if options.device == "cpu" else options.device),
        ("--model-name", options.model_name),
    ):
        if value:
            args += [flag, value]
    for flag, on in (
        ("--no-optimizations", not options.optimizations),
        ("--no-peak", not options.measure_peak),
        ("--ncu-metrics", options.ncu_metrics),
        ("--json", options.json),
    ):
        if on:
            args.append(flag)
    return shlex.join(args)


def _report(
    options: ProfileOptions, results: list[LeveledProfile], settled: Settled | None
) -> None:
    sweep = [(batch_of(r), r.stats(Level.MODEL).trimmed_mean_ns / 1e6) for r in results]
    decision = settled.decision if settled is not None else None
    command = (
        suggested_command(options, decision.measure_next)
        if decision is not None and decision.status == "not_yet_known"
        else None
    )
    if options.json:
        doc: dict[str, Any] = {"profiles": [as_dict(r) for r in results]}
        if settled is not None:
            doc["optimal_batch"] = (
                settled.decision.optimal if settled.decision.status == "decided" else None
            )
            doc["batch_decision"] = settled.decision.to_dict()
            doc["batch_rounds"] = settled.to_dict()
            if command is not None:
                doc["suggested_command"] = command
        if options.db:
            doc["db"] = options.db
        print(json.dumps(doc, indent=2))
        return
    for r in results:
        print(render(r))
        print()
    if settled is not None:
        notes = [settled.summary()]
        if command is not None:
            notes.append(f"to decide, run: {command}")
        print(render_sweep(sweep, settled.decision, notes))
    print(
        f"stored {len(results)} trace(s) in {options.db}"
        if options.db
        else "not stored (pass --db traces.db to keep the traces)"
    )
