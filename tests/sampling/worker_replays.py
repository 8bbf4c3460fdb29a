"""Replay functions for supervisor tests, run inside the real worker process.

They stand in for the leveled replay to exercise the failure modes the supervisor must
survive (a worker that dies, hangs or raises); the replay itself is tested elsewhere.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from sidecar.replay.context import ReplayContext
from sidecar.replay.job_records import JobResult, Outcome, ProfileJob
from sidecar.replay.options import ReplayOptions
from sidecar.sampling.worker import WorkerConfig
from sidecar.trace.spans import Level

_JOBS_IN_THIS_PROCESS = itertools.count(1)  # the worker process is spawned: starts at 1


def worker_config(replay: str, threads: int = 1, **config: Any) -> WorkerConfig:
    """A worker running one of the replays below (which read no options but `threads`)."""
    options = ReplayOptions(
        model_repository=Path("unused-repository"),
        db_path=Path("unused.db"),
        levels=(Level.MODEL,),
        iterations=1,
        warmup=0,
        store_raw_inputs=False,
        device="auto",
        threads=threads,
    )
    config = {"queue_size": 8, "job_timeout_s": 120.0, **config}
    return WorkerConfig(replay=f"tests.sampling.worker_replays:{replay}", options=options, **config)


def echo_pid(job: ProfileJob, context: ReplayContext) -> JobResult:
    return JobResult(
        job.trace_id,
        job.model,
        Outcome.OK,
        0.001,
        details={
            "pid": os.getpid(),
            "nice": os.nice(0),
            "threads": context.options.threads,
            "policy": os.sched_getscheduler(0),
        },
    )


def by_model(job: ProfileJob, context: ReplayContext) -> JobResult:
    """`crash` exits the process, `hang` sleeps forever, `raise` raises, anything else is ok."""
    if job.model == "crash":
        os._exit(3)
    if job.model == "hang":
        time.sleep(3600)
    if job.model == "raise":
        raise ValueError("model exploded")
    if job.model == "second-cupti-client":  # the real error of `gpu.owner`
        from sidecar.profiling.gpu.owner import CUPTI_TRACER, TORCH_PROFILER, CuptiOwner

        owner = CuptiOwner()
        owner.claim(TORCH_PROFILER)
        owner.claim(CUPTI_TRACER)
    if job.model == "says-cuda-error":  # no CUDA error, whatever its text says
        raise RuntimeError("CUDA error: device-side assert triggered")
    if job.model == "slow":
        time.sleep(0.5)
    return echo_pid(job, context)


def cupti_client(job: ProfileJob, context: ReplayContext) -> JobResult:
    """`kernels` claims CUPTI for this process as `CuptiTracer.start()` does on a GPU (FAKE:
    no GPU here, so no CUPTI records; only the claim the worker reads); anything else is ok."""
    if job.model == "kernels":
        from sidecar.profiling.gpu.owner import CUPTI_TRACER, PROCESS_OWNER

        PROCESS_OWNER.claim(CUPTI_TRACER)
    return echo_pid(job, context)


def gate_view(job: ProfileJob, context: ReplayContext) -> JobResult:
    """What the worker's pacer sees of the relay's counters (the `SliceGate` when the
    supervisor was given a `ServingPressure`)."""
    from sidecar.profiling import pacing
    from sidecar.sampling.slices import SliceGate

    pacer = pacing.pacer()
    details: dict[str, Any] = {"gate": isinstance(pacer, SliceGate)}
    if isinstance(pacer, SliceGate):
        details["busy"] = pacer.busy()
    return JobResult(job.trace_id, job.model, Outcome.OK, 0.001, details=details)


def one_at_a_time(job: ProfileJob, context: ReplayContext) -> JobResult:
    """Records the process, its job count (the state a CUDA context lives in) and its
    interval; sleeps 0.1 s without CPU, a stand-in for waiting on `torch.cuda.synchronize()`."""
    started = time.time_ns()
    jobs = next(_JOBS_IN_THIS_PROCESS)
    time.sleep(0.1)
    details = {"pid": os.getpid(), "jobs": jobs, "start": started}
    details["end"] = time.time_ns()
    return JobResult(job.trace_id, job.model, Outcome.OK, 0.0, details=details)


class _MarksItsClose:
    """A loaded runner that writes `closed` to `path` when the worker closes it (as a Python
    model's runner calls its `finalize`)."""

    name = "marks_its_close"

    def __init__(self, path: str) -> None:
        self.path = path

    def close(self) -> None:
        Path(self.path).write_text("closed")


def keeps_a_runner(job: ProfileJob, context: ReplayContext) -> JobResult:
    """Keeps a runner that marks its close in the file `job.model` names."""
    context.keep(job.model, _MarksItsClose(job.model), 4)  # type: ignore[arg-type]
    return JobResult(job.trace_id, job.model, Outcome.OK, 0.001)
