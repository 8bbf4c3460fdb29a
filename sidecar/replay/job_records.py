"""What the proxy hands the profiling worker, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProfileJob:
    """A copy of one sampled request, to be replayed with leveled profiling.

    `request_message` is the gRPC message (without the 5-byte prefix) as the client sent it;
    `parent_span_id` is the proxy span the replay hangs under; `reason` is `random`, `forced`
    or `admin`.
    """

    trace_id: str
    parent_span_id: str
    model: str
    method: str
    request_message: bytes
    reason: str
    received_ns: int
    model_version: str = ""
    # the live request carried this trace's traceparent to the backend, so the backend's own
    # spans may join the trace (False: a stream's message, a slow sample)
    traced: bool = True


@dataclass
class JobResult:
    """Outcome of one job; `outcome` is the `xsp_profiles_total` label (`ok`, `error`,
    `timeout`, `crash`, `store_error`). The numbers feed the Prometheus aggregates."""

    trace_id: str
    model: str
    outcome: str
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
    if result.outcome not in ("error", "store_error"):
        return None
    for marker, why in _POISONING:
        if marker in result.error:
            return why
    return None
