"""What the proxy hands the profiling worker, and what comes back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProfileJob:
    """A copy of one sampled request, to be replayed with leveled profiling.

    `request_message` is the gRPC message (without the 5-byte prefix) as the client sent it;
    `parent_span_id` is the proxy span the replay hangs under; `reason` is why it was sampled
    (the trace's `sample_reason`): `rate`, `forced`, `slow` or `admin`.
    """

    trace_id: str
    parent_span_id: str
    model: str
    method: str
    request_message: bytes
    reason: str
    received_ns: int
    model_version: str = ""


class Outcome(enum.StrEnum):
    """How a job ended: the `outcome` label of `xsp_profiles_total` (a str, so it is the label)."""

    OK = "ok"  # profiled and stored
    ERROR = "error"  # the profile failed (stored as an error trace)
    TIMEOUT = "timeout"  # the worker overran the job timeout and was killed
    CRASH = "crash"  # the worker process died during the job
    STORE_ERROR = "store_error"  # the trace could not be written


@dataclass
class JobResult:
    """Outcome of one job. The numbers feed the Prometheus aggregates."""

    trace_id: str
    model: str
    outcome: Outcome
    busy_s: float
    error: str = ""
    level_latency_s: dict[str, float] = field(default_factory=dict)
    overhead_ratio: dict[str, float] = field(default_factory=dict)
    layer_type_share: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


# Errors after which this process cannot profile as before: CUDA's sticky errors (a
# device-side assert leaves the context unusable until the process ends; out-of-memory is not
# one) and a second CUPTI client asked for where another already ran (`gpu.owner`).
_POISONING = (
    ("CUDA error:", "a CUDA error leaves this process's CUDA context unusable"),
    ("CUDA failure", "a CUDA error leaves this process's CUDA context unusable"),
    ("CuptiOwnerError", "another CUPTI client already used this process"),
)


def needs_fresh_process(result: JobResult) -> str | None:
    """Why the worker must hand the next job to a fresh process after `result`, or None."""
    if result.outcome not in (Outcome.ERROR, Outcome.STORE_ERROR):
        return None
    for marker, why in _POISONING:
        if marker in result.error:
            return why
    return None
