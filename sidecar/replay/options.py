"""What a replay needs to know, built once from the serve config and sent to the worker.

`ReplayOptions` is frozen and picklable: `serve` builds it from `ServeConfig`, and it travels
unchanged through `SamplingConfig` and `WorkerConfig` into the worker process, where the
replay reads its attributes. The defaults of user settings live in `ServeConfig` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sidecar.trace.spans import Level


@dataclass(frozen=True)
class ReplayOptions:
    """The settings of one leveled replay of a sampled request."""

    model_repository: Path  # the backend's model repository, mounted read-only
    db_path: Path  # the SQLite trace store the replay writes its trace to
    levels: tuple[Level, ...]  # in depth order, from `parse_levels`
    iterations: int  # timed iterations per leveled run
    warmup: int  # warm-up iterations per leveled run
    store_raw_inputs: bool  # keep the raw input tensors in the trace
    device: str  # --replay-device: auto, cpu or cuda:N, resolved per model (`replay.device`)
    python_models: bool = True  # --replay-python-models: run a Python model's own model.py
    # --backend-protocol: the backend whose decoders read the jobs and whose lookup finds models
    backend_protocol: str = "triton"
    threads: int = 1  # runtime threads of the worker (not a user setting)
