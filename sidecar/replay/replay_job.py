"""Replay one sampled request with leveled profiling (runs inside the profiling worker).

Decode the request's tensors (a KServe `ModelInferRequest` or a TF-Serving `PredictRequest`:
the decoder the job's method has in `sidecar.backends`), find the model in the mounted
repository (as that backend finds it), run the leveled
experiment on a local runtime, hang the replay under the proxy's span, store the trace and
return the numbers the Prometheus aggregates need. The device it runs on is decided per model
(`replay.device`, `--replay-device`) and stored on the trace and its model spans. A failure
is stored as a trace with `status=error` too, so an operator sees that a sample was taken and
why it has no profile. A trace that cannot be stored (disk full, read-only, locked) is the
outcome `store_error`, not an exception: the proxy then backs off sampling until the store
works again.
"""

from __future__ import annotations

import base64
import collections
import functools
import logging
import time
from typing import Any

import numpy as np

import sidecar.profiling.runners.onnxruntime  # noqa: F401  ONNX Runtime loads at worker start
from sidecar import __version__
from sidecar.backends import Backend, backend_named
from sidecar.backends.base import DecodedInputs
from sidecar.backends.model_repository import ModelLocation, TensorSpec, python_models
from sidecar.profiling.experiment import LeveledProfile, describe_inputs, run_experiment
from sidecar.profiling.formats import ModelFormat
from sidecar.profiling.inputs import InputError, InputSpec, random_inputs, savedmodel_input_specs
from sidecar.profiling.peak import Peak, get_peak
from sidecar.profiling.runners.select import runner_for
from sidecar.profiling.server_config import ReplaySettings, replay_settings, server_summary
from sidecar.profiling.vocabulary import ModelLookup, ProfilingError, Runner
from sidecar.replay.context import ReplayContext
from sidecar.replay.device import DeviceChoice, driver_device_name, resolve
from sidecar.replay.job_records import JobResult, Outcome, ProfileJob, failed
from sidecar.replay.options import ReplayOptions
from sidecar.trace import schema
from sidecar.trace.errors import TraceStoreError
from sidecar.trace.spans import ERROR, Level, LevelStats, Span, Trace

log = logging.getLogger(__name__)

RUNNER_CACHE_SIZE = 4
_KSERVE_TO_NUMPY = {
    "BOOL": "bool", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64",
}  # fmt: skip


class ReplayError(Exception):
    """The sampled request cannot be replayed; the message says why."""


def decode_request(job: ProfileJob, backend: Backend) -> DecodedInputs | None:
    """The job's request as arrays (None without a message: an admin profile), by the decoder
    `backend` (the configured one) declares for the job's method."""
    if not job.request_message:
        return None
    decoder = backend.decoders.get(job.method)
    if decoder is None:
        raise ReplayError(_not_replayable(job.method, backend))
    return decoder(job.request_message)


def _not_replayable(method: str, backend: Backend) -> str:
    known = ", ".join(backend.decoders)
    return f"{backend.name} requests of {method} cannot be decoded (replayable: {known})"


def _lookup(options: ReplayOptions) -> ModelLookup:
    """How the configured backend finds a model in its repository: the model itself here, and
    what a runner follows it to (BLS callees, ensemble steps)."""
    backend = backend_named(options.backend_protocol)
    return python_models(backend.repository.find, options.python_models)


def _device(location: ModelLocation, context: ReplayContext) -> DeviceChoice:
    """Where this model's replay runs (see `replay.device`). What each runtime can use is
    asked once per worker process (`ReplayContext.cuda_probe` replaces the probe in tests)."""
    return resolve(context.options.device, location.format, location.config, context.probe)


def _peak(device: str) -> Peak | None:
    """The roofs of the replay device: this machine's measured CPU peak, or a GPU's data-sheet
    figures (a microbenchmark would compete with serving on the GPU the backend uses)."""
    return get_peak() if device == "cpu" else _gpu_peak(device)


@functools.cache
def _gpu_peak(device: str) -> Peak | None:
    """A GPU's data-sheet peak by the name its driver gives it (asked once per worker)."""
    from sidecar.profiling.gpu.gpu_peak import datasheet_peak

    name = driver_device_name(int(device.split(":")[1]))
    try:
        return datasheet_peak(name).peak if name else None
    except LookupError:
        return None


