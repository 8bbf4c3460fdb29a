"""Module calls -> nested layer spans (every module of the tree, one span per call).

A call has its host interval (forward pre/post hooks, `perf_counter_ns`), which is where its
kernel launches happen, and on a GPU its interval on the GPU timeline (CUDA events recorded
in the same hooks, no host synchronisation). The layer span takes the GPU interval where
there is one (`time_base` = `gpu_events`) and keeps the host interval beside it
(`host_start_ns`/`host_end_ns`). A module called n times in one forward (torchvision's
Bottleneck calls its one `relu` three times) gives n spans named `relu`, `relu#1`,
`relu#2`, so every call stays visible in the analyses. `parent_layer` names the enclosing
call, `depth` its depth in the module tree and `leaf` whether no module call ran inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.profiling.vocabulary import RawSpan, keyed
from sidecar.trace import schema
from sidecar.trace.spans import Level


@dataclass
class ModuleCall:
    """One call of one module in one forward (host times in `perf_counter_ns`)."""

    name: str
    type: str
    start_ns: int
    end_ns: int
    depth: int = 1
    parent: int | None = None  # index of the enclosing call in the same list
    leaf: bool = True
    gpu_start_ms: float | None = None  # CUDA-event time after the forward's start event
    gpu_ms: float | None = None  # CUDA-event interval of the call
    attributes: dict[str, Any] = field(default_factory=dict)


def call_spans(
    calls: Sequence[ModuleCall], offset_ns: int, gpu_origin_ns: int | None = None
) -> list[RawSpan]:
    """Layer spans of one forward; `offset_ns` turns perf_counter ns into epoch ns and
    `gpu_origin_ns` (epoch) is where the forward's start event sits on the GPU timeline."""
    names = keyed([c.name for c in calls])
    spans: list[RawSpan] = []
    for call, name in zip(calls, names, strict=True):
        host0, host1 = call.start_ns + offset_ns, call.end_ns + offset_ns
        attrs = dict(call.attributes)
        attrs.setdefault(schema.OP_TYPE, call.type)
        attrs.update(
            {
                schema.MODULE: call.name,
                schema.DEPTH: call.depth,
                schema.LEAF: call.leaf,
                schema.HOST_START_NS: host0,
                schema.HOST_END_NS: host1,
                schema.PARENT_LAYER: names[call.parent] if call.parent is not None else None,
            }
        )
        start, end = host0, host1
        if call.gpu_ms is not None:
            attrs[schema.TIME_BASE] = "gpu_events"
            if call.gpu_start_ms is not None and gpu_origin_ns is not None:
                start = gpu_origin_ns + round(call.gpu_start_ms * 1e6)
            else:  # only the interval is known: place it at the launch
                attrs[schema.GPU_POSITION] = "host start"
            end = start + round(call.gpu_ms * 1e6)
        else:
            attrs[schema.TIME_BASE] = "host"
        spans.append(RawSpan(Level.LAYER, name, call.type, start, end, key=name, attributes=attrs))
    return spans


def calls_from_leaves(rows: Sequence[Sequence[Any]]) -> list[ModuleCall]:
    """Leaf-module calls `[name, type, start, end, (gpu_ms)]` in execution order, plus one
    call per enclosing module (`layer1`, `layer1.0`) spanning its leaves' host intervals.

    Recordings hooked the leaves only; a container's call is rebuilt from the dotted names
    (a new call starts when a leaf outside it runs in between), so work a container does
    between its leaves (the residual add of a Bottleneck) falls inside it.
    """
    calls: list[ModuleCall] = []
    open_: list[int] = []  # indices of the currently open container calls, outermost first
    for row in rows:
        name, type_, start, end = str(row[0]), str(row[1]), int(row[2]), int(row[3])
        gpu_ms = float(row[4]) if len(row) > 4 and row[4] is not None else None
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts))]
        keep = 0
        while (
            keep < len(open_) and keep < len(prefixes) and calls[open_[keep]].name == prefixes[keep]
        ):
            keep += 1
        del open_[keep:]
        for prefix in prefixes[keep:]:
            parent = open_[-1] if open_ else None
            calls.append(
                ModuleCall(prefix, "container", start, end, len(open_) + 1, parent, leaf=False)
            )
            open_.append(len(calls) - 1)
        for i in open_:
            calls[i].end_ns = max(calls[i].end_ns, end)
        parent = open_[-1] if open_ else None
        calls.append(ModuleCall(name, type_, start, end, len(parts), parent, True, None, gpu_ms))
    return calls
