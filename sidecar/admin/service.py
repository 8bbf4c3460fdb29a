"""`xsp.v1.Profiler`: trigger profiles, list traces, read and change sampling at run time.

Off unless the sidecar runs with `--admin`; it is served on the sidecar's own gRPC port,
which binds to localhost unless told otherwise. Every input is checked here, at the boundary:
a bad one is answered INVALID_ARGUMENT with the reason, a failing trace store UNAVAILABLE.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
from tritonclient.grpc import service_pb2

from sidecar.admin._proto.xsp.v1 import profiler_pb2, profiler_pb2_grpc
from sidecar.backends.kserve_decode import NUMPY_DTYPES
from sidecar.backends.model_repository import model_in_repository
from sidecar.backends.replayability import Replayability
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.last_requests import LastRequests
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings, SamplingSettingsError, check_name
from sidecar.trace.errors import TraceStoreError
from sidecar.trace.spans import Level, new_span_id, new_trace_id

log = logging.getLogger(__name__)

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 1000
MAX_INPUTS = 64
MAX_DIMS = 16


def build_infer_request(model: str, version: str, inputs: list[profiler_pb2.InputTensor]) -> bytes:
    """A KServe v2 ModelInferRequest carrying `inputs` as raw contents."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    for tensor in inputs:
        entry = request.inputs.add()
        entry.name = tensor.name
        entry.datatype = tensor.datatype
        entry.shape.extend(tensor.shape)
        request.raw_input_contents.append(tensor.raw_contents)
    return bytes(request.SerializeToString())


def settings_to_proto(settings: SamplingSettings) -> profiler_pb2.SamplingSettings:
    return profiler_pb2.SamplingSettings(
        rate=settings.rate,
        model_rates=dict(settings.model_rates),
        budget_per_minute=settings.budget_per_minute,
        force_header=settings.force_header or "",
        duty_cycle=settings.duty_cycle,
        enabled=settings.enabled,
    )


def apply_update(
    settings: SamplingSettings, update: profiler_pb2.UpdateSamplingRequest
) -> SamplingSettings:
    """The settings with `update` applied; `SamplingSettingsError` says what is wrong."""
    changes: dict[str, Any] = {}
    for name in ("rate", "budget_per_minute", "duty_cycle", "enabled"):
        if update.HasField(name):
            changes[name] = getattr(update, name)
    if update.HasField("force_header"):
        changes["force_header"] = update.force_header.lower() or None
    if update.model_rates:
        rates = dict(settings.model_rates)
        for model, rate in update.model_rates.items():
            if rate < 0 and not math.isnan(rate):
                rates.pop(model, None)
            else:
                rates[model] = rate
        changes["model_rates"] = rates
    return settings.updated(**changes)


def check_inputs(inputs: list[profiler_pb2.InputTensor]) -> None:
    """Raise `ValueError` unless every tensor is well-formed KServe v2 raw contents."""
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} input tensors, got {len(inputs)}")
    names = set()
    for tensor in inputs:
        check_name(tensor.name, "input name")
        if tensor.name in names:
            raise ValueError(f"input {tensor.name!r} is given twice")
        names.add(tensor.name)
        dtype = NUMPY_DTYPES.get(tensor.datatype)
        if dtype is None:
            raise ValueError(
                f"input {tensor.name!r}: unknown datatype {tensor.datatype[:32]!r} "
                f"(one of {', '.join(NUMPY_DTYPES)})"
            )
        if len(tensor.shape) > MAX_DIMS or any(d < 0 for d in tensor.shape):
            raise ValueError(
                f"input {tensor.name!r}: shape {list(tensor.shape)[: MAX_DIMS + 1]} must have at "
                f"most {MAX_DIMS} dimensions, none negative"
            )
        if tensor.datatype != "BYTES":
            expected = math.prod(tensor.shape) * dtype.itemsize
            if expected != len(tensor.raw_contents):
                raise ValueError(
                    f"input {tensor.name!r}: shape {list(tensor.shape)} of {tensor.datatype} "
                    f"needs {expected} bytes, raw_contents has {len(tensor.raw_contents)}"
                )


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers


