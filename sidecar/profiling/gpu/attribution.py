"""GPU work -> layer (XSP correlation), CUDA graph replays, and layers on the GPU timeline.

**The attribution rule.** One implementation, `attribute`, serves the runners' raw spans (the
metrics level's per-layer sums, a recording's container envelopes: `kernel_layers`) and the
stored trace (`attach_gpu_activity`). For each kernel, memcpy or memset:

1. *Its launch* is the runtime/driver API call with the same `correlation_id` (0 is no id).
   Where several calls share an id (a driver call made inside the runtime call), the
   **outermost** wins: the earliest to start, and of calls starting together the longest. That
   is the call the framework made between its module's hooks; what it calls inside is the
   driver's business, and no timing noise decides. On the H100 recordings every id has exactly
   one API call (CUPTI 13 gives a runtime call's inner driver calls ids of their own), so the
   rule is checked on a constructed case (`tests/gpu/test_attribution_rule.py`).
2. *Its layer* is the innermost **host layer** whose host interval (`host_start_ns` ..
   `host_end_ns` where the layer carries them, else its own interval: the launch is a host
   event) contains the launch: the shortest, the deeper `depth` of equal ones, and inside every
   other candidate (`containment.innermost`). Host layers are all layers but the GPU-timeline
   spans of a CUDA graph (a replay: `graph_launch_correlation_id`; a graph-node layer:
   `graph_node_source`), which launch nothing. Kernels a container launches between its
   children (the residual add of a Bottleneck) thus belong to the container.
3. A *graph-launched* span (`launched_by_graph`) goes to the layer its graph node maps to
   (`graph_node_layer`) where there is one, else to its replay: never by launch time.
4. Otherwise it has no layer and the trace says why: no launch recorded or no host layer
   contains it (`parent_missing`), or several unnested ones do (`parent_ambiguous` with
   `parent_candidates`). Reported, not guessed.

A layer's GPU interval (`retime_layers`, `subtree_envelopes`) is the envelope of the GPU work
of the layer and its descendants, walking up `parent_layer` (`ancestors`: the one walk).

In a CUDA graph replay every kernel carries the one correlation id of `cudaGraphLaunch`, so
launch time says nothing about layers. The kernels are grouped under a layer-level span for
the replay (`kind` = `CUDAGraph`, with `kernel_count`, `kernel_ns` and `graph_id`), and each
is marked `launched_by_graph`: never silently outside any layer.

Graph node ids are the only link from a replayed kernel to a layer: the kernels launched
while the graph was captured (cudaStreamBeginCapture .. EndCapture, inside the module hooks)
create the graph's nodes, and CUPTI gives each replayed kernel the id of its node. Given a
table {graph_node_id: layer name} built from an observed capture, `map_graph_nodes` puts the
replayed kernels under layer spans inside the replay. Without such a table the replay says
so (`graph_node_layers` = `GRAPH_NODES_NOT_OBSERVED`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from sidecar.profiling.containment import API_KINDS, GPU_ASYNC_KINDS, innermost, set_parent
from sidecar.profiling.vocabulary import RawSpan, keyed
from sidecar.trace import schema
from sidecar.trace.spans import Level, Span

GRAPH_KIND = "CUDAGraph"
GRAPH_NODES_NOT_OBSERVED = (
    "not observed: no capture of this graph (cudaStreamBeginCapture..EndCapture with its "
    "graph node ids) was recorded, so its kernels are not placed in layers"
)


def _is_graph_launch(span: RawSpan) -> bool:
    return span.kind in API_KINDS and "GraphLaunch" in span.name


def group_graph_replays(spans: Sequence[RawSpan]) -> list[RawSpan]:
    """Layer spans for the CUDA graph replays among `spans` (one iteration), marking their
    kernels `launched_by_graph`. The replay span covers its kernels on the GPU timeline."""
    launches = {
        int(s.attributes.get(schema.CORRELATION_ID, 0)): s for s in spans if _is_graph_launch(s)
    }
    members: dict[int, list[RawSpan]] = defaultdict(list)
    for span in spans:
        cid = int(span.attributes.get(schema.CORRELATION_ID, 0))
        if span.kind in GPU_ASYNC_KINDS and (cid in launches or schema.GRAPH_ID in span.attributes):
            members[cid].append(span)
    out: list[RawSpan] = []
    for cid, work in sorted(members.items(), key=lambda kv: min(s.start_ns for s in kv[1])):
        launch = launches.get(cid)
        graph_ids = sorted({int(s.attributes.get(schema.GRAPH_ID, 0)) for s in work})
        for span in work:
            span.attributes[schema.LAUNCHED_BY_GRAPH] = True
        kernels = [s for s in work if s.kind == "kernel"]
        attrs: dict[str, Any] = {
            schema.OP_TYPE: GRAPH_KIND,
            schema.LAUNCHED_BY_GRAPH: True,
            schema.GRAPH_ID: graph_ids[0] if len(graph_ids) == 1 else graph_ids,
            schema.GRAPH_LAUNCH_CORRELATION_ID: cid,
            schema.KERNEL_COUNT: len(kernels),
            schema.KERNEL_NS: sum(s.duration_ns for s in kernels),
            schema.ACTIVITY_COUNT: len(work),
            schema.TIME_BASE: "gpu_kernels",
            schema.LEAF: True,
            schema.DEPTH: 1,
            schema.GRAPH_NODE_LAYERS: GRAPH_NODES_NOT_OBSERVED,
        }
        if launch is not None:
            attrs.update({schema.HOST_START_NS: launch.start_ns, schema.HOST_END_NS: launch.end_ns})
        name = f"cuda_graph[{attrs[schema.GRAPH_ID]}]"
        out.append(
            RawSpan(
                Level.LAYER,
                name,
                GRAPH_KIND,
                min(s.start_ns for s in work),
                max(s.end_ns for s in work),
                attributes=attrs,
            )
        )
    for span, key in zip(out, keyed([s.name for s in out]), strict=True):
        span.key = span.name = key
    return out


GraphNodeTable = Mapping[int, "str | tuple[str, str]"]  # node id -> layer (name, type)


def map_graph_nodes(spans: Sequence[RawSpan], table: GraphNodeTable, source: str) -> list[RawSpan]:
    """Layer spans for the graph-launched kernels of one iteration whose `graph_node_id` is
    in `table` (graph node id -> layer name, or (name, type), from an observed capture;
    `source` says which).

    Each layer span covers its kernels on the GPU timeline and sits inside its replay
    (`parent_layer`), which becomes a container; each kernel gets `graph_node_layer`. The
    replay's `graph_node_layers` says how many of its kernels were mapped and from what."""
    replays = {
        int(s.attributes[schema.GRAPH_LAUNCH_CORRELATION_ID]): s
        for s in spans
        if s.level is Level.LAYER and schema.GRAPH_LAUNCH_CORRELATION_ID in s.attributes
    }
    out: list[RawSpan] = []
    for cid, replay in replays.items():
        kernels = [
            s
            for s in spans
            if s.kind in GPU_ASYNC_KINDS
            and s.attributes.get(schema.LAUNCHED_BY_GRAPH)
            and int(s.attributes.get(schema.CORRELATION_ID, 0)) == cid
        ]
        groups: dict[str, list[RawSpan]] = defaultdict(list)
        types: dict[str, str] = {}
        for k in kernels:
            node = k.attributes.get(schema.GRAPH_NODE_ID)
            entry = table.get(int(node)) if node is not None else None
            if entry is None:
                continue
            name, type_ = (entry, "graph node") if isinstance(entry, str) else entry
            groups[name].append(k)
            types[name] = type_
        mapped = sum(len(g) for g in groups.values())
        replay.attributes[schema.GRAPH_NODE_LAYERS] = (
            f"mapped: {mapped} of {len(kernels)} GPU activities by graph node id ({source})"
            if mapped
            else GRAPH_NODES_NOT_OBSERVED
        )
        if not mapped:
            continue
        replay.attributes[schema.LEAF] = False
        first = sorted(groups.items(), key=lambda kv: min(s.start_ns for s in kv[1]))
        for (layer, work), key in zip(first, keyed([n for n, _ in first]), strict=True):
            for k in work:
                k.attributes[schema.GRAPH_NODE_LAYER] = key
            attrs: dict[str, Any] = {
                schema.OP_TYPE: types[layer],
                schema.MODULE: layer,
                schema.LAUNCHED_BY_GRAPH: True,
                schema.GRAPH_NODE_SOURCE: source,
                schema.GRAPH_NODE_IDS: sorted(
                    int(k.attributes[schema.GRAPH_NODE_ID]) for k in work
                ),
                schema.KERNEL_COUNT: sum(k.kind == "kernel" for k in work),
                schema.TIME_BASE: "gpu_kernels",
                schema.LEAF: True,
                schema.DEPTH: 2,
                schema.PARENT_LAYER: replay.name,
            }
            out.append(
                RawSpan(
                    Level.LAYER,
                    key,
                    attrs[schema.OP_TYPE],
                    min(k.start_ns for k in work),
                    max(k.end_ns for k in work),
                    key=key,
                    attributes=attrs,
                )
            )
    return out


