"""The profiling worker: a separate process that replays sampled requests, and its supervisor.

The proxy never waits on it. `submit()` appends to a bounded in-process queue (a full queue
drops and counts); a dispatcher thread hands one job at a time to the worker process over a
pipe, so the supervisor always knows which job is running. A worker that dies (bad model,
OOM, runtime abort) or overruns `job_timeout_s` is killed if needed, its job is recorded as
`crash` or `timeout`, and a fresh process takes the next job. A worker that dies while idle
is replaced at once, not when the next job comes; workers that keep dying soon after they
start are replaced after a growing pause (1 s, 2 s, ... up to `max_restart_backoff_s`). The
worker runs at a lower CPU priority with a bounded number of runtime threads.

Given the relay's `ServingPressure`, the worker process profiles in slices through a
`SliceGate` (`sidecar.sampling.slices`): it waits before each job and between a profile's
iterations while the serving path is busy, and drops iterations that were preempted. The
time it waited is not busy time: the duty cycle is charged wall time minus waits (or CPU
time, when runtime threads used more; `busy_seconds`).

After a job in which a CUPTI client ran (a K level on a GPU: `gpu.owner`), the worker
process exits and a fresh one takes the next job, a planned replacement (no restart counted,
no back-off). Measured on an H100 (`bench/gpu_after_cupti.py`): once CUPTI has recorded
in a process, its forwards stay 1.2-2.1x slower at launch-bound sizes after every activity
kind is disabled again, so the next job's M level would time the profiler, not the model.

On a GPU (`--replay-device`): there is one worker process at a time (a replacement is started
only after the old one was joined or killed), it takes one job at a time from the pipe, and
its replay runs on that process's one thread, so the worker holds one CUDA context per device
and never runs two profiles on a GPU at once. Its busy time includes the GPU's: every timed
GPU iteration ends with `torch.cuda.synchronize()` (ONNX Runtime's `run` returns host
outputs), so the wall time charged to the duty cycle covers the GPU work, even when the
process slept in the driver and used little CPU.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from sidecar.profiling import pacing
from sidecar.profiling.gpu.owner import PROCESS_OWNER
from sidecar.replay.context import ReplayContext
from sidecar.replay.job_records import (
    JobResult,
    Outcome,
    ProfileJob,
    failed,
    needs_fresh_process,
)
from sidecar.replay.options import ReplayOptions
from sidecar.sampling.pressure import ServingPressure
from sidecar.sampling.ratelog import RateLimitedLog
from sidecar.sampling.slices import SliceGate, SliceSettings

log = logging.getLogger(__name__)
_IDLE = object()  # `_next_job` found no job within the liveness interval

ReplayFunction = Callable[[ProfileJob, ReplayContext], JobResult]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How the worker process runs. `replay` names the function that profiles one job, as
    `module:function` (imported in the worker process); it is given the job and the process's
    `ReplayContext`, which carries `options` unchanged. `options`, `queue_size` and
    `job_timeout_s` come from the serve config (no defaults here)."""

    replay: str = "sidecar.replay.replay_job:replay_job"
    options: ReplayOptions
    queue_size: int
    queue_bytes: int = 128 << 20  # request bytes the queue holds at most, all jobs together
    job_timeout_s: float
    nice: int = 10
    idle_scheduling: bool = True
    start_timeout_s: float = 60.0
    liveness_interval_s: float = 0.5  # how often an idle supervisor checks its worker
    min_uptime_s: float = 30.0  # a worker dying sooner counts towards the restart back-off
    max_restart_backoff_s: float = 60.0
    # how a worker given the relay's pressure paces its profiles
    slices: SliceSettings = field(default_factory=SliceSettings)


def _resolve(path: str) -> ReplayFunction:
    module_name, _, attr = path.partition(":")
    function: ReplayFunction = getattr(importlib.import_module(module_name), attr)
    return function


def _lower_priority(config: WorkerConfig) -> None:
    """Nice the worker; on Linux also put it in SCHED_IDLE, so it only gets CPU that serving
    leaves idle (its timings then carry that risk of preemption, which trimmed means damp)."""
    with contextlib.suppress(OSError):
        os.nice(config.nice)
    if config.idle_scheduling and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def busy_seconds(wall_s: float, waited_s: float, cpu_s: float) -> float:
    """What one job costs the duty cycle: its wall time less the slice gate's waits, or its
    CPU time when runtime threads used more. Wall time, not CPU time, is the floor: a replay
    waiting for the GPU (synchronize at the end of each timed iteration) keeps it busy."""
    return max(wall_s - waited_s, cpu_s)


def _unfinished(job: ProfileJob, outcome: Outcome, started: float, error: str) -> JobResult:
    """The result of a job that did not finish its profile: `outcome` (`error`, `timeout`,
    `crash`), the time since it `started` (`time.perf_counter()`) and why."""
    return JobResult(job.trace_id, job.model, outcome, time.perf_counter() - started, error=error)


