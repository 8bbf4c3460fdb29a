"""What the sampling hub hands sampled requests to (`SampleHandler`)."""

from __future__ import annotations

from typing import Protocol

from sidecar.backends.replayability import Replayability
from sidecar.proxy.streams import RequestStart
from sidecar.replay.job_records import ProfileJob
from sidecar.trace.spans import Span


class SampleHandler(Protocol):
    """What the hub hands sampled requests to and asks about them; `SamplingPipeline` is the
    product's, a test gives an in-memory one. Called on the relay's threads: nothing may block.
    """

    def model_label(self, model: str | None) -> str:
        """The model's name bounded for a metric label."""

    def known_model(self, model: str) -> bool:
        """False for a model the replay cannot find (not in the model repository): its
        sampled request is dropped before it is queued."""

    def sequence_model(self, model: str) -> bool:
        """True for a stateful model (`sequence_batching` in its configuration): a request
        replayed out of its sequence would not be the one served."""

    def replayability(self, model: str) -> Replayability:
        """Whether a replay can run the model (`backends.replayability`): a sample of one it
        cannot is kept live-only (`keep_live`), never queued."""

    def keep_live(self, job: ProfileJob, why: Replayability) -> bool:
        """Store the live-only trace row of a sample no replay can run (`job` is what its job
        would have been, without the request); False when the trace writer refused it."""

    def on_sampled(self, start: RequestStart, trace_id: str, span_id: str) -> object:
        """A request was picked at header time (its body is not read yet)."""

    def submit(self, job: ProfileJob) -> bool:
        """Queue a job for the profiling worker; False when the queue is full."""

    def remember(self, model: str, method: str, message: bytes) -> object:
        """Keep the last sampled request of a model (for the admin API)."""

    def store_spans(self, trace_id: str, spans: list[Span]) -> object:
        """Hand live spans (the proxy's request span) to the trace writer."""

    def record_exemplar(self, method: str, model: str, duration_s: float, trace_id: str) -> object:
        """At stream end, a call whose request span went to the store: its bounded labels and
        the relay's duration, to link the latency histogram to the trace."""
