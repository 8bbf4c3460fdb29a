"""The sampling hook through the relay's real tracker and frame walk: requests it does not pick
are decided by the C walk once their header blocks are cached (`QuickDecisions`), with the
hook's own rules, counters and coin. Real HPACK-encoded connections, a real `SamplingHub` and
`Sampler` (its coin seeded where a test counts picks), real `SamplingMetrics` on a fresh
registry; the worker queue and the trace writer are the in-memory `SampleHandler`."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.proxy import frames, streams
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionTracker, RequestStart
from sidecar.sampling.metrics import SamplingMetrics
from sidecar.sampling.observer import SamplingHub
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import DEFAULT_FORCE_HEADER, SamplingSettings
from tests.proxy.proxy_h2build import Conversation
from tests.proxy.test_framewalk import Recorder
from tests.sampling.test_observer import CONNECTION, InMemoryHandler

INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL = "add_sub"

native = pytest.mark.skipif(
    frames.native_walk is None or streams._NativeStream is None,
    reason="the C frame walker is not built here",
)


class PickHandler(InMemoryHandler):
    """The in-memory handler, also keeping the stream id of every request picked."""

    def __init__(self) -> None:
        super().__init__()
        self.picked_ids: list[int] = []

    def on_sampled(self, start: RequestStart, trace_id: str, span_id: str) -> None:
        super().on_sampled(start, trace_id, span_id)
        self.picked_ids.append(start.stream_id)


def model_infer(model: str) -> bytes:
    """A ModelInfer request message naming `model` (field 1), with a little payload after it."""
    name = model.encode()
    return b"\x0a" + bytes([len(name)]) + name + b"\x22\x04" + b"\1" * 4


class Relay:
    """One relayed connection as the relay scans it with sampling on: a real tracker and the
    hub's hook; the client's direction in hold mode. `sent` records the request direction's
    calls into Python (its sink)."""

    def __init__(self, settings: SamplingSettings, rand: Any = random.random) -> None:
        self.sampler = Sampler(settings, rand=rand)
        self.registry = CollectorRegistry()
        self.handler = PickHandler()
        self.hub = SamplingHub(self.sampler, SamplingMetrics(self.registry), self.handler)
        self.tracker = ConnectionTracker(
            ProxyMetrics(self.registry), observer=self.hub.observer_factory(CONNECTION)
        )
        self.conv = Conversation()
        self.forwarded = bytearray()
        self.sid = -1
        self._send()
        self.sent = Recorder(self.tracker.request)
        self.tracker.request_scanner.sink = self.sent

    def _send(self) -> None:
        chunk, server = bytes(self.conv.client), bytes(self.conv.server)
        del self.conv.client[:], self.conv.server[:]
        self.forwarded += b"".join(self.tracker.request_scanner.process(chunk))
        self.tracker.response_scanner.observe(server)

    def call(self, metadata: list[tuple[str, str]] | None = None) -> int:
        """One unary call, request then response, each one chunk; its stream id."""
        self.sid += 2
        self.conv.request(self.sid, INFER, model_infer(MODEL), metadata=metadata)
        self.conv.response(self.sid, b"\x0a\x03out")
        self._send()
        return self.sid

    def blocks_sent(self) -> list[int]:
        """Stream ids of the request header blocks handed to Python."""
        return [c[1] for c in self.sent.calls if c[0] == "on_header_block"]

    def skipped(self) -> float:
        labels = {"model": MODEL, "decision": "skipped_rate"}
        return self.registry.get_sample_value("xsp_sampling_decisions_total", labels) or 0.0


@native
def test_an_unpicked_call_crosses_into_python_zero_times_once_its_blocks_are_cached() -> None:
    """Sampling on, nothing picked: the first two calls' request blocks go to Python (the
    first fills the HPACK table, the second is cached), every later one is decided in C. Its
    ends are counted as the hook's `QuietEnd` says; the bytes are forwarded unchanged."""
    relay = Relay(SamplingSettings(rate=0.0))
    start = bytes(relay.forwarded)
    sids = [relay.call() for _ in range(5)]
    assert relay.blocks_sent() == sids[:2]
    assert relay.sent.calls == [c for c in relay.sent.calls if c[1] in sids[:2]]
    assert bytes(relay.forwarded[len(start) :]).count(b"traceparent") == 0
    assert list(relay.hub.pressure.counts) == [5, 5]
    assert relay.skipped() == 5
    assert not relay.tracker.streams and not relay.tracker.quiet_ends
    labels = {"method": "ModelInfer", "model": MODEL, "grpc_code": "OK", "protocol": "grpc"}
    assert relay.registry.get_sample_value("xsp_requests_total", labels) == 5


