"""`xsp-sidecar profile MODEL_PATH`: a standalone leveled (model -> layer -> kernel) profile.

The flags; the work is `sidecar.profile.run_profile`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "profile"
PROVIDERS = ("cpu", "cuda")
HELP = "profile one model locally at model, layer and kernel level (XSP leveled experiment)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_path",
        metavar="MODEL_PATH",
        help="an ONNX model (.onnx), a TorchScript file (.pt) or a TensorFlow SavedModel "
        "folder (or a TF-Serving model folder <name>/ with numeric versions: the latest)",
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
        help="batch sizes to sweep; one trace per batch size (default: for a model in a Triton "
        "repository whose config.pbtxt batches, 1, dynamic_batching's preferred_batch_size and "
        "max_batch_size, deduplicated and sorted; else the model's own input shapes, or those "
        "of --input/--inputs)",
    )
    parser.add_argument("--levels", default="M,L,K", help="levels to capture (default: M,L,K)")
    parser.add_argument(
        "--iterations", type=int, default=20, help="timed runs per level (default: 20)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed runs per level first (default: 5)"
    )
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=2,
        metavar="N",
        help="with a batch sweep: when the optimal batch size is uncertain, measure the batch "
        "sizes it names again (model level, pooled with the earlier iterations) up to N times; "
        "0 never repeats (default: 2)",
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
        help="run on this device: PyTorch on CUDA, or ONNX Runtime's CUDA execution provider "
        "on GPU N (needs onnxruntime-gpu) (default: cpu)",
    )
    parser.add_argument(
        "--provider",
        choices=PROVIDERS,
        type=str.lower,
        help="ONNX Runtime's execution provider, another way to say --device: cuda = "
        "--device cuda (GPU 0), cpu = --device cpu",
    )
    parser.add_argument(
        "--ncu-metrics",
        action="store_true",
        help="with --device cuda and level K, also run the model once under Nsight Compute "
        "(ncu on PATH) for per-kernel FLOPs, DRAM bytes and occupancy, summed per layer "
        "(XSP's metrics level: its own run; minutes for a large model)",
    )
    parser.add_argument(
        "--model-name",
        metavar="NAME",
        help="model name in the trace (default: the Triton model folder for "
        "<repo>/<name>/<version>/model.*, else the file name)",
    )


def device_of(device: str, provider: str | None) -> str:
    """The device `--device` and its alias `--provider` name together; ValueError when they
    disagree (`--provider cuda --device cuda:1` is GPU 1)."""
    if provider is None or device.split(":")[0] == provider:
        return device
    if device == "cpu":  # --device left at its default
        return provider
    raise ValueError(f"--provider {provider} contradicts --device {device}")


def run(args: argparse.Namespace) -> int:
    from sidecar.profile import ProfileOptions, run_profile

    try:
        device = device_of(args.device, args.provider)
    except ValueError as exc:
        print(f"xsp-sidecar profile: error: {exc}", file=sys.stderr)
        return 2
    return run_profile(
        ProfileOptions(
            model_path=Path(args.model_path),
            levels=args.levels,
            iterations=args.iterations,
            warmup=args.warmup,
            input_specs=tuple(args.input),
            inputs_file=args.inputs,
            batch_sizes=args.batch_size,
            db=args.db,
            optimizations=not args.no_optimizations,
            measure_peak=not args.no_peak,
            refresh_peak=args.refresh_peak,
            json=args.json,
            device=device,
            model_name=args.model_name,
            max_rounds=args.max_rounds,
            ncu_metrics=args.ncu_metrics,
        )
    )
