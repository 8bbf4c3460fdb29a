"""How accurate is the leveled profile? Side by side for the small CNN, ResNet-50 v1.5 and a
transformer encoder (ONNX Runtime, CPU), and a ResNet-50-shaped Keras model as a TensorFlow
SavedModel (`tf_resnet50`: `keras.applications.ResNet50(weights=None)`, random weights, input
`--tf-image-size` square, 224 by default), all in one run:

- plain median: an independent timing loop around `session.run` in a fresh session (for
  TensorFlow: the signature's function of a freshly loaded SavedModel, outputs fetched with
  `.numpy()`) with no profiler, run before and after the profile (median of both);
- trace M: the trace's model-level latency (trimmed mean of the M run);
- ratio: trace M / plain median (goal 0.97-1.03);
- L overhead: the L run's model latency / the M run's;
- coverage: summed layer time / model time, both in the L run (goal >= 0.90);
- wall: seconds the whole leveled profile took.

    python bench/profiling_accuracy.py [--iterations 20] [--warmup 5] [--models small_cnn,...]
        [--tf-image-size 224]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness
from typing import Any

import numpy as np
import onnxruntime as ort

from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.inputs import onnx_input_specs, random_inputs
from sidecar.profiling.runners.onnxruntime import OnnxRuntimeRunner
from sidecar.profiling.vocabulary import Iteration, Runner
from sidecar.trace.spans import Level
from tests.harness import models

MODELS: dict[str, Callable[[], Any]] = {
    "small_cnn": models.small_cnn_onnx,
    "resnet50": models.resnet50_onnx,
    "transformer": models.transformer_encoder_onnx,
}
TF_MODELS = ("tf_resnet50",)


def tf_resnet50(base: Path, image_size: int) -> Path:
    """ResNet-50 (Keras, random weights) exported as a SavedModel; its folder."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from tests.harness.tfserving.models import save_model

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3))
    return save_model(model, base, "tf_resnet50")


def tf_plain_samples_ns(
    path: Path, feed: dict[str, np.ndarray], iterations: int, warmup: int
) -> list[int]:
    """Latencies of the signature's function in a plain loop: a fresh load, no profiler."""
    import tensorflow as tf

    function = tf.saved_model.load(str(path)).signatures["serving_default"]
    args = {k: tf.constant(v) for k, v in feed.items()}

    def call() -> None:
        for out in function(**args).values():
            out.numpy()

    for _ in range(warmup):
        call()
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    gc.collect()
    return samples


def plain_samples_ns(
    path: Path, feed: dict[str, np.ndarray], iterations: int, warmup: int
) -> list[int]:
    """Latencies of `session.run` in a plain loop: a fresh session, no profiler."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for _ in range(warmup):
        session.run(None, feed)
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        session.run(None, feed)
        samples.append(time.perf_counter_ns() - t0)
    del session  # its intra-op threads must not compete with the profiled sessions
    gc.collect()
    return samples


def coverage(run_iterations: list[Iteration]) -> float:
    """Median over iterations of summed layer time / model time in the L run."""
    values = []
    for it in run_iterations:
        layer_ns = sum(s.duration_ns for s in it.spans if s.level is Level.LAYER)
        values.append(layer_ns / it.latency_ns)
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--models", default=",".join([*MODELS, *TF_MODELS]))
    parser.add_argument(
        "--tf-image-size", type=int, default=224, help="tf_resnet50 input size (default: 224)"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    rows: list[tuple[str, float, float, float, float, float, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="xsp-bench-") as tmp:
        for name in names:
            runner: Runner
            plain_fn: Callable[[Path, dict[str, np.ndarray], int, int], list[int]]
            make: Callable[[Path], Runner]
            if name in TF_MODELS:
                from sidecar.profiling.inputs import savedmodel_input_specs
                from sidecar.profiling.runners.tensorflow import TensorFlowRunner

                path = tf_resnet50(Path(tmp), args.tf_image_size)
                feed = random_inputs(savedmodel_input_specs(path, args.batch_size))
                plain_fn, make = tf_plain_samples_ns, TensorFlowRunner
            else:
                path = models.save_onnx(MODELS[name](), Path(tmp) / f"{name}.onnx")
                feed = random_inputs(onnx_input_specs(path, args.batch_size))
                plain_fn, make = plain_samples_ns, OnnxRuntimeRunner
            # the plain loop runs before and after the profile so that drift hits both alike
            before = plain_fn(path, feed, args.iterations, args.warmup)
            t0 = time.perf_counter()
            runner = make(path)
            res = run_experiment(
                runner,
                feed,
                model=name,
                levels=[Level.MODEL, Level.LAYER],
                iterations=args.iterations,
                warmup=args.warmup,
                batch_size=args.batch_size,
            )
            wall = time.perf_counter() - t0
            del runner
            gc.collect()
            after = plain_fn(path, feed, args.iterations, args.warmup)
            plain = statistics.median(before + after)
            m = res.stats(Level.MODEL).trimmed_mean_ns
            rows.append(
                (
                    name,
                    plain / 1e6,
                    m / 1e6,
                    m / plain,
                    res.stats(Level.LAYER).overhead_ratio,
                    coverage(res.runs[Level.LAYER].iterations),
                    wall,
                    len(res.spans_at(Level.LAYER)),
                )
            )
            print(f"done {name}", file=sys.stderr)
    runtimes = f"onnxruntime {ort.__version__}"
    if any(n in TF_MODELS for n in names):
        import tensorflow as tf

        runtimes += f", tensorflow {tf.__version__} (tf_resnet50 at {args.tf_image_size}px)"
    print(
        f"{runtimes} CPU, batch {args.batch_size}, "
        f"{args.iterations} iterations + {args.warmup} warm-up per level"
    )
    print(
        f"{'model':<13}{'plain ms':>10}{'trace M ms':>12}{'ratio':>8}{'L overhead':>12}"
        f"{'coverage':>10}{'wall s':>8}{'layers':>8}"
    )
    for label, p_ms, m_ms, ratio, over, cov, secs, n in rows:
        print(
            f"{label:<13}{p_ms:>10.3f}{m_ms:>12.3f}{ratio:>8.3f}{over:>12.2f}{cov:>10.2f}"
            f"{secs:>8.2f}{n:>8}"
        )
    print("goals: ratio 0.97-1.03, coverage >= 0.90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