class ProfilerService(profiler_pb2_grpc.ProfilerServicer):
    """Implements `xsp.v1.Profiler` over the sampler, the worker queue and the trace store."""

    def __init__(
        self,
        sampler: Sampler,
        submit: Callable[[ProfileJob], bool],
        db_path: Path | None,
        last_requests: LastRequests,
        *,
        model_repository: Path | None = None,
        disabled_reason: str | None = None,
        replayability: Callable[[str], Replayability] | None = None,
    ) -> None:
        """`replayability(model)`: whether a replay can run a model (the sampling pipeline's
        `ReplayabilityCache`); a trigger for one it cannot run is refused, naming why."""
        self._sampler = sampler
        self._submit = submit
        self._db_path = db_path
        self._last = last_requests
        self._repository = model_repository
        self._disabled_reason = disabled_reason
        self._replayability = replayability

    def TriggerProfile(
        self, request: profiler_pb2.TriggerProfileRequest, context: grpc.ServicerContext
    ) -> profiler_pb2.TriggerProfileResponse:
        if not request.model:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        try:
            check_name(request.model, "model")
            if request.version and not (request.version.isdigit() and len(request.version) < 19):
                raise ValueError(f"version must be a number, got {request.version[:32]!r}")
            check_inputs(list(request.inputs))
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._repository is not None and not model_in_repository(
            self._repository, request.model
        ):
            _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"model {request.model!r} is not in the model repository {self._repository}",
            )
        if self._disabled_reason is not None:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sampling is off: {self._disabled_reason}",
            )
        if self._replayability is not None:
            answer = self._replayability(request.model)
            if not answer.replayable:  # a profile is a replay: none can run this model
                _abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {request.model!r} cannot be profiled: no replay can run it "
                    f"({answer.reason}); its sampled requests are kept as live-only traces",
                )
        method = "ModelInfer"
        if request.inputs:
            message, source = (
                build_infer_request(request.model, request.version, list(request.inputs)),
                "given",
            )
        elif (last := self._last.get(request.model)) is not None:
            (method, message), source = last, "last_request"
        else:
            message, source = b"", "random"
        job = ProfileJob(
            trace_id=new_trace_id(),
            parent_span_id=new_span_id(),
            model=request.model,
            method=method,
            request_message=message,
            reason="admin",
            received_ns=time.time_ns(),
            model_version=request.version,
        )
        accepted = self._submit(job)
        return profiler_pb2.TriggerProfileResponse(
            trace_id=job.trace_id if accepted else "",
            accepted=accepted,
            input_source=source,
            message="queued" if accepted else "the profiling queue is full; try again later",
        )

    def ListTraces(
        self, request: profiler_pb2.ListTracesRequest, context: grpc.ServicerContext
    ) -> profiler_pb2.ListTracesResponse:
        limit = request.limit or DEFAULT_LIST_LIMIT
        if not 1 <= limit <= MAX_LIST_LIMIT:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"limit must be from 1 to {MAX_LIST_LIMIT} (0 = {DEFAULT_LIST_LIMIT}), "
                f"got {request.limit}",
            )
        if request.model:
            try:
                check_name(request.model, "model")
            except ValueError as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._db_path is None or not self._db_path.exists():
            return profiler_pb2.ListTracesResponse()
        try:
            summaries = self._summaries(request.model or None, limit)
        except (TraceStoreError, sqlite3.Error) as exc:
            log.warning("ListTraces: %s", exc)
            _abort(context, grpc.StatusCode.UNAVAILABLE, f"the trace store failed: {exc}")
        except ValueError as exc:  # a row that does not decode (bad JSON, unknown level)
            log.warning("ListTraces: a stored trace cannot be read: %s", exc)
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"the trace store failed: a stored trace cannot be read ({exc})",
            )
        return profiler_pb2.ListTracesResponse(traces=summaries)

    def _summaries(self, model: str | None, limit: int) -> list[profiler_pb2.TraceSummary]:
        from sidecar.trace.store import TraceStore

        store = TraceStore(self._db_path, create=False)  # type: ignore[arg-type]
        try:
            traces = store.list_traces(model=model, limit=limit)
            summaries = []
            for trace in traces:
                model_ns = next(
                    (
                        s.trimmed_mean_ns
                        for s in store.level_stats(trace.trace_id)
                        if s.level == Level.MODEL
                    ),
                    0,
                )
                summaries.append(
                    profiler_pb2.TraceSummary(
                        trace_id=trace.trace_id,
                        model=trace.model,
                        model_version=trace.model_version,
                        created_unix_ns=trace.created_ns,
                        sample_reason=trace.sample_reason,
                        status=trace.status,
                        error=trace.error,
                        batch_size=trace.batch_size or 0,
                        model_latency_ns=model_ns,
                        runtime=trace.runtime,
                        device=trace.device,
                    )
                )
        finally:
            store.close()
        return summaries

    def GetSampling(
        self, request: profiler_pb2.GetSamplingRequest, context: grpc.ServicerContext
    ) -> profiler_pb2.SamplingSettings:
        return settings_to_proto(self._sampler.settings)

    def UpdateSampling(
        self, request: profiler_pb2.UpdateSamplingRequest, context: grpc.ServicerContext
    ) -> profiler_pb2.SamplingSettings:
        try:
            settings = apply_update(self._sampler.settings, request)
        except SamplingSettingsError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._sampler.update(settings)
        log.info("sampling settings changed through the admin API: %s", settings)
        return settings_to_proto(settings)


def add_to_server(service: ProfilerService, server: grpc.Server) -> str:
    """Register the service; returns its full name for reflection."""
    profiler_pb2_grpc.add_ProfilerServicer_to_server(service, server)
    return str(profiler_pb2.DESCRIPTOR.services_by_name["Profiler"].full_name)
