"""The trace data model shared by the proxy, the profiler, the store and `analysis/`.

A trace is a tree of spans. Live spans come from the proxy (`Level.REQUEST`) and the backend
(`Level.SERVER`, e.g. Triton's OpenTelemetry spans); replay spans come from the leveled
experiment: model (M) -> layer (L) -> kernel (K). All timestamps are integer nanoseconds on
one clock per trace (Unix epoch ns). `start_ns`/`end_ns` place a span on the timeline of one
representative iteration; `duration_ns` is the level's statistic (trimmed mean over the
iterations of the run where this level was the deepest one enabled).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sidecar.trace.schema import (  # the levels' one home is the schema (re-exported here)
    ERROR,
    LEVEL_CODES,
    LIVE_ONLY,
    OK,
    REPLAY_LEVELS,
    Level,
    Source,
)

__all__ = [
    "ERROR",
    "LEVEL_CODES",
    "LIVE_ONLY",
    "OK",
    "REPLAY_LEVELS",
    "Level",
    "LevelStats",
    "Source",
    "Span",
    "Trace",
    "new_span_id",
    "new_trace_id",
]


def new_trace_id() -> str:
    """A W3C-compatible 16-byte trace id as 32 lowercase hex digits."""
    return os.urandom(16).hex()


def new_span_id() -> str:
    """A W3C-compatible 8-byte span id as 16 lowercase hex digits."""
    return os.urandom(8).hex()


@dataclass
class Span:
    """One timed interval in a trace.

    `kind` is the span's type: the op type for a layer (`Conv`, `Gemm`, `aten::addmm`), the
    activity kind for a kernel (`kernel`, `memcpy`, `runtime`), the gRPC method for a request.
    `run_level` names the leveled run that produced the span (the deepest level enabled in
    it); live spans leave it `None`. Attributes hold everything else (shapes, bytes, provider,
    flops and whether they are estimated, `parent_ambiguous`, ...) and must be JSON-safe.
    """

    trace_id: str
    span_id: str
    parent_id: str | None
    level: Level
    name: str
    kind: str
    start_ns: int
    end_ns: int
    source: Source
    duration_ns: int | None = None
    run_level: Level | None = None
    index: int = 0  # execution order among siblings of the same level
    attributes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.duration_ns is None:
            self.duration_ns = self.end_ns - self.start_ns

    @property
    def timeline_ns(self) -> int:
        """Length of this span on the representative timeline."""
        return self.end_ns - self.start_ns


@dataclass
class LevelStats:
    """Model latency measured in the run whose deepest level is `level` (XSP leveled runs).

    `overhead_ratio` is this run's model latency divided by the M run's model latency: how much
    the profilers down to `level` slowed the model.
    """

    trace_id: str
    level: Level
    iterations: int
    warmup: int
    trimmed_mean_ns: int
    median_ns: int
    min_ns: int
    max_ns: int
    overhead_ratio: float
    samples_ns: list[int] = field(default_factory=list)


@dataclass
class Trace:
    """Header of one trace: what was profiled, where, and why.

    `sample_reason` is `rate`, `forced`, `slow`, `admin` or `cli`. `status` is `ok`, `error`
    (with `error` saying why; a failed profile is still recorded) or `live_only` (no replay
    can run the model: the trace holds its live side, attribute `replay` says why).
    """

    trace_id: str
    model: str
    created_ns: int
    model_version: str = ""
    batch_size: int | None = None
    runtime: str = ""  # e.g. "onnxruntime 1.20.1 (CPUExecutionProvider)"
    device: str = ""  # CPU model or GPU name + driver
    sample_reason: str = "cli"
    sidecar_version: str = ""
    status: str = "ok"
    error: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
