"""The one kernel-to-layer attribution (`gpu/attribution.py`, whose docstring states the rule)
on the real H100 recordings, and its rule for which launch wins.

The recordings hold no correlation id with two API calls (CUPTI 13 gives the driver calls a
runtime call makes ids of their own), so the launch rule is checked on CONSTRUCTED calls
added to a real recorded forward, named as such below.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.gpu.attribution import attribute, kernel_layers, launches
from sidecar.profiling.gpu.recording import Recording, RecordingRunner, load_recording
from sidecar.profiling.vocabulary import RawSpan
from sidecar.trace.spans import Level
from tests.gpu.conftest import BERT_B8, GOOD, GRAPH_B8, RESNET_B1, RESNET_B8

GPU_KINDS = ("kernel", "memcpy", "memset")


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_every_recorded_gpu_record_has_exactly_one_launch(path: Path) -> None:
    """Why the launch rule decides nothing on a real H100: one API call per correlation id."""
    rec = load_recording(path)
    api = Counter(r["correlation_id"] for r in rec.records if r["kind"] in (4, 5))
    gpu = {r["correlation_id"] for r in rec.records if r["kind"] in (1, 2, 10)}
    assert {api[cid] for cid in gpu} == {1}


# (GPU spans, with a layer, of those on a container, not attributed) in the stored trace of
# one forward: the same before and after the two copies of the rule became one.
STORED = {
    RESNET_B8: (232, 232, 16, 0),
    RESNET_B1: (227, 227, 16, 0),
    BERT_B8: (154, 153, 38, 1),  # BertModel.forward's own gather, before any submodule
    GRAPH_B8: (232, 232, 0, 0),  # all under the graph replay
}


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_stored_trace_and_raw_spans_get_the_same_layers(path: Path) -> None:
    res = run_experiment(
        RecordingRunner(load_recording(path)), {}, model="m", levels=[Level.KERNEL]
    )
    rep = res.trace.attributes["representative_iteration"]
    raw = res.runs[Level.KERNEL].iterations[rep].spans
    owner = kernel_layers(raw)
    by_id = {s.span_id: s for s in res.spans}
    stored = [s for s in res.spans if s.kind in GPU_KINDS]
    assert len(stored) == len(owner)
    raw_gpu = [s for s in raw if s.kind in GPU_KINDS]  # the timeline keeps the raw order
    for span, raw_span in zip(stored, raw_gpu, strict=True):
        layer = owner[id(raw_span)]
        parent = by_id.get(span.parent_id or "")
        assert (parent.name if parent else None) == (layer.name if layer else None)
    on_layer = [by_id[s.parent_id] for s in stored if s.parent_id]
    containers = sum(ly.attributes.get("leaf") is False for ly in on_layer)
    missing = sum(bool(s.attributes.get("parent_missing")) for s in stored)
    assert (len(stored), len(on_layer), containers, missing) == STORED[path]
    assert not any(s.attributes.get("parent_ambiguous") for s in stored)


class WithExtraSpans(RecordingRunner):
    """A recording runner over the first forward only, whose K iteration gets CONSTRUCTED
    spans added (tests only)."""

    def __init__(self, rec: Recording, extra: list[RawSpan]) -> None:
        assert rec.calls is not None
        super().__init__(replace(rec, walls=rec.walls[:1], calls=rec.calls[:1]))
        self.extra = extra

    def kernel_iterations(self) -> list[list[RawSpan]]:
        its = super().kernel_iterations()
        its[0].extend(self.extra)
        return its


def _a_recorded_launch(spans: list[RawSpan]) -> tuple[RawSpan, RawSpan, RawSpan]:
    """A real kernel of the b8 forward, its cudaLaunchKernel and its leaf layer."""
    owner = kernel_layers(spans)
    by_cid = launches(spans)
    for k in spans:
        launch = by_cid.get(k.attributes.get("correlation_id", 0))
        layer = owner.get(id(k))
        launched = launch is not None and launch.name == "cudaLaunchKernel"
        if k.kind == "kernel" and launched and layer is not None and layer.attributes.get("leaf"):
            assert launch is not None and launch.duration_ns > 4
            return k, launch, layer
    raise AssertionError("no kernel launched by cudaLaunchKernel in a leaf layer")


def _probe(start: int, end: int, depth: int) -> RawSpan:
    """CONSTRUCTED host layer around a constructed call only (never recorded)."""
    attrs = {"host_start_ns": start, "host_end_ns": end, "depth": depth, "leaf": True}
    return RawSpan(Level.LAYER, "probe", "Probe", start, end, attributes=attrs)


def _driver(launch: RawSpan, start: int, end: int) -> RawSpan:
    """CONSTRUCTED driver call sharing a recorded launch's correlation id."""
    attrs = {"correlation_id": launch.attributes["correlation_id"], "cbid": 0}
    return RawSpan(Level.KERNEL, "cuLaunchKernel", "driver", start, end, attributes=attrs)


