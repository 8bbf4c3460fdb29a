"""A stand-in for TF-Serving's profiler side, for tests: `python -m tests.live.tf_profiler_backend
PORT MODEL_BASE` saves `keras_cnn` as a SavedModel, loads it, serves TensorFlow's
ProfilerService on PORT (what TF-Serving serves on its gRPC port) and prints `ready`. Then each
line `run` on stdin runs one prediction and prints `ran START_NS END_NS` (wall clock)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(port: int, base: Path) -> None:
    import numpy as np
    import tensorflow as tf

    from tests.harness.tfserving.models import CNN, keras_cnn, save_model

    path = save_model(keras_cnn(), base, CNN)
    predict = tf.saved_model.load(str(path)).signatures["serving_default"]
    image = tf.constant(np.random.default_rng(0).random((1, 32, 32, 3), dtype=np.float32))
    predict(image=image)  # traced and warm before any capture
    tf.profiler.experimental.server.start(port)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        start = time.time_ns()
        predict(image=image)
        print(f"ran {start} {time.time_ns()}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