class Traced(Protocol):
    """What attribution reads of a span: a runner's `RawSpan` or a stored `Span`."""

    level: Level
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


S = TypeVar("S", bound=Traced)


@dataclass
class Attribution(Generic[S]):
    """Where one GPU span belongs (`layer`; None: not attributed) and how it was decided."""

    layer: S | None
    launch: S | None = None  # the API call that launched it
    candidates: list[S] = field(default_factory=list)  # host layers containing the launch
    by_graph: bool = False  # placed by its CUDA graph (replay or graph node), not by launch


def host_interval(span: Traced) -> tuple[int, int]:
    """Where a layer ran on the host (its kernels' launches lie inside)."""
    a = span.attributes
    return int(a.get(schema.HOST_START_NS, span.start_ns)), int(
        a.get(schema.HOST_END_NS, span.end_ns)
    )


def is_graph_layer(span: Traced) -> bool:
    """A CUDA graph replay or a graph-node layer inside one: GPU timeline, no launches."""
    return (
        schema.GRAPH_LAUNCH_CORRELATION_ID in span.attributes
        or schema.GRAPH_NODE_SOURCE in span.attributes
    )


def launches(spans: Iterable[S]) -> dict[int, S]:
    """Correlation id -> the outermost API call with that id (earliest start, then longest)."""
    out: dict[int, S] = {}
    for span in spans:
        if span.level is not Level.KERNEL or span.kind not in API_KINDS:
            continue
        cid = int(span.attributes.get(schema.CORRELATION_ID, 0) or 0)
        if not cid:
            continue
        prev = out.get(cid)
        if prev is None or (span.start_ns, -span.end_ns) < (prev.start_ns, -prev.end_ns):
            out[cid] = span
    return out