def _worker_main(
    config: WorkerConfig, conn: Connection, pressure: ServingPressure | None = None
) -> None:
    """Entry point of the worker process: receive a job, profile it, send the result."""
    _lower_priority(config)
    threads = config.options.threads
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    context = ReplayContext(config.options)  # the replay's state between jobs
    # as the process ends, however the loop below returns: its Python models' `finalize`
    multiprocessing.util.Finalize(context, context.close, exitpriority=10)
    replay = _resolve(config.replay)
    # created after the imports: start-up CPU is not profiling work to pay back
    gate = SliceGate(pressure, config.slices) if pressure is not None else None
    if gate is not None:
        pacing.install(gate)
    failures = RateLimitedLog(log, interval_s=30.0)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        conn.send(("started", job.trace_id))
        started, cpu_started = time.perf_counter(), time.process_time()
        if gate is not None:
            gate.start_job(time.monotonic() + config.job_timeout_s * config.slices.hold_share)
            gate.wait()  # the job's first slice: decoding and loading the model
        try:
            result = replay(job, context)
        except Exception as exc:  # a failed profile is a result, never a crash of the loop
            failures.log(
                type(exc).__name__, logging.ERROR, "profiling %r failed", job.model, exc_info=True
            )
            result = failed(job, Outcome.ERROR, time.perf_counter() - started, exc)
        wall = time.perf_counter() - started
        if gate is not None:
            gate.settle()
        waited, interrupted = gate.reset_counters() if gate is not None else (0.0, 0)
        result.busy_s = busy_seconds(wall, waited, time.process_time() - cpu_started)
        if gate is not None:
            result.details.update(wall_s=wall, waited_s=waited, iterations_interrupted=interrupted)
        if (client := PROCESS_OWNER.owner) is not None:
            conn.send(("retiring", f"{client} used CUPTI in it"))
        conn.send(("result", result))
        if (why := needs_fresh_process(result)) is not None:
            log.warning("profiling worker exits after %r failed: %s", job.model, why)
            return  # the supervisor starts a fresh process for the next job
        if client is not None:
            return  # CUPTI stays attached: the next job's M would run slower (module doc)