@native
def test_a_force_header_in_a_cached_block_still_reaches_the_hook() -> None:
    """The walk leaves a block with the force header to the hook (the value decides): every
    forced request is sampled, at rate 0, cached or not."""
    relay = Relay(SamplingSettings(rate=0.0, budget_per_minute=1000.0, duty_cycle=1.0))
    forced = [(DEFAULT_FORCE_HEADER, "1")]
    sids = [relay.call(forced) for _ in range(4)]
    assert relay.blocks_sent() == sids
    assert relay.handler.picked_ids == sids
    assert [job.reason for job in relay.handler.jobs] == ["forced"] * 4
    assert list(relay.hub.pressure.counts) == [4, 4]


@native
def test_settings_changed_mid_connection_reach_the_walks_coin() -> None:
    """The walk reads the sampler's settings at each request: a rate raised to 1 picks the
    next cached request, sampling switched off picks none again."""
    relay = Relay(SamplingSettings(rate=0.0, budget_per_minute=1000.0, duty_cycle=1.0))
    quiet = [relay.call() for _ in range(3)]
    relay.sampler.update(relay.sampler.settings.updated(rate=1.0))
    picked = relay.call()
    relay.sampler.update(relay.sampler.settings.updated(enabled=False))
    later = relay.call()
    assert relay.handler.picked_ids == [picked]
    assert relay.blocks_sent() == [*quiet[:2], picked]
    assert later not in relay.blocks_sent()
    assert relay.skipped() == 4


@native
def test_with_sample_slow_on_every_request_goes_to_the_hook() -> None:
    """An unpicked request may be held for its duration: the relay decides none itself."""
    relay = Relay(SamplingSettings(rate=0.0, slow="p99"))
    assert relay.tracker.quick is None
    sids = [relay.call() for _ in range(4)]
    assert relay.blocks_sent() == sids


@pytest.mark.parametrize("walker", ["c", "python"])
def test_the_rate_holds_and_the_same_draws_pick_the_same_requests(walker: str) -> None:
    """10,000 calls at rate 0.05 with a seeded coin: the walk's coin (C) and the hook's
    (pure Python, the reference) pick the same calls, as many as the rate says (500 expected,
    within five standard deviations: 391 to 609; a second draw per picked request would pick
    about 25, a lost pick none): exactly the calls whose draw, one per call in order, came
    out under the rate."""
    if walker == "c" and frames.native_walk is None:
        pytest.skip("the C frame walker is not built here")
    settings = SamplingSettings(rate=0.05, budget_per_minute=1e6, duty_cycle=1.0)
    runs = []
    for native_walk in (frames.native_walk if walker == "c" else None, None):
        saved = frames.native_walk
        frames.native_walk = native_walk
        try:
            relay = Relay(settings, rand=random.Random(2024).random)
            for _ in range(10_000):
                relay.call()
        finally:
            frames.native_walk = saved
        runs.append(relay)
    picked = runs[0].handler.picked_ids
    assert picked == runs[1].handler.picked_ids
    n, p = 10_000, 0.05
    assert abs(len(picked) - n * p) < 5 * (n * p * (1 - p)) ** 0.5
    coin = random.Random(2024).random
    assert picked == [2 * i + 1 for i in range(n) if coin() < p]
    assert runs[0].skipped() == runs[1].skipped() == n - len(picked)
    assert list(runs[0].hub.pressure.counts) == [n, n]
    if walker == "c":  # the cached unpicked requests never reached Python
        assert len(runs[0].blocks_sent()) == 2 + len([s for s in picked if s > 3])