def attribute(spans: Sequence[S]) -> dict[int, Attribution[S]]:
    """id(GPU span) -> its `Attribution`, for the spans of one iteration (the module's rule)."""
    layers = [s for s in spans if s.level is Level.LAYER]
    replays = {
        int(s.attributes[schema.GRAPH_LAUNCH_CORRELATION_ID]): s
        for s in layers
        if schema.GRAPH_LAUNCH_CORRELATION_ID in s.attributes
    }
    graph_nodes = {s.name: s for s in layers if schema.GRAPH_NODE_SOURCE in s.attributes}
    host_layers = [(host_interval(s), s) for s in layers if not is_graph_layer(s)]
    by_cid = launches(spans)
    out: dict[int, Attribution[S]] = {}
    for span in spans:
        if span.level is not Level.KERNEL or span.kind not in GPU_ASYNC_KINDS:
            continue
        cid = int(span.attributes.get(schema.CORRELATION_ID, 0) or 0)
        launch = by_cid.get(cid)
        if span.attributes.get(schema.LAUNCHED_BY_GRAPH):
            graph = graph_nodes.get(
                str(span.attributes.get(schema.GRAPH_NODE_LAYER))
            ) or replays.get(cid)
            if graph is not None:
                out[id(span)] = Attribution(graph, launch, [graph], by_graph=True)
                continue
        if launch is None:
            out[id(span)] = Attribution(None)
            continue
        hits = [ly for (h0, h1), ly in host_layers if h0 <= launch.start_ns and launch.end_ns <= h1]
        out[id(span)] = Attribution(innermost(hits, host_interval), launch, hits)
    return out


