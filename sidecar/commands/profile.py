"""`xsp-sidecar profile MODEL_PATH`: a standalone leveled (model -> layer -> kernel) profile.

The flags; the work is `sidecar.profile.run_profile`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "profile"
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
        help="PyTorch models: run on this device (default: cpu)",
    )
    parser.add_argument(
        "--model-name",
        metavar="NAME",
        help="model name in the trace (default: the Triton model folder for "
        "<repo>/<name>/<version>/model.*, else the file name)",
    )


def run(args: argparse.Namespace) -> int:
    from sidecar.profile import ProfileOptions, run_profile

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
            device=args.device,
            model_name=args.model_name,
            max_rounds=args.max_rounds,
        )
    )