class ProfilingWorker:
    """Supervises one worker process and feeds it jobs from a bounded queue."""

    def __init__(
        self,
        config: WorkerConfig,
        on_result: Callable[[JobResult], None],
        on_restart: Callable[[str], None] | None = None,
        skip: Callable[[ProfileJob], bool] | None = None,
        pressure: ServingPressure | None = None,
    ) -> None:
        """`skip(job)`, asked just before a queued job would run, may drop it (e.g. while the
        trace store fails, what the job would store is lost anyway); the caller counts it.
        `pressure`, the relay's request counters, makes the worker profile in slices."""
        self.config = config
        self.pressure = pressure
        self._on_result = on_result
        self._on_restart = on_restart or (lambda reason: None)
        self._skip = skip or (lambda job: False)
        self._queue: collections.deque[ProfileJob] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._ctx = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self._thread: threading.Thread | None = None
        self.restarts = 0
        self.replacements = 0  # planned: after a job that used CUPTI
        self._retiring: str | None = None
        self.dropped = 0
        self.current: ProfileJob | None = None
        self._spawned_at = float("-inf")
        self._backoff = 0.0
        self._respawn_at: float | None = None

    # -- called from the proxy -------------------------------------------------------------
    def submit(self, job: ProfileJob) -> bool:
        """Queue a job without waiting; False (and counted) when the queue is full (in jobs or
        in request bytes)."""
        size = len(job.request_message)
        with self._cond:
            if (
                self._stopping
                or len(self._queue) >= self.config.queue_size
                or (self._queue and self._queued_bytes + size > self.config.queue_bytes)
            ):
                self.dropped += 1
                return False
            self._queue.append(job)
            self._queued_bytes += size
            self._cond.notify()
        return True

    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._dispatch, name="xsp-profiling", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._kill_process()

    # -- dispatcher thread ------------------------------------------------------------------
    def _spawn(self) -> None:
        self._spawned_at = time.monotonic()
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main,
            args=(self.config, child, self.pressure),
            name="xsp-profiling-worker",
            daemon=True,
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent
        if not parent.poll(self.config.start_timeout_s):
            raise RuntimeError("the profiling worker did not start")
        parent.recv()  # EOFError if it died while starting

    def _kill_process(self) -> None:
        process, self._process = self._process, None
        if self._conn is not None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(None)
            self._conn.close()
            self._conn = None
        if process is not None:
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)

    def _restart(self, reason: str) -> None:
        self.restarts += 1
        log.warning("profiling worker %s; restarting it", reason)
        self._on_restart(reason)
        self._kill_process()

    def _next_job(self) -> ProfileJob | object | None:
        """The next job; `_IDLE` after `liveness_interval_s` without one; None when stopping."""
        with self._cond:
            if not self._queue and not self._stopping:
                self._cond.wait(self.config.liveness_interval_s)
            if self._stopping:
                return None
            if not self._queue:
                return _IDLE
            job = self._queue.popleft()
            self._queued_bytes -= len(job.request_message)
            return job

    def _retire(self) -> None:
        """Join a worker that said it exits after its job (`retiring`), its replacement due
        at once: a planned replacement, not a restart (none counted, no back-off)."""
        reason, self._retiring = self._retiring, None
        log.info("profiling worker replaced after its job: %s", reason)
        self.replacements += 1
        self._kill_process()
        self._respawn_at = time.monotonic()

    def _keep_alive(self) -> None:
        """Make sure a worker runs while no job waits: started now, not on the next sample,
        so its start-up (imports, runtimes) happens while nothing waits for it."""
        if self._retiring is not None:
            self._retire()
        if self._process is not None and self._process.is_alive():
            self._respawn_at = None
            return
        now = time.monotonic()
        if self._respawn_at is None:  # just found dead (or never started): when to restart
            quick = now - self._spawned_at < self.config.min_uptime_s
            self._backoff = (
                min(self.config.max_restart_backoff_s, max(1.0, 2 * self._backoff))
                if quick
                else 0.0
            )
            self._respawn_at = now + self._backoff
            if self._backoff:
                log.warning(
                    "profiling worker lived %.1f s; next start in %.0f s",
                    now - self._spawned_at,
                    self._backoff,
                )
        if now < self._respawn_at:
            return
        self._respawn_at = None
        if self._process is not None:
            self._restart("exited while idle")
        try:
            self._spawn()
        except Exception as exc:
            log.warning("could not start the profiling worker: %s", exc)

    def _dispatch(self) -> None:
        while True:
            try:
                self._keep_alive()
            except Exception:  # never let the supervisor die
                log.exception("profiling worker supervisor error")
            job = self._next_job()
            if job is None:
                return
            if not isinstance(job, ProfileJob):
                continue
            try:
                if self._skip(job):
                    continue
                result = self._run_one(job)
            except Exception as exc:  # never let the supervisor die
                log.exception("profiling worker supervisor error")
                result = JobResult(job.trace_id, job.model, Outcome.ERROR, 0.0, error=str(exc))
            self.current = None
            try:
                self._on_result(result)
            except Exception:
                log.exception("profile result handler failed")

    def _run_one(self, job: ProfileJob) -> JobResult:
        started = time.perf_counter()
        self.current = job
        # A worker that died while idle is only noticed when the next job goes out; such a
        # job never started, so it is retried once on a fresh process.
        for attempt in range(2):
            outcome = self._attempt(job, started)
            if outcome is not None:
                return outcome
            if attempt == 0:
                self._restart("was found dead when a job was handed to it")
        return self._crashed(job, started)

    def _ensure_process(self) -> bool:
        if self._process is not None and self._process.is_alive():
            return True
        if self._process is not None:
            self._restart("exited while idle")
        try:
            self._spawn()
        except (EOFError, OSError, RuntimeError):
            return False
        return True

    def _attempt(self, job: ProfileJob, started: float) -> JobResult | None:
        """Run `job` on the worker; None if the worker died before it started the job."""
        if not self._ensure_process():
            return None
        assert self._conn is not None and self._process is not None
        try:
            self._conn.send(job)
        except (OSError, ValueError):
            return None
        began = False
        deadline = started + self.config.job_timeout_s
        while True:
            try:
                ready = self._conn.poll(min(0.2, max(0.0, deadline - time.perf_counter())))
            except (OSError, EOFError):
                ready = True
            if ready:
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    return self._crashed(job, started) if began else None
                if kind == "started":
                    began = True
                elif kind == "retiring":  # it exits after this job: replaced before the next
                    self._retiring = str(payload)
                elif kind == "result":
                    result: JobResult = payload
                    return result
                continue
            if not self._process.is_alive():
                return self._crashed(job, started) if began else None
            if time.perf_counter() >= deadline:
                self._restart(f"overran the {self.config.job_timeout_s:.0f} s job timeout")
                why = f"profile did not finish in {self.config.job_timeout_s:.0f} s"
                return _unfinished(job, Outcome.TIMEOUT, started, why)

    def _crashed(self, job: ProfileJob, started: float) -> JobResult:
        code = None
        if self._process is not None:
            self._process.join(2.0)  # the pipe closes a moment before the exit is reaped
            code = self._process.exitcode
        self._restart(f"died (exit code {code})")
        why = f"profiling worker died with exit code {code}"
        return _unfinished(job, Outcome.CRASH, started, why)
