"""The relay's sampling hook on its own: a real `Sampler` on a manual clock and real
`SamplingMetrics` on a fresh registry; the worker queue, the trace writer and the admin API's
request memory are one in-memory `SampleHandler`."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from sidecar.backends import TF_SERVING, TRITON, Backend
from sidecar.backends.replayability import REPLAYABLE, Replayability
from sidecar.proxy.streams import ConnectionInfo, QuietEnd, RequestStart, StreamEnd
from sidecar.replay.job_records import ProfileJob
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import (
    MAX_SAMPLED_BODY,
    SamplingHub,
    SamplingObserver,
    first_message,
    relay_marks,
)
from sidecar.sampling.sampler import Decision, Sampler
from sidecar.sampling.settings import DEFAULT_FORCE_HEADER, SamplingSettings
from sidecar.trace.spans import Level, Source, Span

INFER = "/inference.GRPCInferenceService/ModelInfer"
CONNECTION = ConnectionInfo(1, "127.0.0.1:5")
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll `condition` until it holds (the hold's thread acts on its own)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class InMemoryHandler:
    """The hub's `SampleHandler` in memory: keeps the jobs it is given (or refuses them while
    `queue_full`), the spans (or raises while `store_broken`), the requests remembered for the
    admin API, the header-time picks and the exemplars. `known` lists the models in the
    repository (None: every model), `sequence` the stateful ones, `not_replayable` the ones
    no replay can run (with why); `live` keeps their live-only samples."""

    known: set[str] | None = None
    sequence: set[str] = field(default_factory=set)  # stateful models (`sequence_batching`)
    not_replayable: dict[str, str] = field(default_factory=dict)
    live: list[tuple[ProfileJob, str]] = field(default_factory=list)
    queue_full: bool = False
    store_broken: bool = False
    jobs: list[ProfileJob] = field(default_factory=list)
    spans: list[tuple[str, list[Span]]] = field(default_factory=list)
    remembered: list[tuple[str, str, bytes]] = field(default_factory=list)
    picked: list[tuple[str, str, str]] = field(default_factory=list)  # path, trace, span
    exemplars: list[tuple[str, str, float, str]] = field(default_factory=list)

    def model_label(self, model: str | None) -> str:
        return model or "_unknown"

    def known_model(self, model: str) -> bool:
        return self.known is None or model in self.known

    def sequence_model(self, model: str) -> bool:
        return model in self.sequence

    def replayability(self, model: str) -> Replayability:
        why = self.not_replayable.get(model)
        return REPLAYABLE if why is None else Replayability(False, why)

    def keep_live(self, job: ProfileJob, why: Replayability) -> bool:
        if self.store_broken:
            return False
        self.live.append((job, why.attribute))
        return True

    def on_sampled(self, start: RequestStart, trace_id: str, span_id: str) -> None:
        self.picked.append((start.path, trace_id, span_id))

    def submit(self, job: ProfileJob) -> bool:
        if self.queue_full:
            return False
        self.jobs.append(job)
        return True

    def remember(self, model: str, method: str, message: bytes) -> None:
        self.remembered.append((model, method, message))

    def store_spans(self, trace_id: str, spans: list[Span]) -> bool:
        if self.store_broken:
            raise RuntimeError("the writer is gone")
        self.spans.append((trace_id, spans))
        return True

    def record_exemplar(self, method: str, model: str, duration_s: float, trace_id: str) -> None:
        self.exemplars.append((method, model, duration_s, trace_id))


class Setup:
    """A hub over fakes, one connection's observer, and a way to send whole calls through it."""

    def __init__(
        self,
        known: set[str] | None = None,
        *,
        rate: float = 1.0,
        budget_per_minute: float = 1000.0,
        duty_cycle: float = 1.0,
        force_header: str | None = DEFAULT_FORCE_HEADER,
        backend: Backend = TRITON,
    ) -> None:
        settings = SamplingSettings(
            rate=rate,
            budget_per_minute=budget_per_minute,
            duty_cycle=duty_cycle,
            force_header=force_header,
        )
        self.clock = ManualClock()
        self.sampler = Sampler(settings, clock=self.clock)
        self.registry = CollectorRegistry()
        self.handler = InMemoryHandler(known)
        metrics = SamplingMetrics(self.registry)
        self.hub = SamplingHub(self.sampler, metrics, self.handler, backend=backend)
        self.observer = self.hub.observer_factory(CONNECTION)
        self._next_stream = 1

    def request(
        self,
        model: str | None = "m",
        *,
        method: str = "ModelInfer",
        headers: tuple[tuple[bytes, bytes], ...] = (),
        body: bytes | None = None,
        send_body: bool = True,
    ) -> str | None:
        """One whole call through the hook, as the relay makes it; the traceparent added."""
        sid, self._next_stream = self._next_stream, self._next_stream + 2
        start = RequestStart(1, sid, INFER, method, [(b":path", INFER.encode()), *headers])
        decision = self.observer.on_request_headers(start)
        traceparent = None
        if isinstance(decision, QuietEnd):  # the relay counts its end; the hook hears no more
            decision.ended[decision.index] += 1
            if decision.per_model is not None:
                label = self.handler.model_label(model)  # the relay's label of the model
                decision.per_model[label] = decision.per_model.get(label, 0) + 1
            return None
        if decision is not None:
            assert decision.capture_body and decision.capture_limit == MAX_SAMPLED_BODY
            (name, traceparent), *_ = decision.extra_headers
            assert name == "traceparent" and TRACEPARENT.fullmatch(traceparent)
            if send_body:
                message = model.encode() if model else b""
                self.observer.on_request_body(sid, model, framed(message) if body is None else body)
        self.observer.on_stream_end(_end(sid, method, model))
        return traceparent

    def decisions(self, model: str = "m") -> dict[str, float]:
        return {
            d.value: value
            for d in Decision
            if (value := self.sample("xsp_sampling_decisions_total", model, decision=d.value))
        }

    def dropped(self, reason: str, model: str = "m") -> float:
        return self.sample("xsp_samples_dropped_total", model=model, reason=reason)

    def sample(self, name: str, model: str = "m", **labels: str) -> float:
        return self.registry.get_sample_value(name, {"model": model, **labels}) or 0.0


