"""Write the test / benchmark models (random weights, built locally) to a folder.

python scripts/make_models.py models/            # small CNN (.onnx, .pt), ResNet-50, transformer
python scripts/make_models.py models/ --only small_cnn
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

from tests.harness import models

BUILDERS = {
    "small_cnn": lambda d: [
        models.save_onnx(models.small_cnn_onnx(), d / "small_cnn.onnx"),
        models.small_cnn_torchscript(d / "small_cnn.pt"),
    ],
    "resnet50": lambda d: [models.save_onnx(models.resnet50_onnx(), d / "resnet50_v1_5.onnx")],
    "transformer": lambda d: [
        models.save_onnx(models.transformer_encoder_onnx(), d / "transformer_encoder.onnx")
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--only",
        choices=sorted(BUILDERS),
        action="append",
        help="build only these models (repeatable)",
    )
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(BUILDERS):
        t0 = time.perf_counter()
        paths = BUILDERS[name](args.folder)
        for path in paths:
            size = path.stat().st_size / 1e6
            print(f"{path}  {size:.1f} MB  ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
