"""A runner over CUPTI recordings taken on a real GPU (`tests/data/gpu-fixtures/`).

A recording (one gzipped JSON object, see the fixtures' README) holds the activity records
of a few forwards as this project's `CuptiTracer` returned them, the forwards' host walls
(`perf_counter_ns`), the clock offsets, and where present every leaf-module call with its
host interval and CUDA-event time. `RecordingRunner` replays it through the same code a
live GPU profile uses (record -> span, clock check, graph grouping, nested layers), so the
whole GPU path is tested without a GPU. It measures nothing itself: M, L and K come from the
one recorded run (hooks and CUPTI were on, so M includes their overhead; the trace says so).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.experiment import LeveledProfile, run_experiment
from sidecar.profiling.gpu.attribution import (
    GraphNodeTable,
    group_graph_replays,
    kernel_layers,
    map_graph_nodes,
    subtree_envelopes,
)
from sidecar.profiling.gpu.clock_check import DEFAULT_TOLERANCE_NS, require_clock
from sidecar.profiling.gpu.cupti_tracer import (
    launch_records_only,
    records_to_spans,
    split_records,
    split_spans,
)
from sidecar.profiling.gpu.gpu_peak import GpuPeak, datasheet_peak, roof_attributes
from sidecar.profiling.gpu.layers import ModuleCall, call_spans, calls_from_leaves
from sidecar.profiling.gpu.metrics_level import layer_metric_sums, recorded_status
from sidecar.profiling.gpu.ncu import NcuKernel, join_metrics, read_ncu_csv
from sidecar.profiling.vocabulary import (
    Iteration,
    LevelNotSupportedError,
    LevelRun,
    ProfilingError,
    RawSpan,
    RuntimeInfo,
    model_span,
)
from sidecar.trace import schema
from sidecar.trace.spans import Level


@dataclass
class Recording:
    """One recording, on the Unix-epoch clock."""

    path: Path
    what: str
    device: str
    records: list[dict[str, Any]]
    cupti_offset_ns: int  # CUPTI ns + offset = epoch ns
    perf_offset_ns: int  # perf_counter ns + offset = epoch ns
    walls: list[tuple[int, int]]  # epoch ns, the forwards replayed
    all_walls: list[tuple[int, int]]  # every recorded forward (for the clock check)
    calls: list[list[ModuleCall]] | None = None  # per wall, when the leaves were hooked
    meta: dict[str, Any] = field(default_factory=dict)


def load_recording(path: str | Path) -> Recording:
    """Read a `cupti_*.json.gz` recording."""
    path = Path(path)
    try:
        with gzip.open(path, "rt") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ProfilingError(f"cannot read GPU recording {path}: {exc}") from None
    perf = int(data["perf_counter_to_epoch_ns"])
    raw_walls = data.get("walls_perf_counter_ns") or [data["wall_perf_counter_ns"]]
    walls = all_walls = [(int(a) + perf, int(b) + perf) for a, b in raw_walls]
    calls: list[list[ModuleCall]] | None = None
    if data.get("leaf_modules"):
        calls = [calls_from_leaves(rows) for rows in data["leaf_modules"]]
    elif data.get("layer_hooks_last_iteration"):  # older layout: the last forward only
        walls = walls[-1:]
        calls = [calls_from_leaves(data["layer_hooks_last_iteration"])]
    meta = {k: v for k, v in data.items() if isinstance(v, str | int | float)}
    device = data.get("device")
    if not device:  # older recordings name the GPU in their description only
        found = re.search(r"NVIDIA [A-Z]\d+\w*", str(data.get("what", "")))
        device = found.group(0) if found else "NVIDIA GPU (recording)"
    return Recording(
        path=path,
        what=str(data.get("what", "")),
        device=str(device),
        records=list(data["records"]),
        cupti_offset_ns=int(data["offset_ns_cupti_to_epoch"]),
        perf_offset_ns=perf,
        walls=walls,
        all_walls=all_walls,
        calls=calls,
        meta=meta,
    )


class RecordingRunner:
    """A `Runner` whose runs are the forwards of one recording (inputs are not used)."""

    name = "recording"

    def __init__(
        self,
        recording: Recording,
        *,
        launch_api_only: bool = True,
        tolerance_ns: int = DEFAULT_TOLERANCE_NS,
        ncu: Sequence[NcuKernel] | None = None,
        graph_nodes: GraphNodeTable | None = None,
        graph_nodes_source: str = "capture",
    ) -> None:
        self.rec = recording
        self.tolerance_ns = tolerance_ns
        self.ncu = ncu
        self.graph_nodes = graph_nodes
        self.graph_nodes_source = graph_nodes_source
        records = recording.records
        self.records = launch_records_only(records) if launch_api_only else records

    def describe(self) -> RuntimeInfo:
        notes = {}
        if self.rec.calls is None:
            notes[Level.LAYER.value] = "not captured: the recording has no module hooks"
        return RuntimeInfo(
            "pytorch",
            str(self.rec.meta.get("torch", "")),
            "cuda (recorded)",
            self.rec.device,
            notes,
        )

    def supported_levels(self) -> tuple[Level, ...]:
        if self.rec.calls is None:
            return (Level.MODEL, Level.KERNEL)
        return (Level.MODEL, Level.LAYER, Level.KERNEL)

    def run(
        self, inputs: Mapping[str, np.ndarray], level: Level, iterations: int, warmup: int
    ) -> LevelRun:
        attrs: dict[str, Any] = {
            schema.RECORDING: self.rec.path.name,
            schema.RECORDING_WHAT: self.rec.what,
            schema.MODEL_LATENCY_NOTE: "M is the recorded forward with hooks and CUPTI on",
        }
        if level is Level.MODEL:
            its = [Iteration(e - s, [self._model(s, e)]) for s, e in self.rec.walls]
        elif level is Level.KERNEL:
            its = [
                Iteration(e - s, spans)
                for (s, e), spans in zip(self.rec.walls, self.kernel_iterations(), strict=True)
            ]
            attrs[schema.CUPTI_API_RECORDS] = "launches only"
            attrs.update(recorded_status(self.ncu))
            if self.ncu is not None:
                attrs[schema.METRICS_RUN] = {
                    "source": "ncu",
                    "kernels": len(self.ncu),
                    "note": "Nsight Compute profiled one forward; its metrics are joined to "
                    "the kernels of every K iteration in launch order",
                }
        elif level is Level.LAYER and self.rec.calls is not None:
            its = self._layer_iterations()
            leaves = [c for calls in self.rec.calls for c in calls if c.leaf]
            timed = all(c.gpu_ms is not None for c in leaves)
            attrs[schema.LAYER_TIME_BASE] = "gpu_events" if timed else "host"
        else:
            raise LevelNotSupportedError(f"the recording cannot give level {level.value!r}")
        return LevelRun(level, its, 0, attrs)

    def _model(self, start: int, end: int) -> RawSpan:
        return model_span(str(self.rec.meta.get("model", "model")), start, end)

    def kernel_iterations(self) -> list[list[RawSpan]]:
        """Per forward: model span, host-interval layer spans, graph replays, K spans."""
        spans_all = records_to_spans(self.records, self.rec.cupti_offset_ns)
        require_clock(spans_all, self.rec.all_walls, self.tolerance_ns)
        per_iter = split_spans(spans_all, self.rec.walls)
        out: list[list[RawSpan]] = []
        for i, ((w0, w1), kernels) in enumerate(zip(self.rec.walls, per_iter, strict=True)):
            spans = [self._model(w0, w1)]
            if self.rec.calls is not None:
                for layer in call_spans(self.rec.calls[i], self.rec.perf_offset_ns):
                    host = (
                        layer.attributes[schema.HOST_START_NS],
                        layer.attributes[schema.HOST_END_NS],
                    )
                    layer.start_ns, layer.end_ns = host  # K run: layers on the host clock
                    layer.attributes.pop(schema.GPU_POSITION, None)
                    layer.attributes[schema.TIME_BASE] = "host"
                    spans.append(layer)
            replays = group_graph_replays(kernels)
            spans.extend(replays)
            if self.graph_nodes is not None:
                table, source = self.graph_nodes, self.graph_nodes_source
                spans.extend(map_graph_nodes([*replays, *kernels], table, source))
            spans.extend(kernels)
            if self.ncu is not None:
                join_metrics(kernels, self.ncu)
                layer_metric_sums(kernel_layers(spans), spans)
            out.append(spans)
        return out

    def _layer_iterations(self) -> list[Iteration]:
        """Leaf layers take their CUDA-event time; containers (not hooked in recordings)
        the envelope of their subtree's kernels in the same forward."""
        assert self.rec.calls is not None
        its: list[Iteration] = []
        for (w0, w1), calls, k_spans in zip(
            self.rec.walls, self.rec.calls, self.kernel_iterations(), strict=True
        ):
            env = subtree_envelopes(k_spans, kernel_layers(k_spans))
            spans = [self._model(w0, w1)]
            for layer in call_spans(calls, self.rec.perf_offset_ns):
                if not layer.attributes[schema.LEAF] and layer.name in env:
                    layer.start_ns, layer.end_ns = env[layer.name]
                    layer.attributes[schema.TIME_BASE] = "gpu_kernels"
                    layer.attributes[schema.DURATION_NOTE] = (
                        "container: envelope of its kernels (the recording has CUDA events "
                        "for leaf modules only)"
                    )
                spans.append(layer)
            its.append(Iteration(w1 - w0, spans))
        return its