def framed(message: bytes, compressed: bool = False) -> bytes:
    return bytes([int(compressed)]) + len(message).to_bytes(4, "big") + message


def _end(sid: int, method: str, model: str | None) -> StreamEnd:
    return StreamEnd(1, sid, INFER, method, model, "OK", "", 1_700_000_000_000_000_000,
                     0.002, 20, 30)  # fmt: skip


def test_a_sampled_request_is_marked_copied_queued_remembered_and_spanned() -> None:
    s = Setup()
    traceparent = s.request("resnet")
    assert traceparent is not None
    trace_id, span_id = TRACEPARENT.fullmatch(traceparent).groups()  # type: ignore[union-attr]
    (job,) = s.handler.jobs
    assert (job.trace_id, job.parent_span_id, job.model) == (trace_id, span_id, "resnet")
    assert (job.request_message, job.reason, job.method) == (b"resnet", "rate", "ModelInfer")
    assert s.handler.remembered == [("resnet", "ModelInfer", b"resnet")]
    assert s.hub.is_sampled_trace(trace_id)
    ((stored_id, (span,)),) = s.handler.spans
    assert stored_id == trace_id and (span.trace_id, span.span_id) == (trace_id, span_id)
    assert (span.level, span.source, span.kind, span.parent_id) == (
        Level.REQUEST, Source.PROXY, "ModelInfer", None,
    )  # fmt: skip
    assert span.end_ns - span.start_ns == 2_000_000
    assert span.attributes["grpc_code"] == "OK" and span.attributes["model"] == "resnet"
    assert s.handler.exemplars == [("ModelInfer", "resnet", 0.002, trace_id)]
    assert s.handler.picked == [(INFER, trace_id, span_id)]
    assert (
        s.registry.get_sample_value(
            "xsp_sampling_decisions_total", {"model": "resnet", "decision": "sampled"}
        )
        == 1
    )


def test_each_sampled_request_gets_its_own_trace() -> None:
    s = Setup()
    first, second = s.request(), s.request()
    assert first is not None and second is not None and first != second
    assert len({job.trace_id for job in s.handler.jobs}) == 2


