"""The test and demo harness: what the tests, the benches and the demo run beside the sidecar.

- `triton/`: a real `tritonserver` (from `nvidia-pytriton`, in its own venv under `.triton/`),
  its sample model repository and the flags of its OpenTelemetry tracing;
- `tfserving/`: a stand-in for `tensorflow_model_server` (real TensorFlow behind TF-Serving's
  gRPC protos) and its Keras sample models;
- `sidecar_process`: `xsp-sidecar serve` as a child process; `process`: what the three child
  processes share (start, wait until ready, log tail, stop);
- `models`: small ONNX and PyTorch models built in code; `traces/`: synthetic traces, the
  report's scenarios and an in-memory trace store; `metrics_text`: reading a `/metrics` scrape;
- `demo/`: the demo, `python -m tests.harness.demo [--backend tfserving]`.

The runtime package never imports it (tests/test_layering.py), and neither the wheel nor the
image carries it.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
