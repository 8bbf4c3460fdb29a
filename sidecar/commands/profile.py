"""`xsp-sidecar profile MODEL_PATH`: a standalone leveled (model -> layer -> kernel) profile."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from sidecar.profiling.experiment import ProfileResult, run_experiment
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
from sidecar.profiling.runners.base import ProfilingError, Runner
from sidecar.profiling.stats import BatchDecision, decide_batch, trimmed_mean_rse
from sidecar.profiling.summary import as_dict, render, render_sweep
from sidecar.trace.spans import Level

NAME = "profile"
HELP = "profile one model locally at model, layer and kernel level (XSP leveled experiment)"
ONNX_SUFFIXES = (".onnx",)
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".torchscript")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_path", metavar="MODEL_PATH", help="an ONNX model (.onnx) or a TorchScript file (.pt)"
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME:SHAPE:DTYPE",
        help="random input, e.g. input:1x3x224x224:float32 (repeatable)",
    )
    parser.add_argument("--inputs", metavar="FILE.npz", help="inputs from an .npz file")
    parser.add_argument(
        "--batch-size",
        default=None,
        metavar="1,2,4,8",
        help="batch sizes to sweep; one trace per batch size (default: the model's own input "
        "shapes, or those of --input/--inputs)",
    )
    parser.add_argument("--levels", default="M,L,K", help="levels to capture (default: M,L,K)")
    parser.add_argument(
        "--iterations", type=int, default=20, help="timed runs per level (default: 20)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed runs per level first (default: 5)"
    )
    parser.add_argument(
        "--db", default=None, metavar="traces.db", help="write traces to this SQLite trace store"
    )
    parser.add_argument(
        "--no-optimizations",
        action="store_true",
        help="ONNX Runtime: disable graph optimizations (layers = graph nodes)",
    )
    parser.add_argument(
        "--no-peak",
        action="store_true",
        help="skip measuring this machine's peak FLOP/s and bandwidth",
    )
    parser.add_argument(
        "--refresh-peak",
        action="store_true",
        help="measure the peak again instead of using the cached one (best of several "
        "rounds; never lower than the cached peak)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="cpu|cuda[:N]",
        help="PyTorch models: run on this device (default: cpu)",
    )
    parser.add_argument(
        "--model-name",
        metavar="NAME",
        help="model name in the trace (default: the Triton model folder for "
        "<repo>/<name>/<version>/model.*, else the file name)",
    )


def model_name(path: Path, given: str | None) -> str:
    """The name a profile is stored under: given, else Triton's folder name, else the stem."""
    if given:
        return given
    folder = path.resolve().parent
    if folder.name.isdigit() and (folder.parent / "config.pbtxt").is_file():
        return folder.parent.name
    return path.stem


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ProfilingError, InputError, ValueError) as exc:
        print(f"xsp-sidecar profile: error: {exc}", file=sys.stderr)
        return 2