def profile_recording(
    path: str | Path,
    *,
    model: str,
    batch_size: int,
    ncu_csv: str | Path | None = None,
    peak: GpuPeak | None = None,
    graph_nodes: GraphNodeTable | None = None,
    graph_nodes_source: str = "capture",
) -> LeveledProfile:
    """The leveled profile of a recording, as `xsp-sidecar profile` would store it; the
    roofs default to the recorded device's data sheet (the TF32 tensor roof when Nsight
    Compute saw tensor-pipe work)."""
    rec = load_recording(path)
    ncu = read_ncu_csv(ncu_csv) if ncu_csv is not None else None
    runner = RecordingRunner(
        rec, ncu=ncu, graph_nodes=graph_nodes, graph_nodes_source=graph_nodes_source
    )
    result = run_experiment(
        runner,
        {},
        model=model,
        levels=runner.supported_levels(),
        batch_size=batch_size,
    )
    if peak is None:
        peak = datasheet_peak(rec.device, "fp32")
    result.trace.attributes.update(roof_attributes(peak, result.spans))
    return result


def recorded_kernel_windows(rec: Recording) -> list[tuple[int, int, int]]:
    """Per forward: (kernel count, kernel ns summed, first-to-last kernel ns)."""
    per_iter = split_records(launch_records_only(rec.records), rec.walls, rec.cupti_offset_ns)
    out = []
    for spans in per_iter:
        ks = [s for s in spans if s.kind == "kernel"]
        if not ks:
            out.append((0, 0, 0))
            continue
        window = max(s.end_ns for s in ks) - min(s.start_ns for s in ks)
        out.append((len(ks), sum(s.duration_ns for s in ks), window))
    return out


def fixture_paths(folder: str | Path) -> Sequence[Path]:
    """The `cupti_*.json.gz` recordings in a folder, sorted."""
    return sorted(Path(folder).glob("cupti_*.json.gz"))
