"""Sampling a `ModelStreamInfer` stream message by message: the real relay-side pending table
(`StreamInferences`, real `ProxyMetrics`) fed real Triton messages built with `service_pb2`,
in the byte chunks the relay hands it, with the real hub and `Sampler` (manual clock) of
`test_observer.py` and its in-memory `SampleHandler`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2

from sidecar.proxy.inferences import MAX_GAPS, StreamInferences
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import RequestStart
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.trace.spans import Level, Source, Span
from tests.proxy.proxy_h2build import grpc_message
from tests.sampling.test_observer import CONNECTION, Setup

METHOD = "ModelStreamInfer"
PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


def message(model: str, ident: str = "", payload: bytes = b"\0\0\0\0", **params: int) -> bytes:
    """A `ModelInferRequest` as serialized (no gRPC prefix)."""
    req = service_pb2.ModelInferRequest(model_name=model, id=ident)
    req.inputs.add(name="INPUT0", datatype="UINT8", shape=[len(payload)])
    req.raw_input_contents.append(payload)
    for key, value in params.items():
        req.parameters[key].int64_param = value
    return bytes(req.SerializeToString())


def response(model: str, ident: str = "", final: bool | None = None, error: str = "") -> bytes:
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    resp.infer_response.model_name = model
    resp.infer_response.id = ident
    if final is not None:
        resp.infer_response.parameters["triton_final_response"].bool_param = final
    if not error:
        resp.infer_response.outputs.add(name="OUT", datatype="INT32", shape=[1])
        resp.infer_response.raw_output_contents.append(b"\1\0\0\0")
    return grpc_message(resp.SerializeToString())


class StreamSetup(Setup):
    """`Setup`'s hub, and one stream through the real pending table with its sampling hook."""

    def __init__(self, *, rand: Iterator[float] | None = None, **kwargs: float) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if rand is not None:  # a scripted coin
            self.sampler = Sampler(self.sampler.settings, clock=self.clock, rand=rand.__next__)
            self.hub = SamplingHub(self.sampler, self.hub.metrics, self.handler)
            self.observer = self.hub.observer_factory(CONNECTION)
        self.proxy_registry = CollectorRegistry()
        self.inferences = StreamInferences(ProxyMetrics(self.proxy_registry), METHOD)
        start = RequestStart(1, 1, PATH, METHOD, [(b":path", PATH.encode())])
        decision = self.observer.on_request_headers(start)
        assert decision is not None and decision.messages is not None
        assert not decision.capture_body and not decision.extra_headers  # no traceparent
        self.sampling = decision.messages
        self.inferences.sample_with(self.sampling)

    def send(self, *messages: bytes, chunk: int = 0) -> None:
        data = b"".join(grpc_message(m) for m in messages)
        step = chunk or len(data)
        for pos in range(0, len(data), step):
            self.inferences.request_data(data[pos : pos + step])

    def spans(self) -> list[Span]:
        return [span for _, spans in self.handler.spans for span in spans]


def test_every_message_is_decided_on_and_each_sampled_one_is_its_own_modelinfer_job() -> None:
    s = StreamSetup()
    sent = [message("a", payload=bytes([n]) * 8) for n in range(3)] + [message("b")]
    s.send(*sent)
    assert [(j.method, j.model, j.request_message, j.reason) for j in s.handler.jobs] == [
        ("ModelInfer", "a", sent[0], "rate"),
        ("ModelInfer", "a", sent[1], "rate"),
        ("ModelInfer", "a", sent[2], "rate"),
        ("ModelInfer", "b", sent[3], "rate"),
    ]
    assert s.sample("xsp_sampling_decisions_total", "a", decision="sampled") == 3
    assert s.sample("xsp_sampling_decisions_total", "b", decision="sampled") == 1
    assert [r[:2] for r in s.handler.remembered] == [("a", "ModelInfer")] * 3 + [
        ("b", "ModelInfer")
    ]
    assert len({j.trace_id for j in s.handler.jobs}) == 4
    assert s.handler.spans == []  # no span before the inference ends


def test_a_mid_stream_message_is_sampled_alone() -> None:
    coin = iter([0.9, 0.1, 0.9])  # rate 0.5: only the second message's flip comes up
    s = StreamSetup(rate=0.5, rand=coin)
    sent = [message("m", ident=str(n)) for n in range(3)]
    s.send(*sent)
    (job,) = s.handler.jobs
    assert job.request_message == sent[1]
    assert s.decisions() == {"sampled": 1, "skipped_rate": 2}
    for n in range(3):
        s.inferences.response_data(response("m", str(n)))
    ((trace_id, (span,)),) = s.handler.spans
    assert trace_id == job.trace_id and span.span_id == job.parent_span_id


def test_a_sampled_inference_is_the_request_span_with_its_responses() -> None:
    s = StreamSetup()
    s.send(message("tok", ident="x"))
    (job,) = s.handler.jobs
    for _ in range(4):
        s.inferences.response_data(response("tok", "x", final=False))
    s.inferences.response_data(response("tok", "x", final=True))
    (span,) = s.spans()
    assert (span.level, span.source, span.kind, span.name) == (
        Level.REQUEST,
        Source.PROXY,
        METHOD,
        PATH,
    )
    attrs = span.attributes
    assert attrs["model"] == "tok" and attrs["grpc_code"] == "OK" and attrs["stream_message"]
    assert attrs["responses"] == 5 and len(attrs["response_gaps_ns"]) == 4
    first, last = attrs["first_response_ns"], attrs["last_response_ns"]
    assert span.start_ns <= first <= last == span.end_ns
    assert attrs["relay_response_start_ns"] == first
    gaps = attrs["response_gaps_ns"]
    assert all(g >= 0 for g in gaps) and abs(sum(gaps) - (last - first)) <= len(gaps) + 2
    assert attrs["response_bytes"] == 5 * len(response("tok", "x", final=False))
    ((method, model, duration, trace_id),) = s.handler.exemplars
    assert (method, model, trace_id) == (METHOD, "tok", job.trace_id)
    assert duration == pytest.approx((span.end_ns - span.start_ns) / 1e9, abs=1e-6)


