"""Sampling the messages of an inference stream (Triton's `ModelStreamInfer`) one by one.

Each request message of such a stream is one inference (`sidecar.proxy.inferences`), and is
decided on like a unary call: a coin flip at its prefix (`Sampler.at_headers`; nothing is
copied unless it comes up), then at its end the model's rate, budget and duty cycle
(`Sampler.at_body`), one decision counted per message in `xsp_sampling_decisions_total`. A
sampled message (whole, up to the capture limit) becomes a `ProfileJob` replayed as the
backend's unary method (`Backend.replayable`: ModelStreamInfer -> ModelInfer); its trace's request
span is that inference, from its message to its final response, with its responses' times.

A stream forced by the force header has every message forced (budget and duty cycle still
apply). No `traceparent` is added: the stream's metadata is shared by all its messages, so
none of the backend's spans is joined to a message's trace (docs/contracts.md). Requests of
a stateful sequence (`sequence_*` parameters, or a model with `sequence_batching`) are not
replayed: dropped as `sequence_model`. A message of a model no replay can run is kept
live-only (`take`). A message is never held for the duty cycle (`held`): a forced stream would
fill the hold with one stream's messages.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from sidecar.backends.model_repository import CONFIG_FILE, ModelConfigError, read_config
from sidecar.proxy.inferences import InferenceEnd
from sidecar.proxy.stream_messages import Unreadable, sequence_parameters
from sidecar.sampling import take
from sidecar.sampling.sampled_request import RelayedRequest, Sample, store_request_span
from sidecar.sampling.sampler import Decision, Sampler, Tentative
from sidecar.trace import schema
from sidecar.trace.spans import new_span_id, new_trace_id

_REASONS = {Tentative.RATE: "rate", Tentative.FORCED: "forced"}


def sequence_model(repository: Path, model: str) -> bool:
    """True where the model's `config.pbtxt` has `sequence_batching` (a stateful model); a
    model without a readable configuration is not known to be one."""
    path = repository / model / CONFIG_FILE
    try:
        return path.is_file() and read_config(path).HasField("sequence_batching")
    except (ModelConfigError, OSError):
        return False


class Hub(take.Hub, Protocol):
    """What a stream's sampling uses of the relay's `observer.SamplingHub`."""

    sampler: Sampler
    replayable: dict[str, str]


class StreamSampling:
    """The `MessageSampling` of one stream (relay thread only)."""

    __slots__ = (
        "_base_ns", "_base_s", "_forced", "_hub", "_job_method", "_method", "_path",
        "capture_limit",
    )  # fmt: skip

    def __init__(self, hub: Hub, method: str, path: str, forced: bool, capture_limit: int) -> None:
        self._hub = hub
        self._method = method
        self._job_method = hub.replayable[method]
        self._path = path
        self._forced = forced
        self.capture_limit = capture_limit
        # the relay's marks are perf_counter seconds; spans take Unix epoch ns
        self._base_ns = time.time_ns()
        self._base_s = time.perf_counter()

    def pick(self, size: int) -> tuple[object, bool] | None:
        tentative = self._hub.sampler.at_headers(self._forced)
        if tentative is Tentative.NO:
            return None
        return tentative, tentative in _REASONS  # gated: counted, not copied

    def message(self, token: object, model: str | None, full: bytes | None) -> object:
        hub = self._hub
        label = hub.handler.model_label(model)
        if not isinstance(token, Tentative):  # not picked by the coin flip
            hub.metrics.record_decision(label, Decision.SKIPPED_RATE)
            return None
        if token not in _REASONS:  # picked while the duty cycle or the store refuse
            hub.metrics.record_decision(label, hub.sampler.at_body(label, token))
            return None
        if full is None:  # larger than the capture limit: counted as a unary call's body
            hub.metrics.record_decision(label, Decision.SAMPLED)
            hub.metrics.dropped.labels(label, "body_unavailable").inc()
            return None
        decision = hub.sampler.at_body(label, token)
        hub.metrics.record_decision(label, decision)
        if decision is not Decision.SAMPLED:
            return None
        if model is None:  # compressed or unreadable
            hub.drop(label, "unreadable_request")
            return None
        if not hub.handler.known_model(model):
            hub.drop(label, "unknown_model")
            return None
        try:
            stateful = bool(sequence_parameters(full)) or hub.handler.sequence_model(model)
        except Unreadable:
            hub.drop(label, "unreadable_request")
            return None
        if stateful:
            hub.drop(label, "sequence_model")
            return None
        sample = Sample(new_trace_id(), new_span_id(), model, self._job_method, traced=False)
        return sample if take.take(hub, label, sample, full, _REASONS[token]) else None

    def ended(self, sample: object, end: InferenceEnd) -> None:
        assert isinstance(sample, Sample)
        request = RelayedRequest(
            self._method, self._path, sample.model, self._ns(end.start), self._ns(end.end),
            end.end - end.start, end.code, end.error, end.request_bytes, end.response_bytes,
            {schema.STREAM_MESSAGE: True, **self._marks(end)},
        )  # fmt: skip
        store_request_span(self._hub, sample.trace_id, sample.span_id, request)

    def _ns(self, t: float) -> int:
        return self._base_ns + int((t - self._base_s) * 1e9)

    def _marks(self, end: InferenceEnd) -> dict[str, object]:
        """The relay marks of the inference (docs/contracts.md) and its responses' times."""
        marks: dict[str, object] = {
            schema.RELAY_REQUEST_START_NS: self._ns(end.start),
            schema.RELAY_REQUEST_END_NS: self._ns(end.start),
            schema.RELAY_RESPONSE_END_NS: self._ns(end.end),
            schema.RESPONSES: end.responses,
        }
        if end.responses:
            marks[schema.RELAY_RESPONSE_START_NS] = self._ns(end.first)
            marks[schema.FIRST_RESPONSE_NS] = self._ns(end.first)
            marks[schema.LAST_RESPONSE_NS] = self._ns(end.last)
            marks[schema.RESPONSE_GAPS_NS] = [int(g * 1e9) for g in end.gaps]
        return marks