def test_unpicked_requests_get_no_traceparent_and_count_as_skipped_rate() -> None:
    s = Setup(rate=0.0)
    assert [s.request() for _ in range(3)] == [None] * 3
    assert s.handler.jobs == [] and s.handler.spans == [] and s.handler.remembered == []
    assert s.decisions() == {"skipped_rate": 3}


def test_the_force_header_samples_at_rate_zero() -> None:
    s = Setup(rate=0.0)
    assert s.request(headers=((b"x-xsp-profile", b"1"),)) is not None
    assert s.request(headers=((b"x-xsp-profile", b"0"),)) is None
    assert s.request(headers=((b"x-other", b"1"),)) is None
    assert [job.reason for job in s.handler.jobs] == ["forced"]
    assert s.decisions() == {"sampled": 1, "skipped_rate": 2}


def test_a_custom_force_header_or_none() -> None:
    custom = Setup(rate=0.0, force_header="x-profile-me")
    assert custom.request(headers=((b"x-profile-me", b"yes"),)) is not None
    assert custom.request(headers=((b"x-xsp-profile", b"1"),)) is None
    off = Setup(rate=0.0, force_header=None)
    assert off.request(headers=((b"x-xsp-profile", b"1"),)) is None
    assert off.handler.jobs == []


def test_methods_that_cannot_be_replayed_are_neither_sampled_nor_counted() -> None:
    s = Setup(rate=1.0)
    assert s.request(method="ModelMetadata") is None
    assert s.request(method="GetModelMetadata") is None
    assert s.request(method="Classify") is None
    assert s.decisions() == {} and s.handler.jobs == []


@pytest.mark.parametrize(
    ("backend", "own", "other"),
    [(TRITON, "ModelInfer", "Predict"), (TF_SERVING, "Predict", "ModelInfer")],
)
def test_only_the_configured_backends_methods_are_sampled(
    backend: Backend, own: str, other: str
) -> None:
    """Another backend's replayable method is not the configured backend's: never sampled,
    not even forced, and no decision counted."""
    s = Setup(rate=1.0, backend=backend)
    forced = ((b"x-xsp-profile", b"1"),)
    assert s.request(method=other, headers=forced) is None
    assert s.decisions() == {} and s.handler.jobs == []
    assert s.request(method=own) is not None
    assert [job.method for job in s.handler.jobs] == [own]


@pytest.mark.parametrize(
    ("method", "job_method"),
    [("Predict", "Predict"), ("ModelInfer", "ModelInfer")],
)
def test_a_sampled_request_keeps_the_method_its_message_is_decoded_by(
    method: str, job_method: str
) -> None:
    s = Setup(backend=TF_SERVING if method == "Predict" else TRITON)
    assert s.request("keras_cnn", method=method) is not None
    (job,) = s.handler.jobs
    assert (job.method, job.model, job.request_message) == (job_method, "keras_cnn", b"keras_cnn")
    assert s.handler.remembered == [("keras_cnn", job_method, b"keras_cnn")]
    ((_, (span,)),) = s.handler.spans
    assert span.kind == method  # the proxy span names the call as it was made
    assert s.sample("xsp_sampling_decisions_total", "keras_cnn", decision="sampled") == 1


def test_every_replayable_request_counts_under_exactly_one_decision() -> None:
    s = Setup(budget_per_minute=2, duty_cycle=1.0)
    for _ in range(6):
        s.request()
    assert s.decisions() == {"sampled": 2, "skipped_budget": 4}
    s.sampler.update(s.sampler.settings.updated(rate=0.0))
    s.request()
    s.request(headers=((b"x-xsp-profile", b"1"),))  # forced: the budget still applies
    assert s.decisions() == {"sampled": 3, "skipped_budget": 4, "skipped_rate": 1}
    assert len(s.handler.jobs) == 3


def test_a_closed_duty_cycle_gate_skips_before_the_body_is_copied() -> None:
    s = Setup(duty_cycle=0.5)
    assert s.request() is not None  # sampled: the worker is busy with it
    assert s.request() is None  # gated at the headers: no traceparent, no body
    assert s.decisions() == {"sampled": 1, "skipped_duty_cycle": 1}
    s.sampler.duty.record_busy(1.0)  # done after 1 s: closed for another second
    s.clock.now += 1.0
    assert s.request() is not None


