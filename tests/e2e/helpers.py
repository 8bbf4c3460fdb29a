"""Helpers of the end-to-end tests: traffic for the sample CNN, trace counts, polling.

The sidecar itself runs as `sidecar.localtriton.sidecar_process.SidecarProcess`.
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path

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


def count_traces(db: Path, where: str = "1=1") -> int:
    if not db.exists():
        return 0
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        try:
            return int(con.execute(f"SELECT count(*) FROM traces WHERE {where}").fetchone()[0])
        except sqlite3.Error:
            return 0


def wait_until(predicate: object, timeout: float = 60.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False
