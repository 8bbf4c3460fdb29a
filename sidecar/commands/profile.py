"""`xsp-sidecar profile MODEL_PATH`: a standalone leveled (model -> layer -> kernel) profile."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

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
from sidecar.profiling.runners.base import ProfilingError, Runner
from sidecar.profiling.stats import optimal_batch
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
        help="batch sizes to sweep; one trace per batch size",
    )
    parser.add_argument("--levels", default="M,L,K", help="levels to capture (default: M,L,K)")
    parser.add_argument("--iterations", type=int, default=20, help="timed runs per level")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per level first")
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
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
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


def make_runner(path: Path, optimizations: bool) -> Runner:
    """The runner for a model file, chosen by its extension."""
    if not path.exists():
        raise ProfilingError(f"model file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in ONNX_SUFFIXES:
        from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner

        return OnnxRuntimeRunner(path, optimizations=optimizations)
    if suffix in TORCHSCRIPT_SUFFIXES:
        from sidecar.profiling.runners.pytorch import PyTorchRunner

        if not optimizations:
            log.info("--no-optimizations has no effect on TorchScript models")
        return PyTorchRunner(path)
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
    runner = make_runner(path, optimizations=not args.no_optimizations)
    peak = None
    if not args.no_peak:
        from sidecar.profiling.peak import get_peak

        peak = get_peak()
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
                if store is not None:
                    store.write_trace(result.trace, result.spans, result.level_stats)
                results.append(result)
    finally:
        if store is not None:
            store.close()
    _report(args, results)
    return 0


def _batch_of(inputs: dict[str, np.ndarray]) -> int | None:
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else None


def _open_store(db: str | None) -> Any:
    if db is None:
        return None
    from sidecar.trace.store import TraceStore

    return TraceStore(db)


def _report(args: argparse.Namespace, results: list[ProfileResult]) -> None:
    sweep = [(r.trace.batch_size or 1, r.stats(Level.MODEL).trimmed_mean_ns / 1e6) for r in results]
    best = optimal_batch({b: ms for b, ms in sweep}) if len(results) > 1 else None
    if args.json:
        doc: dict[str, Any] = {"profiles": [as_dict(r) for r in results]}
        if best is not None:
            doc["optimal_batch"] = best
        if args.db:
            doc["db"] = args.db
        print(json.dumps(doc, indent=2))
        return
    for r in results:
        print(render(r))
        print()
    if best is not None:
        print(render_sweep(sweep, best))
    print(
        f"stored {len(results)} trace(s) in {args.db}"
        if args.db
        else "not stored (pass --db traces.db to keep the traces)"
    )
