"""Helpers of the end-to-end tests: traffic for the sample CNN, polling.

The sidecar itself runs as `tests.harness.sidecar_process.SidecarProcess`; trace counts
come from `sidecar.trace.store.count_traces`.
"""

from __future__ import annotations

import time

import numpy as np
import tritonclient.grpc as grpcclient


def cnn_infer(
    client: grpcclient.InferenceServerClient, batch: int = 1, headers: dict[str, str] | None = None
) -> np.ndarray:
    x = grpcclient.InferInput("input", [batch, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.random.default_rng(batch).random((batch, 3, 32, 32), np.float32))
    result = client.infer("simple_cnn", [x], headers=headers)
    output: np.ndarray = result.as_numpy("output")
    return output


def wait_until(predicate: object, timeout: float = 60.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False
