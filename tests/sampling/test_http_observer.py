"""The sampling hook of the HTTP relay (`SamplingHub.http_observer_factory`), driven with the
records the relay makes (I3: `RequestStart` with `:method`/`:path` and lowercased header
names, the whole de-chunked body, `StreamEnd`), over the in-memory handler of
`test_observer`. It decides as the gRPC hook does (rate, budget, duty cycle, forced header,
`sample_slow`) on the backend's `http_replayable` calls, with the same counters; a picked
request's job message is its body packed for its decoder (`http_message`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sidecar.backends import TF_SERVING, TRITON
from sidecar.backends.http_message import unpack
from sidecar.proxy.streams import ConnectionInfo, HeaderDecision, QuietEnd, RequestStart, StreamEnd
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import (
    MAX_SAMPLED_BODY,
    HttpPlane,
    HttpSamplingObserver,
    SamplingHub,
    SamplingObserver,
)
from sidecar.sampling.sampler import Sampler
from sidecar.trace import schema
from tests.sampling.test_observer import CONNECTION, TRACEPARENT, Setup

TARGET = "/v2/models/m/versions/2/infer?debug=1"
INPUT = {"name": "x", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
JSON = json.dumps({"inputs": [INPUT]}).encode()
BINARY = np.array([1.5, -2.0], dtype="<f4").tobytes()


class HttpSetup(Setup):
    """`Setup` with the HTTP relay's hook of one connection."""

    def __init__(self, *args: Any, slow: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if slow is not None:  # the hub again, on settings with `sample_slow`
            self.sampler = Sampler(self.sampler.settings.updated(slow=slow), clock=self.clock)
            self.registry = CollectorRegistry()
            self.hub = SamplingHub(
                self.sampler, SamplingMetrics(self.registry), self.handler,
                backend=kwargs.get("backend", TRITON),
            )  # fmt: skip
            self.observer = self.hub.observer_factory(CONNECTION)
        self.grpc_observer = self.observer
        self.observer = self.hub.http_observer_factory(CONNECTION)
        self._http_stream = 0

    def grpc(self, model: str = "m") -> str | None:
        """One gRPC call through the gRPC hook of the same hub (`Setup.request`)."""
        http, self.observer = self.observer, self.grpc_observer
        try:
            return self.request(model)
        finally:
            self.observer = http

    def call(
        self,
        model: str | None = "m",
        *,
        method: str = "ModelInfer",
        target: str = TARGET,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        body: bytes | None = JSON + BINARY,
        json_length: int | None = len(JSON),
        code: str = "OK",
        duration_s: float = 0.002,
    ) -> HeaderDecision | QuietEnd | None:
        """One request through the hook as the HTTP relay makes it; its decision."""
        self._http_stream += 1
        sid = self._http_stream
        raw = [(b":method", b"POST"), (b":path", target.encode()), (b"host", b"triton:8000")]
        if json_length is not None:
            raw.append((b"inference-header-content-length", str(json_length).encode()))
        raw.extend(headers)
        decision = self.observer.on_request_headers(RequestStart(1, sid, target, method, raw))
        if isinstance(decision, QuietEnd):
            decision.ended[decision.index] += 1
            if decision.per_model is not None:
                label = self.handler.model_label(model)
                decision.per_model[label] = decision.per_model.get(label, 0) + 1
            return decision
        if decision is not None and decision.capture_body and body is not None:
            self.observer.on_request_body(sid, model, body)
        sampled = decision is not None and decision.capture_body
        self.observer.on_stream_end(
            StreamEnd(
                1,
                sid,
                target,
                method,
                model,
                code,
                "",
                1_700_000_000_000_000_000,
                duration_s,
                len(body or b""),
                30,
                sampled,
            )
        )
        return decision


def test_the_http_hook_is_its_own_class_on_the_shared_hub() -> None:
    s = HttpSetup()
    assert type(s.observer) is HttpSamplingObserver
    assert type(s.grpc_observer) is SamplingObserver  # the gRPC hook is untouched
    assert s.observer.quick is s.hub.http.quick  # the HTTP relay answers unpicked requests
    plane = s.hub.http
    assert isinstance(plane, HttpPlane) and s.hub.http is plane  # made once
    assert plane.sampler is s.hub.sampler and plane.metrics is s.hub.metrics
    assert plane.pressure is s.hub.pressure and plane.held is s.hub.held
    assert plane.sampled_trace_ids is s.hub.sampled_trace_ids
    assert plane.replayable == {"ModelInfer": "HttpModelInfer"}


def test_a_sampled_request_is_marked_packed_queued_and_spanned() -> None:
    s = HttpSetup()
    decision = s.call("m")
    assert isinstance(decision, HeaderDecision)
    assert decision.capture_body and decision.capture_limit == MAX_SAMPLED_BODY
    ((name, traceparent),) = decision.extra_headers
    match = TRACEPARENT.fullmatch(traceparent)
    assert name == "traceparent" and match is not None
    trace_id, span_id = match.groups()
    (job,) = s.handler.jobs
    assert (job.trace_id, job.parent_span_id, job.model) == (trace_id, span_id, "m")
    assert (job.method, job.reason) == ("HttpModelInfer", "rate")
    assert unpack(job.request_message) == (JSON, BINARY, TARGET)
    decoded = TRITON.decoders[job.method](job.request_message)
    assert decoded.version == "2"
    np.testing.assert_array_equal(decoded.inputs["x"], [[1.5, -2.0]])
    assert s.handler.remembered == [("m", "HttpModelInfer", job.request_message)]
    assert s.handler.picked == [(TARGET, trace_id, span_id)]
    ((stored, (span,)),) = s.handler.spans
    assert stored == trace_id and span.kind == "ModelInfer"
    assert span.name == span.attributes[schema.PATH] == "/v2/models/m/versions/2/infer"
    assert span.attributes[schema.PROTOCOL] == "http"
    assert span.attributes[schema.GRPC_CODE] == "OK" and span.attributes[schema.MODEL] == "m"
    assert s.handler.exemplars == [("ModelInfer", "m", 0.002, trace_id)]
    assert s.decisions() == {"sampled": 1}
    assert s.hub.is_sampled_trace(trace_id)


def test_a_json_body_without_the_length_header_is_all_json() -> None:
    s = HttpSetup()
    body = b'{"inputs":[{"name":"x","shape":[2],"datatype":"INT32","data":[1,2]}]}'
    s.call(body=body, json_length=None, target="/v2/models/m/infer")
    (job,) = s.handler.jobs
    assert unpack(job.request_message) == (body, b"", "/v2/models/m/infer")


def test_a_compressed_body_is_packed_with_its_encoding() -> None:
    import gzip

    s = HttpSetup()
    s.call(body=gzip.compress(JSON + BINARY), headers=((b"content-encoding", b"gzip"),))
    (job,) = s.handler.jobs
    assert unpack(job.request_message) == (JSON, BINARY, TARGET)


@pytest.mark.parametrize(
    ("json_length", "headers"),
    [
        (len(JSON + BINARY) + 1, ()),  # longer than the body
        (None, ((b"inference-header-content-length", b"12x"),)),  # not a number
        (len(JSON), ((b"content-encoding", b"br"),)),  # an encoding no decoder undoes
    ],
)
def test_a_body_that_cannot_be_packed_is_dropped_as_unreadable(
    json_length: int | None, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    s = HttpSetup(duty_cycle=0.5)
    assert isinstance(s.call(json_length=json_length, headers=headers), HeaderDecision)
    assert s.dropped("unreadable_request") == 1 and s.handler.jobs == []
    assert isinstance(s.call(), HeaderDecision)  # its worker slot was given back
    assert len(s.handler.jobs) == 1


def test_a_route_naming_no_model_is_dropped_as_unreadable() -> None:
    s = HttpSetup()
    s.call(None)
    assert s.dropped("unreadable_request", "_unknown") == 1


def test_unpicked_and_unreplayable_requests_end_quietly() -> None:
    s = HttpSetup(rate=0.0)
    unpicked = s.call()
    assert isinstance(unpicked, QuietEnd) and unpicked is s.hub.quiet_unpicked
    assert s.call(method="ModelMetadata") is s.hub.quiet_not_replayable
    assert s.call(method="_unknown") is s.hub.quiet_not_replayable
    assert s.decisions() == {"skipped_rate": 1}
    assert s.hub.pressure.snapshot() == (3, 3)
    assert s.handler.jobs == [] and s.handler.picked == []


def test_the_force_header_samples_at_rate_zero() -> None:
    s = HttpSetup(rate=0.0)
    assert isinstance(s.call(headers=((b"x-xsp-profile", b"1"),)), HeaderDecision)
    assert isinstance(s.call(headers=((b"x-xsp-profile", b"0"),)), QuietEnd)
    assert [job.reason for job in s.handler.jobs] == ["forced"]


def test_both_protocols_share_one_budget_and_one_set_of_counters() -> None:
    s = HttpSetup(budget_per_minute=2.0)
    s.grpc("m")
    s.call("m")
    s.call("m")  # over the budget shared with the gRPC call
    assert [job.method for job in s.handler.jobs] == ["ModelInfer", "HttpModelInfer"]
    assert s.decisions() == {"sampled": 2, "skipped_budget": 1}


def test_a_closed_duty_cycle_gate_skips_before_the_body_is_copied() -> None:
    s = HttpSetup(duty_cycle=0.5)
    s.call()  # takes the worker
    assert s.call() is None  # gated: no body asked for, no traceparent
    assert s.decisions() == {"sampled": 1, "skipped_duty_cycle": 1}


def test_a_body_that_never_arrives_is_dropped_once() -> None:
    s = HttpSetup()
    s.call(body=None)  # e.g. over the capture limit, or the client went away
    assert s.dropped("body_unavailable") == 1 and s.handler.jobs == []


def test_tf_serving_rest_predict_is_replayed_from_its_json() -> None:
    s = HttpSetup(backend=TF_SERVING)
    body = json.dumps({"instances": [[1.0, 2.0]], "signature_name": "serving_default"}).encode()
    target = "/v1/models/half/labels/canary:predict"
    assert isinstance(s.call("half", method="Predict", target=target, body=body,
                             json_length=None), HeaderDecision)  # fmt: skip
    (job,) = s.handler.jobs
    assert job.method == "HttpPredict"
    decoded = TF_SERVING.decoders[job.method](job.request_message)
    assert decoded.attributes == {
        schema.SIGNATURE_NAME: "serving_default",
        schema.VERSION_LABEL: "canary",
    }
    assert s.call("half", method="GetModelStatus", target="/v1/models/half") is (
        s.hub.quiet_not_replayable
    )
    assert s.call("half", method="Classify", target="/v1/models/half:classify") is (
        s.hub.quiet_not_replayable
    )


def test_slow_http_responses_become_jobs_from_their_own_bodies() -> None:
    s = HttpSetup(rate=0.0, slow=100.0)
    fast = s.call(duration_s=0.01)
    assert isinstance(fast, HeaderDecision) and fast.capture_body
    assert not fast.extra_headers  # held for its duration: no traceparent
    assert s.handler.jobs == []
    s.call(duration_s=0.5)
    (job,) = s.handler.jobs
    assert (job.method, job.reason, job.traced) == ("HttpModelInfer", "slow", False)
    assert unpack(job.request_message) == (JSON, BINARY, TARGET)
    ((_, (span,)),) = s.handler.spans
    assert span.attributes[schema.PROTOCOL] == "http"
    s.call(duration_s=0.5, code="INVALID_ARGUMENT")  # an error is never slow
    assert len(s.handler.jobs) == 1


def test_a_grpc_request_span_still_says_grpc() -> None:
    s = HttpSetup()
    s.grpc("m")
    ((_, (span,)),) = s.handler.spans
    assert span.attributes[schema.PROTOCOL] == "grpc"
    assert span.attributes[schema.PATH] == "/inference.GRPCInferenceService/ModelInfer"


def test_connections_get_their_own_hooks() -> None:
    s = HttpSetup()
    other = s.hub.http_observer_factory(ConnectionInfo(2, "127.0.0.1:9"))
    assert isinstance(other, HttpSamplingObserver) and other is not s.observer


def _relay_through(quick: bool) -> tuple[list[bytes], HttpSetup]:
    """Requests through the HTTP relay's readers and book on one hook, with its `quick`
    answers or without (the hook decides every request), on the same coin draws."""
    import random
    import re

    from sidecar.proxy.http.calls import CallBook
    from sidecar.proxy.http.limits import HttpLimits
    from sidecar.proxy.http.request_reader import RequestReader
    from sidecar.proxy.http.response_reader import ResponseReader
    from sidecar.proxy.metrics import ProxyMetrics

    s = HttpSetup(rate=0.3)
    s.sampler.rand = random.Random(7).random
    if not quick:
        s.observer.quick = None
    book = CallBook(ProxyMetrics(CollectorRegistry()), s.observer, 1)
    requests, responses = RequestReader(HttpLimits(), book, TRITON), ResponseReader(book)
    body = JSON + BINARY
    infer = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\n" + (
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n" % (len(JSON), len(body))
    )
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    forwarded = []
    for i in range(300):
        head = infer + (b"X-Xsp-Profile: 1\r\n" if i % 37 == 0 else b"") + b"\r\n"
        chunks = [head + body] if i % 2 else [head, body]
        if i % 11 == 0:
            chunks = [b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"]
        for chunk in chunks:
            pieces = requests.feed(chunk)
            out = chunk if pieces is None else b"".join(pieces)
            forwarded.append(re.sub(rb"traceparent: [^\r]*", b"traceparent: (new ids)", out))
        responses.feed(answer)
    assert not book.open
    return forwarded, s


def test_the_relays_quick_answers_are_the_hooks_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpicked or not replayable request the relay answers itself (`quick`) ends counted
    as the hook would count it; the picked and forced ones still reach the hook."""
    asked = []
    hook = HttpSamplingObserver.on_request_headers

    def counting(self: HttpSamplingObserver, start: RequestStart) -> Any:
        asked.append(start.stream_id)
        return hook(self, start)

    monkeypatch.setattr(HttpSamplingObserver, "on_request_headers", counting)
    fast, quick = _relay_through(True)
    asked_quick, asked[:] = len(asked), []
    slow, hooked = _relay_through(False)
    assert len(asked) == 300 and 10 < asked_quick < 150  # the picked and forced ones
    assert fast == slow  # the same requests picked (traceparent added to the same ones)
    assert sum(b"traceparent" in f for f in fast) > 10
    assert list(quick.hub.pressure.counts) == list(hooked.hub.pressure.counts)
    assert quick.handler.picked and len(quick.handler.picked) == len(hooked.handler.picked)
    assert len(quick.handler.jobs) == len(hooked.handler.jobs)

    def counted(s: HttpSetup) -> dict[str, float]:
        return {
            f"{m.name}{sorted(x.labels.items())}": x.value
            for m in s.registry.collect() for x in m.samples
            if not x.name.endswith("_created")
        }  # fmt: skip

    assert counted(quick) == counted(hooked)