def test_the_outer_call_wins_over_a_driver_call_inside_it(resnet_b8: Recording) -> None:
    """CONSTRUCTED: a driver call inside a recorded cudaLaunchKernel, with the same
    correlation id, and a layer around the driver call only. The kernel stays with the
    layer of the runtime call the framework made."""
    spans = RecordingRunner(resnet_b8).kernel_iterations()[0]
    kernel, launch, layer = _a_recorded_launch(spans)
    inner = _driver(launch, launch.start_ns + 1, launch.end_ns - 1)
    probe = _probe(inner.start_ns, inner.end_ns, depth=int(layer.attributes["depth"]) + 1)
    extra = [inner, probe]
    placed = attribute([*spans, *extra])[id(kernel)]
    assert placed.launch is launch and placed.layer is layer
    res = run_experiment(WithExtraSpans(resnet_b8, extra), {}, model="m", levels=[Level.KERNEL])
    by_id = {s.span_id: s for s in res.spans}
    cid = kernel.attributes["correlation_id"]
    (stored,) = [
        s for s in res.spans if s.kind == "kernel" and s.attributes["correlation_id"] == cid
    ]
    assert by_id[stored.attributes["launch_span_id"]].name == launch.name
    assert by_id[stored.parent_id or ""].name == layer.name


def test_of_two_unnested_calls_the_earlier_wins_even_when_shorter(
    resnet_b8: Recording,
) -> None:
    """CONSTRUCTED: a longer driver call with the same id after the recorded launch. The
    launch is the earlier call, not the longer one (the rule is containment and order, not
    duration, which timing noise would decide)."""
    spans = RecordingRunner(resnet_b8).kernel_iterations()[0]
    kernel, launch, layer = _a_recorded_launch(spans)
    later = _driver(launch, launch.end_ns + 10, launch.end_ns + 10 + 50 * launch.duration_ns)
    placed = attribute([*spans, later, _probe(later.start_ns, later.end_ns, depth=9)])
    assert placed[id(kernel)].launch is launch and placed[id(kernel)].layer is layer
    earlier = _driver(launch, launch.start_ns - 1, launch.start_ns)
    placed = attribute([*spans, earlier, _probe(earlier.start_ns, earlier.end_ns, depth=9)])
    assert placed[id(kernel)].launch is earlier
    assert placed[id(kernel)].layer is not None and placed[id(kernel)].layer.name == "probe"


def test_calls_starting_together_the_longer_wins() -> None:
    """CONSTRUCTED: a runtime call and the driver call it starts with."""
    outer = RawSpan(Level.KERNEL, "cudaLaunchKernel", "runtime", 100, 200,
                    attributes={"correlation_id": 7})  # fmt: skip
    inner = RawSpan(Level.KERNEL, "cuLaunchKernel", "driver", 100, 150,
                    attributes={"correlation_id": 7})  # fmt: skip
    assert launches([inner, outer])[7] is outer
    assert launches([outer, inner])[7] is outer