def test_a_failing_store_skips_new_samples() -> None:
    s = Setup()
    s.sampler.store.failed()
    assert s.request() is None
    assert s.decisions() == {"skipped_store_failing": 1}
    s.clock.now += 1.0  # the back-off is over
    assert s.request() is not None


def test_a_full_queue_drops_the_sample_and_frees_the_worker_slot() -> None:
    s = Setup(duty_cycle=0.5)
    s.handler.queue_full = True
    traceparent = s.request()
    assert traceparent is not None
    assert s.dropped("queue_full") == 1 and s.decisions() == {"sampled": 1}
    trace_id = TRACEPARENT.fullmatch(traceparent).group(1)  # type: ignore[union-attr]
    assert not s.hub.is_sampled_trace(trace_id)
    assert s.handler.remembered == [] and s.handler.spans == []  # nothing to hang a span under
    s.handler.queue_full = False
    assert s.request() is not None and len(s.handler.jobs) == 1  # the gate was not left closed


@pytest.mark.parametrize(
    ("model", "body"),
    [
        ("m", framed(b"m", compressed=True)),
        ("m", framed(b"mmmm")[:-1]),  # truncated
        ("m", b"\x00\x00"),
        (None, framed(b"")),  # the relay could not read a model name
    ],
)
def test_unreadable_requests_are_dropped(model: str | None, body: bytes) -> None:
    s = Setup(duty_cycle=0.5)
    assert s.request(model, body=body) is not None
    label = model or "_unknown"
    assert s.dropped("unreadable_request", label) == 1
    assert s.sample("xsp_sampling_decisions_total", label, decision="sampled") == 1
    assert s.handler.jobs == [] and s.handler.spans == []
    assert s.request() is not None  # the worker slot was given back


def test_models_the_repository_does_not_have_are_dropped() -> None:
    s = Setup(known={"resnet"}, duty_cycle=0.5)
    assert s.request("typo") is not None
    assert s.dropped("unknown_model", "typo") == 1
    assert s.handler.jobs == [] and s.handler.remembered == []
    s.request("resnet")
    assert [job.model for job in s.handler.jobs] == ["resnet"]


def test_a_body_that_never_arrives_is_dropped_and_counted_once() -> None:
    s = Setup()
    assert s.request(send_body=False) is not None  # e.g. cancelled, or over the capture limit
    assert s.dropped("body_unavailable") == 1
    assert s.decisions() == {"sampled": 1}
    assert s.handler.jobs == [] and s.handler.spans == []


def test_a_failing_span_store_is_counted_not_raised() -> None:
    s = Setup()
    s.handler.store_broken = True
    assert s.request() is not None  # on_stream_end did not raise into the relay
    assert len(s.handler.jobs) == 1
    assert s.registry.get_sample_value("xsp_trace_store_write_failures_total") == 1


def test_the_set_of_sampled_traces_is_bounded_and_forgettable() -> None:
    s = Setup()
    for i in range(10_002):
        s.hub.mark_sampled(f"{i:032x}")
    assert len(s.hub.sampled_trace_ids) <= 10_001
    s.hub.forget_trace(f"{10_001:032x}")
    assert not s.hub.is_sampled_trace(f"{10_001:032x}")


def test_observers_of_different_connections_share_the_hub() -> None:
    s = Setup()
    other = s.hub.observer_factory(ConnectionInfo(2, "127.0.0.1:6"))
    assert isinstance(other, SamplingObserver) and other is not s.observer
    s.request()
    assert len(s.handler.jobs) == 1 and s.hub.is_sampled_trace(s.handler.jobs[0].trace_id)


def test_first_message() -> None:
    assert first_message(framed(b"abc") + framed(b"second")) == b"abc"
    assert first_message(framed(b"")) == b""
    assert first_message(framed(b"abc", compressed=True)) is None
    assert first_message(framed(b"abc")[:-1]) is None
    assert first_message(b"") is None


