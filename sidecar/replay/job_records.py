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
    # the live request carried this trace's traceparent to the backend, so the backend's own
    # spans may join the trace (False: a stream's message, a slow sample)
    traced: bool = True


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
    # the type of the exception that failed the job (`module.QualName`; "" if none did)
    error_type: str = ""
    # why the process that ran the job cannot run another ("": it can), decided where the
    # exception was caught, from its type (`poisoning`)
    fresh_process: str = ""
    level_latency_s: dict[str, float] = field(default_factory=dict)
    overhead_ratio: dict[str, float] = field(default_factory=dict)
    layer_type_share: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


# Exception types after which this process cannot profile as before, by qualified name (this
# module imports neither torch nor ONNX Runtime): CUDA's sticky errors (a device-side assert
# leaves the context unusable until the process ends) and a second CUPTI client asked for where
# another already ran (`gpu.owner`). Out-of-memory is none: torch raises `torch.OutOfMemoryError`
# for it, ONNX Runtime its allocator's own failure, and the next job can run in the same process.
_CUDA = "a CUDA error leaves this process's CUDA context unusable"
_POISONING: dict[str, str] = {
    "torch.AcceleratorError": _CUDA,  # torch >= 2.8: every CUDA error but out-of-memory
    "sidecar.profiling.gpu.owner.CuptiOwnerError": "another CUPTI client already used this process",
}
# ONNX Runtime has no type of its own for a CUDA error: a failed CUDA call in a run is its
# generic `Fail` (or `EPFail`), which is a CUDA error only where the session ran on a GPU.
_POISONING_ON_GPU: dict[str, str] = {
    "onnxruntime.capi.onnxruntime_pybind11_state.Fail": _CUDA,
    "onnxruntime.capi.onnxruntime_pybind11_state.EPFail": _CUDA,
}


def qualified_name(cls: type) -> str:
    """`module.QualName` of an exception type (builtins without the module)."""
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def poisoning(exc: BaseException, on_gpu: bool = False) -> str:
    """Why `exc` leaves this process unable to profile as before ("" when it does not): by its
    type or the type of an exception it was raised from (`__cause__`, `__context__`), a type
    in `_POISONING` or a subclass of one; `on_gpu`: the replay that raised it ran on a GPU."""
    table = {**_POISONING, **_POISONING_ON_GPU} if on_gpu else _POISONING
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for cls in type(current).__mro__:
            why = table.get(qualified_name(cls))
            if why is not None:
                return why
        current = current.__cause__ or current.__context__
    return ""


def failed(
    job: ProfileJob, outcome: Outcome, busy_s: float, exc: BaseException, on_gpu: bool = False
) -> JobResult:
    """The result of `job` failed by `exc`, its type and what it means for the process kept."""
    return JobResult(
        job.trace_id, job.model, outcome, busy_s, error=f"{type(exc).__name__}: {exc}",
        error_type=qualified_name(type(exc)), fresh_process=poisoning(exc, on_gpu),
    )  # fmt: skip


def needs_fresh_process(result: JobResult) -> str | None:
    """Why the worker must hand the next job to a fresh process after `result`, or None."""
    if result.outcome not in (Outcome.ERROR, Outcome.STORE_ERROR):
        return None
    return result.fresh_process or None