def make_runner(path: Path, optimizations: bool, device: str = "cpu") -> Runner:
    """The runner for a model file, chosen by its extension."""
    if not path.exists():
        raise ProfilingError(f"model file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in ONNX_SUFFIXES:
        from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner

        if device != "cpu":
            raise ProfilingError(
                f"--device {device} is not supported for ONNX models yet (ONNX Runtime runs "
                "on the CPU here); --device applies to PyTorch models"
            )
        try:
            return OnnxRuntimeRunner(path, optimizations=optimizations)
        except DecodeError:
            raise ProfilingError(
                f"{path} is not an ONNX model (its bytes do not parse as an ONNX protobuf)"
            ) from None
    if suffix in TORCHSCRIPT_SUFFIXES:
        from sidecar.profiling.runners.pytorch import PyTorchRunner

        if not optimizations:
            log.info("--no-optimizations has no effect on TorchScript models")
        return PyTorchRunner(path, device=device)
    raise ProfilingError(
        f"unknown model extension {path.suffix!r} for {path}: use .onnx (ONNX Runtime) or "
        ".pt / .pth (TorchScript)"
    )


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


def _inputs(args: argparse.Namespace, path: Path, batch: int | None) -> dict[str, np.ndarray]:
    if args.inputs and args.input:
        raise InputError("give either --input or --inputs, not both")
    if args.inputs:
        arrays = load_npz(args.inputs)
        if batch is not None:
            for name, arr in arrays.items():
                if arr.ndim == 0 or arr.shape[0] != batch:
                    raise InputError(
                        f"--inputs array {name!r} has shape {arr.shape}, not batch {batch}; a "
                        "batch sweep needs --input specs (or the model's own input shapes)"
                    )
        return arrays
    specs: list[InputSpec]
    if args.input:
        specs = [parse_input_spec(t) for t in args.input]
        if batch is not None:
            specs = [s.with_batch(batch) for s in specs]
    elif path.suffix.lower() in ONNX_SUFFIXES:
        specs = onnx_input_specs(path, batch or 1)
    else:
        raise InputError(
            f"{path.name} does not declare its inputs; pass --input NAME:SHAPE:DTYPE "
            "(e.g. --input INPUT__0:1x3x224x224:float32) or --inputs FILE.npz"
        )
    return random_inputs(specs)


def _run(args: argparse.Namespace) -> int:
    path = Path(args.model_path)
    levels = parse_levels(args.levels)
    batches = _batches(args.batch_size)
    device = getattr(args, "device", "cpu")
    runner = make_runner(path, optimizations=not args.no_optimizations, device=device)
    peak = None
    gpu_peak_attrs: dict[str, Any] = {}
    if not args.no_peak and device.startswith("cuda"):
        from sidecar.profiling.gpu.gpu_peak import get_gpu_peak

        gpu_peak = get_gpu_peak(device)
        peak, gpu_peak_attrs = gpu_peak.peak, gpu_peak.trace_attributes()
    elif not args.no_peak:
        from sidecar.profiling.peak import get_peak

        peak = get_peak(refresh=getattr(args, "refresh_peak", False))
    store = _open_store(args.db)
    results: list[ProfileResult] = []
    try:
        from tqdm import tqdm

        steps = len(batches) * len({Level.MODEL, *levels})
        with tqdm(
            total=steps, desc=f"profiling {path.name}", unit="run", file=sys.stderr, disable=None
        ) as bar:
            for batch in batches:
                inputs = _inputs(args, path, batch)
                bar.set_postfix(batch=batch or "-")
                result = run_experiment(
                    runner,
                    inputs,
                    model=model_name(path, args.model_name),
                    levels=levels,
                    iterations=args.iterations,
                    warmup=args.warmup,
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
    _report(args, results)
    return 0


def _check_peak(peak: Peak, result: ProfileResult) -> Peak:
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


def sweep_decision(results: list[ProfileResult]) -> BatchDecision | None:
    """XSP A1's optimal batch over a batch sweep (the rule the report uses too)."""
    if len(results) < 2:
        return None
    stats = {r.trace.batch_size or 1: r.stats(Level.MODEL) for r in results}
    return decide_batch(
        {b: s.trimmed_mean_ns for b, s in stats.items()},
        {b: trimmed_mean_rse(s.samples_ns) for b, s in stats.items()},
    )


def _report(args: argparse.Namespace, results: list[ProfileResult]) -> None:
    sweep = [(r.trace.batch_size or 1, r.stats(Level.MODEL).trimmed_mean_ns / 1e6) for r in results]
    decision = sweep_decision(results)
    if args.json:
        doc: dict[str, Any] = {"profiles": [as_dict(r) for r in results]}
        if decision is not None:
            doc["optimal_batch"] = decision.optimal if decision.status == "decided" else None
            doc["batch_decision"] = decision.to_dict()
        if args.db:
            doc["db"] = args.db
        print(json.dumps(doc, indent=2))
        return
    for r in results:
        print(render(r))
        print()
    if decision is not None:
        print(render_sweep(sweep, decision))
    print(
        f"stored {len(results)} trace(s) in {args.db}"
        if args.db
        else "not stored (pass --db traces.db to keep the traces)"
    )