def kernel_layers(spans: Sequence[S]) -> dict[int, S | None]:
    """For one iteration's spans: id(GPU span) -> its layer (None: not attributed)."""
    return {key: found.layer for key, found in attribute(spans).items()}


def attach_gpu_activity(spans: Sequence[Span]) -> None:
    """Give each GPU kernel/memcpy/memset span of a stored trace its layer, in place, with
    `launch_span_id` / `launch_name` where its launch was recorded; one without a layer is
    flagged (`parent_missing`, or `parent_ambiguous` with its `parent_candidates`)."""
    found = attribute(spans)
    for span in spans:
        if (placed := found.get(id(span))) is None:
            continue
        if placed.launch is not None:
            span.attributes[schema.LAUNCH_SPAN_ID] = placed.launch.span_id
            span.attributes[schema.LAUNCH_NAME] = placed.launch.name
        set_parent(span, placed.candidates, placed.layer)


def ancestors(layer: S | None, by_name: Mapping[str, S]) -> Iterator[S]:
    """`layer`, then the layers enclosing it (its `parent_layer` chain), each once."""
    seen: set[str] = set()
    while layer is not None and layer.name not in seen:
        seen.add(layer.name)
        yield layer
        parent = layer.attributes.get(schema.PARENT_LAYER)
        layer = by_name.get(parent) if parent else None


def gpu_envelopes(
    owned: Iterable[tuple[S, Traced]], layers: Iterable[S]
) -> dict[int, tuple[S, int, int]]:
    """id(layer) -> (layer, first start, last end) of the GPU work of the layer and its
    descendants, from (layer, GPU span) pairs."""
    by_name = {s.name: s for s in layers}
    env: dict[int, tuple[S, int, int]] = {}
    for layer, work in owned:
        for up in ancestors(layer, by_name):
            _, s0, s1 = env.get(id(up), (up, work.start_ns, work.end_ns))
            env[id(up)] = (up, min(s0, work.start_ns), max(s1, work.end_ns))
    return env


def subtree_envelopes(
    spans: Sequence[RawSpan], owner: Mapping[int, RawSpan | None]
) -> dict[str, tuple[int, int]]:
    """Layer name -> [first start, last end] of the GPU work of the layer and its
    descendants (`parent_layer` chain)."""
    owned = [(layer, s) for s in spans if (layer := owner.get(id(s))) is not None]
    layers = [s for s in spans if s.level is Level.LAYER]
    return {ly.name: (s0, s1) for ly, s0, s1 in gpu_envelopes(owned, layers).values()}


def retime_layers(spans: Sequence[Span]) -> None:
    """Put layer spans that carry a host interval onto the GPU timeline, in place: from the
    first to the last GPU activity of the layer and its descendants (kernels already have
    their parents). Layers without GPU work keep their host interval."""
    layers = {s.span_id: s for s in spans if s.level is Level.LAYER}
    owned = [
        (layer, s)
        for s in spans
        if s.level is Level.KERNEL
        and s.kind in GPU_ASYNC_KINDS
        and (layer := layers.get(s.parent_id or "")) is not None
    ]
    for layer, start, end in gpu_envelopes(owned, layers.values()).values():
        if schema.HOST_START_NS not in layer.attributes or layer.kind == GRAPH_KIND:
            continue
        layer.start_ns, layer.end_ns = start, end
        layer.attributes[schema.TIME_BASE] = "gpu_kernels"  # where it sits on the timeline