def _settings(
    location: ModelLocation, choice: DeviceChoice, context: ReplayContext
) -> ReplaySettings | None:
    """What the model's `config.pbtxt` asks of the replay (None without one): it wins over
    the worker's own thread count (`server_config`)."""
    if location.config is None:
        return None
    available: list[str] = []
    if location.format is ModelFormat.ONNX:
        import onnxruntime as ort

        available = ort.get_available_providers()
    return replay_settings(
        location.config,
        location.format,
        device=choice.device,
        device_reason=choice.reason,
        available_providers=available,
        worker_threads=context.options.threads,
    )


def _runner(
    location: ModelLocation,
    context: ReplayContext,
    device: str = "cpu",
    settings: ReplaySettings | None = None,
    find: ModelLookup | None = None,
) -> Runner:
    """A runner for the model on `device` with the config's settings, from a small LRU of
    loaded sessions; `find` is the repository's lookup (`_lookup`)."""
    cache = context.runners
    applied = (settings.ort, settings.torch) if settings is not None else None
    key = f"{location.path}:{location.path.stat().st_mtime_ns}:{device}:{applied!r}"
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    runner = runner_for(
        location.path,
        location.format,
        device=device,
        threads=context.options.threads,
        name=location.name,
        settings=settings,
        find=find,
    )
    context.keep(key, runner, RUNNER_CACHE_SIZE)  # an evicted Python model is finalized
    return runner


def _random_inputs(location: ModelLocation) -> dict[str, np.ndarray]:
    """Inputs shaped by the model config (or a SavedModel's serving signature), batch 1, for
    admin profiles without a request."""
    if not location.inputs and location.format is ModelFormat.SAVEDMODEL:
        try:
            specs = savedmodel_input_specs(location.path, 1, other_unknown_dims=1)
        except InputError as exc:
            raise ReplayError(f"{exc}; give inputs in the TriggerProfile request") from None
        return random_inputs(specs)
    specs = []
    for tensor in location.inputs:
        specs.append(_input_spec(tensor, batched=location.max_batch_size > 0))
    if not specs:
        raise ReplayError(
            f"model {location.name!r} declares no inputs in config.pbtxt; "
            "give inputs in the TriggerProfile request"
        )
    return random_inputs(specs)


def _input_spec(tensor: TensorSpec, batched: bool) -> InputSpec:
    dtype = _KSERVE_TO_NUMPY.get(tensor.datatype)
    if dtype is None:
        raise ReplayError(f"cannot generate random {tensor.datatype} data for {tensor.name!r}")
    dims = tuple(1 if d < 0 else d for d in tensor.dims)
    return InputSpec(tensor.name, (1, *dims) if batched else dims, dtype)


def _batch_size(inputs: dict[str, np.ndarray], location: ModelLocation) -> int | None:
    if location.format is ModelFormat.SAVEDMODEL and location.config is None:
        leading = {a.shape[0] for a in inputs.values() if a.ndim > 0}  # TF-Serving: no config
        return int(leading.pop()) if len(leading) == 1 else None
    if location.max_batch_size <= 0 or not inputs:
        return None
    first = next(iter(inputs.values()))
    return int(first.shape[0]) if first.ndim else None


def _raw_inputs(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        name: {
            "dtype": str(arr.dtype),
            "shape": list(arr.shape),
            "data_base64": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode(),
        }
        for name, arr in inputs.items()
        if arr.dtype != object
    }


def _write(
    context: ReplayContext,
    trace: Trace,
    spans: list[Span],
    level_stats: list[LevelStats] | tuple[()] = (),
) -> str | None:
    """Store the trace; the reason as text if the store failed."""
    try:
        context.store.write_trace(trace, spans, level_stats)
    except TraceStoreError as exc:
        return str(exc)
    return None


