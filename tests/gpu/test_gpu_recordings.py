"""The GPU path on real H100 recordings (tests/data/gpu-fixtures, see its README): record ->
span conversion, the clock check, correlation and layer attribution, CUDA graphs.

The recordings are real CuptiTracer output; expected values are the facts the README lists
(measured on that H100), recomputed here from the raw records where possible.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.gpu.attribution import GRAPH_NODES_NOT_OBSERVED, kernel_layers
from sidecar.profiling.gpu.clock_check import ClockCheckError, check_clock
from sidecar.profiling.gpu.cupti_tracer import launch_records_only, records_to_spans
from sidecar.profiling.gpu.demangle import base_name
from sidecar.profiling.gpu.recording import (
    Recording,
    RecordingRunner,
    load_recording,
    recorded_kernel_windows,
)
from sidecar.trace.spans import Level
from tests.gpu.conftest import BERT_B8, GOOD, GRAPH_B8, RESNET_B1, RESNET_B8, WRONG_CLOCK


def raw(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


@pytest.mark.parametrize(
    ("path", "kernels", "kernel_ms"),
    [(RESNET_B8, 232, 1.77), (BERT_B8, 154, 6.42), (RESNET_B1, 218, 0.82), (GRAPH_B8, 232, 1.75)],
)
def test_kernels_per_forward_match_the_readme(path: Path, kernels: int, kernel_ms: float) -> None:
    for n, ns, window in recorded_kernel_windows(load_recording(path)):
        assert n == kernels
        assert round(ns / 1e6, 2) == pytest.approx(kernel_ms, abs=0.011)
        assert window >= ns  # one stream: kernels do not overlap


def test_records_become_spans_with_readable_names(resnet_b8: Recording) -> None:
    spans = records_to_spans(resnet_b8.records, resnet_b8.cupti_offset_ns)
    kinds = Counter(s.kind for s in spans)
    assert kinds == Counter({"runtime": 22284, "driver": 6281, "kernel": 696})
    k = next(s for s in spans if s.kind == "kernel")
    assert k.attributes["mangled_name"].startswith("_ZN5cudnn")
    assert k.name.startswith("void cudnn::engines_precompiled::nchwToNhwcKernel<float")
    assert k.attributes["short_name"] == "cudnn::engines_precompiled::nchwToNhwcKernel<…>"
    assert k.attributes["grid"] == [1568, 1, 8] and k.attributes["stream"] == 7
    launch = next(s for s in spans if s.kind == "runtime" and s.attributes["cbid"] == 211)
    assert launch.name == "cudaLaunchKernel"


def test_only_launch_api_records_are_kept(resnet_b8: Recording) -> None:
    """~29,000 API records for three forwards, of which only the launches matter."""
    kept = launch_records_only(resnet_b8.records)
    api = [r for r in kept if r["kind"] in (4, 5)]
    gpu_ids = {r["correlation_id"] for r in kept if r["kind"] == 10}
    assert {r["correlation_id"] for r in api} == gpu_ids
    assert len(api) < len(resnet_b8.records) / 20
    assert sum(r["kind"] == 10 for r in kept) == 696


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_clock_check_passes_on_every_good_recording(path: Path) -> None:
    rec = load_recording(path)
    spans = records_to_spans(rec.records, rec.cupti_offset_ns)
    result = check_clock(spans, rec.all_walls)
    assert result.ok, result.violations
    assert result.gpu_records == sum(r["kind"] not in (4, 5) for r in rec.records)


def test_clock_check_rejects_records_after_torch_profiler() -> None:
    rec = load_recording(WRONG_CLOCK)
    spans = records_to_spans(rec.records, rec.cupti_offset_ns)
    result = check_clock(spans, rec.all_walls)
    assert not result.ok
    assert "launched outside every host wall" in result.violations[0]
    with pytest.raises(ClockCheckError, match="another CUPTI client"):
        run_experiment(RecordingRunner(rec), {}, model="bert", levels=[Level.KERNEL])


def test_clock_check_catches_a_stretched_clock(resnet_b8: Recording) -> None:
    """The same good records on a clock running 2x (what the H100 showed) fail."""
    spans = records_to_spans(resnet_b8.records, resnet_b8.cupti_offset_ns)
    t0 = resnet_b8.all_walls[0][0]
    for s in spans:
        s.start_ns = t0 + 2 * (s.start_ns - t0)
        s.end_ns = t0 + 2 * (s.end_ns - t0)
    assert not check_clock(spans, resnet_b8.all_walls).ok


def test_gpu_records_without_their_launch_are_rejected(resnet_b8: Recording) -> None:
    """What a tracer whose runtime API records never arrive would return: the H100's records
    without the runtime calls. Only the 93 kernels launched through the driver
    (`cuLaunchKernel`) keep a launch; the other 603 of 696 would drop out of every sum."""
    records = [r for r in resnet_b8.records if r["kind"] != 5]
    spans = records_to_spans(records, resnet_b8.cupti_offset_ns)
    result = check_clock(spans, resnet_b8.all_walls)
    assert result.violations == []  # the clock itself is fine
    assert (result.missing_launches, result.gpu_records) == (603, 696)
    with pytest.raises(ClockCheckError, match="603 of 696 GPU records came without the API"):
        run_experiment(
            RecordingRunner(replace(resnet_b8, records=records)),
            {},
            model="resnet50",
            levels=[Level.KERNEL],
        )


def test_every_resnet_kernel_gets_a_layer(resnet_b8: Recording) -> None:
    for spans in RecordingRunner(resnet_b8).kernel_iterations():
        owner = kernel_layers(spans)
        assert len(owner) == 232 and all(v is not None for v in owner.values())
        layers = [s for s in spans if s.level is Level.LAYER]
        leaves = [s for s in layers if s.attributes["leaf"]]
        assert len(leaves) == 158  # every leaf call, the relu repeats included
        relus = [s.name for s in leaves if s.name.startswith("layer1.0.relu")]
        assert relus == ["layer1.0.relu", "layer1.0.relu#1", "layer1.0.relu#2"]
        on_containers = [(owner[id(k)], k) for k in spans if owner.get(id(k)) is not None]
        residual = [
            (ly, k) for ly, k in on_containers if ly is not None and not ly.attributes["leaf"]
        ]
        assert len(residual) == 16  # one residual add per Bottleneck
        assert all(
            k.attributes["short_name"].endswith("elementwise_kernel<…>") for _, k in residual
        )
        assert sorted({ly.name.count(".") for ly, _ in residual}) == [1]  # layerN.M


def test_b1_recording_attributes_kernels_and_memsets() -> None:
    rec = load_recording(RESNET_B1)
    (spans,) = RecordingRunner(rec).kernel_iterations()
    owner = kernel_layers(spans)
    kinds = Counter(s.kind for s in spans if id(s) in owner)
    assert kinds == Counter({"kernel": 218, "memset": 9})
    assert all(v is not None for v in owner.values())


def test_bert_kernels_outside_every_module_are_reported_not_guessed() -> None:
    rec = load_recording(BERT_B8)
    for spans in RecordingRunner(rec).kernel_iterations():
        owner = kernel_layers(spans)
        missing = [s for s in spans if id(s) in owner and owner[id(s)] is None]
        # BertModel.forward itself launches one gather before its first submodule runs
        assert len(missing) == 1 and "gather" in missing[0].name
        first_layer = min(s.attributes["host_start_ns"] for s in spans if s.level is Level.LAYER)
        launch = next(
            s for s in spans
            if s.kind == "runtime"
            and s.attributes["correlation_id"] == missing[0].attributes["correlation_id"]
        )  # fmt: skip
        assert launch.start_ns < first_layer


def test_cuda_graph_kernels_are_grouped_under_the_replay() -> None:
    rec = load_recording(GRAPH_B8)
    assert len({r["correlation_id"] for r in rec.records if r["kind"] == 10}) == 1
    res = run_experiment(RecordingRunner(rec), {}, model="resnet50", levels=[Level.KERNEL])
    (replay,) = res.spans_at(Level.LAYER)
    kernels = [s for s in res.spans if s.kind == "kernel"]
    assert replay.kind == "CUDAGraph" and replay.attributes["kernel_count"] == 232
    assert replay.attributes["graph_id"] == 2
    assert replay.attributes["kernel_ns"] == sum(k.timeline_ns for k in kernels)
    assert all(k.parent_id == replay.span_id for k in kernels)
    assert all(k.attributes["launched_by_graph"] for k in kernels)
    assert not any(k.attributes.get("parent_missing") for k in kernels)
    (model,) = res.spans_at(Level.MODEL)
    assert replay.parent_id == model.span_id


def test_layers_nest_and_sit_on_the_gpu_timeline(resnet_b8: Recording) -> None:
    res = run_experiment(RecordingRunner(resnet_b8), {}, model="resnet50", batch_size=8)
    layers = {s.name: s for s in res.spans_at(Level.LAYER)}
    assert {"layer1", "layer1.0", "layer1.0.conv1", "layer4.2.relu#2"} <= set(layers)
    assert layers["layer1.0.conv1"].attributes["parent_layer"] == "layer1.0"
    assert layers["layer1.0"].attributes["parent_layer"] == "layer1"
    kernels = [s for s in res.spans if s.kind == "kernel"]
    by_id = {s.span_id: s for s in res.spans}
    assert all(by_id[k.parent_id].level is Level.LAYER for k in kernels)
    conv = layers["layer1.0.conv1"]
    mine = [k for k in kernels if k.parent_id == conv.span_id]
    assert conv.start_ns == min(k.start_ns for k in mine)  # GPU timeline, not host
    assert conv.end_ns == max(k.end_ns for k in mine)
    assert conv.attributes["host_start_ns"] < conv.start_ns  # kernels run after the launch
    # the layer's duration is its CUDA-event interval (layer run), as recorded
    rows = raw(RESNET_B8)["leaf_modules"]
    events = [r[4] for it in rows for r in it if r[0] == "layer1.0.conv1"]
    assert len(events) == 3  # floor(20% of 3) = 0 trimmed: the plain mean
    assert conv.duration_ns == pytest.approx(sum(events) / 3 * 1e6, abs=1)
    assert res.trace.attributes["layer_time_base"] == "gpu_events"


def synthetic_graph_node_table(graph: Recording) -> dict[int, tuple[str, str]]:
    """SYNTHETIC {graph_node_id: (layer, type)} table: no recording holds a capture, so the
    graph's node ids (kernel order) are paired with the layers the eager b8 recording
    attributes its kernels to, in the same order. The kernel names agree one by one."""
    eager = RecordingRunner(load_recording(RESNET_B8)).kernel_iterations()[0]
    owner = kernel_layers(eager)
    ek = sorted((s for s in eager if s.kind == "kernel"), key=lambda s: s.start_ns)
    gk = sorted((r for r in graph.records if r["kind"] == 10), key=lambda r: r["start"])
    assert [base_name(s.attributes.get("mangled_name", s.name)) for s in ek] == [
        base_name(r["name"]) for r in gk
    ]
    table = {}
    for span, rec in zip(ek, gk, strict=True):
        layer = owner[id(span)]
        assert layer is not None
        table[int(rec["graph_node_id"])] = (layer.name, layer.kind)
    return table


def test_graph_kernels_map_to_layers_through_node_ids() -> None:
    rec = load_recording(GRAPH_B8)
    table = synthetic_graph_node_table(rec)
    runner = RecordingRunner(rec, graph_nodes=table, graph_nodes_source="synthetic table")
    res = run_experiment(runner, {}, model="resnet50", levels=[Level.KERNEL])
    layers = {s.name: s for s in res.spans_at(Level.LAYER)}
    replay = layers.pop("cuda_graph[2]")
    assert replay.attributes["graph_node_layers"] == (
        "mapped: 232 of 232 GPU activities by graph node id (synthetic table)"
    )
    assert replay.attributes["leaf"] is False and replay.attributes["kernel_count"] == 232
    assert len(layers) == 158 + 16  # every leaf call with kernels + 16 residual adds
    assert {s.attributes["parent_layer"] for s in layers.values()} == {"cuda_graph[2]"}
    kernels = [s for s in res.spans if s.kind == "kernel"]
    by_id = {s.span_id: s for s in res.spans}
    assert all(by_id[k.parent_id].name in layers for k in kernels)
    assert all(k.attributes["launched_by_graph"] for k in kernels)
    conv = layers["layer1.0.conv1"]
    mine = [k for k in kernels if k.parent_id == conv.span_id]
    assert conv.kind == "Conv2d" and len(mine) == conv.attributes["kernel_count"] == 1
    assert (conv.start_ns, conv.end_ns) == (mine[0].start_ns, mine[0].end_ns)
    relus = sorted(n for n in layers if n.startswith("layer1.0.relu"))
    assert relus == ["layer1.0.relu", "layer1.0.relu#1", "layer1.0.relu#2"]
    order = [s.name for s in sorted(res.spans_at(Level.LAYER), key=lambda s: s.index)]
    assert order[:3] == ["cuda_graph[2]", "conv1", "bn1"]


def test_graph_without_a_capture_says_not_observed() -> None:
    res = run_experiment(
        RecordingRunner(load_recording(GRAPH_B8)), {}, model="resnet50", levels=[Level.KERNEL]
    )
    (replay,) = res.spans_at(Level.LAYER)
    assert replay.attributes["graph_node_layers"] == GRAPH_NODES_NOT_OBSERVED
    assert GRAPH_NODES_NOT_OBSERVED.startswith("not observed")
    partial = RecordingRunner(load_recording(GRAPH_B8), graph_nodes={1: "elsewhere"})
    (replay,) = run_experiment(partial, {}, model="r", levels=[Level.KERNEL]).spans_at(Level.LAYER)
    assert replay.attributes["graph_node_layers"] == GRAPH_NODES_NOT_OBSERVED