def test_every_request_is_counted_for_the_workers_view_of_serving_pressure() -> None:
    setup = Setup(rate=0.0)
    start = RequestStart(1, 99, INFER, "ModelInfer", [(b":path", INFER.encode())])
    setup.observer.on_request_headers(start)
    assert setup.hub.pressure.snapshot() == (1, 0)  # in flight
    setup.observer.on_stream_end(_end(99, "ModelInfer", "m"))
    setup.request(method="ServerLive")  # not replayable, still serving work
    setup.request()
    assert setup.hub.pressure.snapshot() == (3, 3)


def test_the_request_span_carries_the_relays_marks_on_its_clock() -> None:
    start = 1_700_000_000_000_000_000
    end = StreamEnd(1, 1, INFER, "ModelInfer", "m", "OK", "", start, 0.004, 20, 30,
                    request_end_s=0.0005, response_start_s=0.003)  # fmt: skip
    assert relay_marks(end) == {
        "relay_request_start_ns": start,
        "relay_request_end_ns": start + 500_000,
        "relay_response_start_ns": start + 3_000_000,
        "relay_response_end_ns": start + 4_000_000,
    }
    cut = StreamEnd(1, 1, INFER, "ModelInfer", "m", "CANCELLED", "", start, 0.004, 20, 0,
                    request_end_s=0.0005)  # fmt: skip
    assert "relay_response_start_ns" not in relay_marks(cut)
    s = Setup()
    s.request("resnet")
    ((_, (span,)),) = s.handler.spans
    assert span.attributes["relay_request_start_ns"] == span.start_ns
    assert span.attributes["relay_response_end_ns"] == span.end_ns


@pytest.mark.parametrize("cached_models", [1024, 2])
def test_requests_not_picked_count_under_their_models_label(
    monkeypatch: pytest.MonkeyPatch, cached_models: int
) -> None:
    """The hook keeps each model name's label and `skipped_rate` counter; past its cap of
    names it looks them up each time, and every request still counts once under its label."""
    monkeypatch.setattr("sidecar.sampling.observer._CACHED_MODELS", cached_models)
    s = Setup(rate=0.0)
    for _ in range(3):
        for model in ("a", "b", None, "c"):
            assert s.request(model) is None
    counts = {m: s.sample("xsp_sampling_decisions_total", m, decision="skipped_rate")
              for m in ("a", "b", "_unknown", "c")}  # fmt: skip
    assert counts == {"a": 3, "b": 3, "_unknown": 3, "c": 3}
    assert s.decisions() == {}  # model "m" saw none


def test_settings_changed_at_run_time_reach_the_header_step() -> None:
    """The header step reads the rate and the force header worked out once per settings."""
    s = Setup(rate=0.0, force_header="x-a")
    assert s.request(headers=((b"x-b", b"1"),)) is None
    s.sampler.update(s.sampler.settings.updated(force_header="x-b"))
    assert s.request(headers=((b"x-a", b"1"),)) is None
    assert s.request(headers=((b"x-b", b"1"),)) is not None
    s.sampler.update(s.sampler.settings.updated(model_rates={"other": 1.0}))
    assert s.request("other") is not None  # the highest rate is the coin at the headers
    assert [job.reason for job in s.handler.jobs] == ["forced", "rate"]


def test_requests_the_hook_wants_nothing_more_of_end_without_a_call() -> None:
    """An unpicked request (sample_slow off) and a method never replayed are answered with a
    `QuietEnd`: the relay counts their ends in the pressure's end count, the unpicked one also
    as `skipped_rate` under its model's label; a picked one keeps its end call."""
    s = Setup(rate=0.0)
    counts = s.hub.pressure.counts
    unpicked = s.observer.on_request_headers(RequestStart(1, 1, INFER, "ModelInfer", []))
    assert isinstance(unpicked, QuietEnd)
    assert (unpicked.ended, unpicked.index) == (counts, 1)
    assert unpicked.per_model is s.hub.metrics.decisions.skipped
    other = s.observer.on_request_headers(RequestStart(1, 3, INFER, "ModelMetadata", []))
    assert isinstance(other, QuietEnd) and other.per_model is None
    assert (other.ended, other.index) == (counts, 1)
    forced = (DEFAULT_FORCE_HEADER.encode(), b"1")
    picked = s.observer.on_request_headers(RequestStart(1, 5, INFER, "ModelInfer", [forced]))
    assert not isinstance(picked, QuietEnd) and picked is not None