def test_an_error_response_is_the_span_status_and_gaps_are_bounded() -> None:
    s = StreamSetup()
    s.send(message("m", ident="e"), message("m", ident="g"))
    s.inferences.response_data(response("m", "e", error="bad input"))
    for _ in range(MAX_GAPS + 10):
        s.inferences.response_data(response("m", "g", final=False))
    s.inferences.close("OK", 1.0)  # the last inference's end is its stream's
    errored, long = s.spans()
    assert (errored.attributes["grpc_code"], errored.attributes["grpc_message"]) == (
        "UNKNOWN",
        "bad input",
    )
    assert long.attributes["responses"] == MAX_GAPS + 10
    assert len(long.attributes["response_gaps_ns"]) == MAX_GAPS


def test_a_large_message_split_over_chunks_is_kept_whole() -> None:
    s = StreamSetup()
    big = message("m", payload=bytes(range(256)) * 64)  # 16 KiB: beyond the 4 KiB head
    s.send(message("m"), big, chunk=1000)
    assert [j.request_message for j in s.handler.jobs] == [message("m"), big]


def test_a_message_over_the_capture_limit_is_dropped_and_counted() -> None:
    s = StreamSetup()
    s.inferences.requests.capture_limit = 100
    s.send(message("m", payload=bytes(200)), chunk=64)
    assert s.handler.jobs == []
    assert s.decisions() == {"sampled": 1}
    assert s.sample("xsp_samples_dropped_total", reason="body_unavailable") == 1


@pytest.mark.parametrize("params", [{"sequence_id": 7}, {"sequence_start": 1}, {"sequence_end": 1}])
def test_a_sequence_request_is_refused_for_replay(params: dict[str, int]) -> None:
    s = StreamSetup()
    s.send(message("m", **params), message("m"))
    (job,) = s.handler.jobs  # only the stateless one
    assert job.request_message == message("m")
    assert s.sample("xsp_samples_dropped_total", reason="sequence_model") == 1


def test_a_stateful_model_is_refused_for_replay() -> None:
    s = StreamSetup()
    s.handler.sequence.add("stateful")
    s.send(message("stateful"), message("m"))
    assert [j.model for j in s.handler.jobs] == ["m"]
    assert s.sample("xsp_samples_dropped_total", "stateful", reason="sequence_model") == 1


def test_budget_and_unknown_models_apply_per_message() -> None:
    s = StreamSetup(budget_per_minute=2)
    s.handler.known = {"m"}
    s.send(*(message("m") for _ in range(5)), message("gone"))
    assert s.decisions() == {"sampled": 2, "skipped_budget": 3}
    assert s.sample("xsp_samples_dropped_total", "gone", reason="unknown_model") == 1
    assert len(s.handler.jobs) == 2


def test_a_closed_duty_cycle_skips_messages_without_copying_them() -> None:
    s = StreamSetup(duty_cycle=0.5)
    s.send(message("m"), message("m"))  # the first is sampled: the worker is busy
    assert s.decisions() == {"sampled": 1, "skipped_duty_cycle": 1}
    assert len(s.handler.jobs) == 1


def test_a_failing_hook_is_counted_never_raised() -> None:
    s = StreamSetup()
    s.handler.store_broken = True
    s.send(message("m"))
    s.inferences.response_data(response("m"))  # the span cannot be handed over
    assert s.inferences.metrics.observer_errors["stream_message"] == 1
    assert (
        s.proxy_registry.get_sample_value(
            "xsp_requests_total",
            {"method": METHOD, "model": "m", "grpc_code": "OK", "protocol": "grpc"},
        )
        == 1
    )


@pytest.mark.parametrize(("rate", "copied"), [(0.0, False), (1.0, True)])
def test_only_a_picked_message_is_copied(rate: float, copied: bool) -> None:
    s = StreamSetup(rate=rate)
    big = grpc_message(message("m", payload=bytes(10_000)))
    s.inferences.request_data(big[:3000])  # mid-message: the coin has been flipped
    assert s.inferences.requests.copying is copied
    s.inferences.request_data(big[3000:])
    assert len(s.handler.jobs) == int(copied)


def test_a_message_picked_while_the_duty_cycle_is_closed_is_not_copied() -> None:
    s = StreamSetup(duty_cycle=0.5)
    s.send(message("m"))  # sampled: the worker is busy, the gate closed
    big = grpc_message(message("m", payload=bytes(10_000)))
    s.inferences.request_data(big[:3000])
    assert not s.inferences.requests.copying  # the coin came up, the gate said no
    s.inferences.request_data(big[3000:])
    assert s.decisions() == {"sampled": 1, "skipped_duty_cycle": 1}


def test_a_message_of_a_model_no_replay_can_run_is_kept_live_only() -> None:
    s = StreamSetup()
    s.handler.not_replayable["ens"] = "ensembles"
    s.send(message("ens", "1"), message("m", "2"))
    assert [j.model for j in s.handler.jobs] == ["m"]
    ((job, replay),) = s.handler.live
    assert (job.model, job.method, job.reason, replay) == (
        "ens", "ModelInfer", "rate", "not_replayable: ensembles",
    )  # fmt: skip
    s.inferences.response_data(response("ens", "1"))
    (span,) = [sp for sp in s.spans() if sp.trace_id == job.trace_id]
    assert span.span_id == job.parent_span_id and span.attributes["stream_message"] is True
