"""`xsp.v1.Profiler`: trigger profiles, list traces, read and change sampling at run time.

Off unless the sidecar runs with `--admin`; it is served on the sidecar's own gRPC port,
which binds to localhost unless told otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from sidecar.admin._proto.xsp.v1 import profiler_pb2, profiler_pb2_grpc
from sidecar.sampling.jobs import ProfileJob
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings, SamplingSettingsError
from sidecar.trace.spans import Level, new_span_id, new_trace_id

log = logging.getLogger(__name__)


class LastRequests:
    """The last sampled request message per model (bounded by the proxy's model cap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._messages: dict[str, tuple[str, bytes]] = {}

    def remember(self, model: str, method: str, message: bytes) -> None:
        with self._lock:
            self._messages[model] = (method, message)

    def get(self, model: str) -> tuple[str, bytes] | None:
        with self._lock:
            return self._messages.get(model)


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
    changes: dict[str, Any] = {}
    for name in ("rate", "budget_per_minute", "duty_cycle", "enabled"):
        if update.HasField(name):
            changes[name] = getattr(update, name)
    if update.HasField("force_header"):
        changes["force_header"] = update.force_header.lower() or None
    if update.model_rates:
        rates = dict(settings.model_rates)
        for model, rate in update.model_rates.items():
            if rate < 0:
                rates.pop(model, None)
            else:
                rates[model] = rate
        changes["model_rates"] = rates
    return settings.updated(**changes)


class ProfilerService(profiler_pb2_grpc.ProfilerServicer):
    """Implements `xsp.v1.Profiler` over the sampler, the worker queue and the trace store."""

    def __init__(
        self,
        sampler: Sampler,
        submit: Callable[[ProfileJob], bool],
        db_path: Path | None,
        last_requests: LastRequests,
    ) -> None:
        self._sampler = sampler
        self._submit = submit
        self._db_path = db_path
        self._last = last_requests

    def TriggerProfile(
        self, request: profiler_pb2.TriggerProfileRequest, context: grpc.ServicerContext
    ) -> profiler_pb2.TriggerProfileResponse:
        if not request.model:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
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
        if self._db_path is None or not self._db_path.exists():
            return profiler_pb2.ListTracesResponse()
        from sidecar.trace.store import TraceStore

        store = TraceStore(self._db_path, create=False)
        try:
            traces = store.list_traces(model=request.model or None, limit=request.limit or 20)
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
        return profiler_pb2.ListTracesResponse(traces=summaries)

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
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._sampler.update(settings)
        log.info("sampling settings changed through the admin API: %s", settings)
        return settings_to_proto(settings)


def add_to_server(service: ProfilerService, server: grpc.Server) -> str:
    """Register the service; returns its full name for reflection."""
    profiler_pb2_grpc.add_ProfilerServicer_to_server(service, server)
    return str(profiler_pb2.DESCRIPTOR.services_by_name["Profiler"].full_name)