def replay_job(job: ProfileJob, context: ReplayContext) -> JobResult:
    """Profile one sampled request; the worker's `ReplayFunction`."""
    options: ReplayOptions = context.options
    started = time.perf_counter()
    trace = Trace(
        trace_id=job.trace_id,
        model=job.model,
        created_ns=time.time_ns(),
        model_version=job.model_version,
        sample_reason=job.reason,
        sidecar_version=__version__,
    )
    choice: DeviceChoice | None = None
    settings: ReplaySettings | None = None
    try:
        request = decode_request(job, backend_named(options.backend_protocol))
        version = job.model_version or (request.version if request else "")
        find = _lookup(options)
        location = find(options.model_repository, job.model, version or None)
        if request is None:
            inputs, input_source = _random_inputs(location), "random"
        else:
            inputs, input_source = request.inputs, "request"
        choice = _device(location, context)
        settings = _settings(location, choice, context)
        runner = _runner(location, context, choice.device, settings, find)
        profile = run_experiment(
            runner,
            inputs,
            model=job.model,
            levels=options.levels,
            iterations=options.iterations,
            warmup=options.warmup,
            batch_size=_batch_size(inputs, location),
            peak=_peak(choice.device),
            trace_id=job.trace_id,
        )
    except Exception as exc:
        trace.status, trace.error = "error", f"{type(exc).__name__}: {exc}"
        if choice is not None:
            trace.attributes.update(
                {schema.REPLAY_DEVICE: choice.device, schema.REPLAY_DEVICE_REASON: choice.reason}
            )
        if settings is not None:
            _mark_settings(trace, location, settings)
        on_gpu = choice is not None and choice.device.startswith("cuda")
        result = failed(job, Outcome.ERROR, 0.0, exc, on_gpu)
        if (store_error := _write(context, trace, [])) is not None:
            result.outcome = Outcome.STORE_ERROR
            result.error = f"{store_error} (the profile failed: {trace.error})"
        result.busy_s = time.perf_counter() - started
        return result
    _link(profile, job, location, input_source)
    _mark_device(profile, choice)
    if settings is not None:
        _mark_settings(profile.trace, location, settings)
    if request is not None and request.attributes:
        profile.trace.attributes.update(request.attributes)
    if options.store_raw_inputs:
        profile.trace.attributes[schema.RAW_INPUTS] = _raw_inputs(inputs)
    store_error = _write(context, profile.trace, profile.spans, profile.level_stats)
    if store_error is not None:
        return JobResult(
            job.trace_id, job.model, Outcome.STORE_ERROR, time.perf_counter() - started, store_error
        )
    if profile.trace.status == ERROR:  # a partial profile (an ensemble's failed step): kept
        return JobResult(
            job.trace_id,
            job.model,
            Outcome.ERROR,
            time.perf_counter() - started,
            profile.trace.error,
        )
    return _summary(profile, job, time.perf_counter() - started)


def _link(profile: LeveledProfile, job: ProfileJob, location: ModelLocation, source: str) -> None:
    """Hang the replay under the proxy's span and fill the trace's metadata."""
    trace = profile.trace
    trace.sample_reason = job.reason
    trace.model_version = location.version
    trace.attributes.update(
        {
            schema.BACKEND: location.backend or location.platform,
            schema.MODEL_PATH: str(location.path),
            schema.MODEL_FORMAT: location.format.value,
            schema.METHOD: job.method,
            schema.INPUT_SOURCE: source,
            schema.REQUEST_SPAN_ID: job.parent_span_id,
            schema.RECEIVED_NS: job.received_ns,
        }
    )
    trace.attributes.setdefault(schema.INPUTS, describe_inputs({}))
    for span in profile.spans:
        if span.level is Level.MODEL and span.parent_id is None:
            span.parent_id = job.parent_span_id


def _mark_device(profile: LeveledProfile, choice: DeviceChoice) -> None:
    """Say where the replay ran: on the trace and on every model span (`device`)."""
    profile.trace.attributes.update(
        {schema.REPLAY_DEVICE: choice.device, schema.REPLAY_DEVICE_REASON: choice.reason}
    )
    for span in profile.spans:
        if span.level is Level.MODEL:
            span.attributes.update(
                {schema.DEVICE: choice.device, schema.DEVICE_REASON: choice.reason}
            )


def _mark_settings(trace: Trace, location: ModelLocation, settings: ReplaySettings) -> None:
    """Say how the server runs the model and what the replay applied of it (a replay runs the
    sampled request's own batch: the batching settings are in `server_config` only)."""
    trace.attributes.update(
        {
            schema.REPLAY_SETTINGS: settings.record_dicts(),
            schema.SERVER_CONFIG: server_summary(location.config),
        }
    )


def _summary(profile: LeveledProfile, job: ProfileJob, busy_s: float) -> JobResult:
    latency = {s.level.value: s.trimmed_mean_ns / 1e9 for s in profile.level_stats}
    overhead = {s.level.value: s.overhead_ratio for s in profile.level_stats}
    by_type: dict[str, int] = collections.defaultdict(int)
    for span in profile.spans:
        if span.level is Level.LAYER:
            by_type[span.kind] += span.duration_ns or 0
    total = sum(by_type.values())
    share = {kind: ns / total for kind, ns in by_type.items()} if total else {}
    return JobResult(
        job.trace_id,
        job.model,
        Outcome.OK,
        busy_s,
        level_latency_s=latency,
        overhead_ratio=overhead,
        layer_type_share=share,
    )


__all__ = ["DecodedInputs", "ProfilingError", "ReplayError", "decode_request", "replay_job"]
