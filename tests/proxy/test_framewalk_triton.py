"""Acceptance: with sampling on (the request direction in hold mode), the relay in front of
the REAL Triton 2.51 gives the same /metrics and stores the same request spans whether the C
frame walker runs (`sidecar/proxy/_framewalk.c`) or the pure-Python scanner alone does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from sidecar.proxy import frames
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.metrics_text import SampleKey, sample_map, scrape
from tests.harness.triton.server import TritonServer
from tests.proxy.proxy_harness import SidecarThread

pytestmark = pytest.mark.triton
FORCED = 3  # requests sent with the force header (the sampling rate is 0: nothing else)
# what the replay measured (its timings), not what the relay saw
REPLAY_MEASURED = ("xsp_profiled_latency_seconds", "xsp_layer_type_time_share",
                   "xsp_profiling_overhead_ratio")  # fmt: skip
# the keys of the relay's marks and the server batch window read around them: times
TIMED_ATTRIBUTES = ("relay_", "server_batch_window")


def add_sub(client: grpcclient.InferenceServerClient, n: int) -> None:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        x = grpcclient.InferInput(name, [n], "FP32")
        x.set_data_from_numpy(np.arange(n, dtype=np.float32))
        inputs.append(x)
    client.infer("add_sub", inputs)


def untimed(text: str) -> dict[SampleKey, float]:
    """Every sample whose value does not depend on how long something took."""
    return {
        key: value
        for key, value in sample_map(text).items()
        if not key[0].endswith(("_created", "_sum", "_bucket"))
        and not key[0].startswith(REPLAY_MEASURED)
    }


def settled(url: str) -> dict[SampleKey, float] | None:
    """The scrape's untimed samples once every profile is done and the client is gone."""
    now = untimed(scrape(url))
    profiles = sum(v for (name, _), v in now.items() if name == "xsp_profiles_total")
    done = profiles == FORCED and now[("xsp_connections_active", ())] == 0
    return now if done else None


def relay_traffic(triton: TritonServer, db: Path) -> tuple[str, dict[SampleKey, float]]:
    """Small and 96 KB unary calls, some forced to be sampled; the /metrics text once settled."""
    side = SidecarThread(
        triton.grpc_address, model_repository=triton.model_repository, db=db, otlp_port=0,
        sample_rate=0.0, sample_budget=100.0, duty_cycle=1.0, iterations=1, warmup=0,
    )  # fmt: skip
    try:
        client = grpcclient.InferenceServerClient(side.address)
        for i in range(12):
            add_sub(client, 16 if i % 3 else 12_000)  # 96 KB: several DATA frames and chunks
            forced = {"x-xsp-profile": "1"} if i % 4 == 1 else None
            cnn_infer(client, batch=1 + i % 2, headers=forced)
        client.close()
        assert wait_until(lambda: settled(side.metrics_url) is not None, 120)
        text = scrape(side.metrics_url)
        again = settled(side.metrics_url)
        assert again is not None
    finally:
        side.close()
    return text, again


def paths_and_rest(
    samples: dict[SampleKey, float],
) -> tuple[dict[str, str], dict[SampleKey, float]]:
    """`xsp_relay_native_info`'s labels (which paths ran: the one series that differs), and
    every other sample."""
    [labels] = [dict(key[1]) for key in samples if key[0] == "xsp_relay_native_info"]
    return labels, {key: v for key, v in samples.items() if key[0] != "xsp_relay_native_info"}


def request_spans(db: Path) -> list[tuple[Any, ...]]:
    """The relay's spans of the sampled requests, in order, without their times and ids."""
    store = TraceStore(db)
    spans = [s for t in store.list_traces() for s in store.spans(t.trace_id, Level.REQUEST)]
    spans.sort(key=lambda s: s.start_ns)
    return [
        (
            s.name,
            s.kind,
            s.source,
            s.parent_id,
            sorted(s.attributes),
            {k: v for k, v in s.attributes.items() if not k.startswith(TIMED_ATTRIBUTES)},
        )
        for s in spans
    ]


def test_metrics_and_request_spans_are_the_same_with_the_walker_on_and_off(
    triton: TritonServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walk = frames.native_walk
    if walk is None:
        pytest.skip("the C frame walker is not built here")
    held: list[int] = []  # chunks the C walk took in hold mode

    def counting(sink: Any, data: bytes, start: int, hold: Any, *table: Any) -> int:
        held.extend([len(data)] if hold is not None else [])
        return walk(sink, data, start, hold, *table)

    monkeypatch.setattr(frames, "native_walk", counting)
    on_text, on = relay_traffic(triton, tmp_path / "on.db")
    assert len(held) >= 20  # about one chunk per call: the request direction went through C
    monkeypatch.setattr(frames, "native_walk", None)  # the fallback without a compiler
    off_text, off = relay_traffic(triton, tmp_path / "off.db")
    paths_on, on_text_rest = paths_and_rest(sample_map(on_text))
    paths_off, off_text_rest = paths_and_rest(sample_map(off_text))
    paths = {"walk": "on", "pump": "on", "message_walk": "on", "http_pump": "on", "switch": "on"}
    assert paths_on == paths
    assert paths_off == {**paths_on, "walk": "off", "pump": "off"}
    assert set(on_text_rest) == set(off_text_rest)  # every series, timed too
    assert paths_and_rest(on)[1] == paths_and_rest(off)[1]
    assert on[("xsp_sampled_total", (("model", "simple_cnn"), ("reason", "forced")))] == FORCED
    spans = request_spans(tmp_path / "on.db")
    assert len(spans) == FORCED
    assert spans == request_spans(tmp_path / "off.db")
