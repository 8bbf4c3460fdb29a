"""GPU work -> layer (XSP correlation), CUDA graph replays, and layers on the GPU timeline.

A kernel (memcpy, memset) is joined to its launch, the runtime/driver call with the same
`correlation_id`; the launch goes to the innermost module call whose host interval contains
it (`containment`). Kernels a container launches between its children (the residual add of
a Bottleneck) thus belong to the container.

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
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.profiling.containment import GPU_ASYNC_KINDS
from sidecar.profiling.vocabulary import RawSpan, keyed
from sidecar.trace.spans import Level, Span

API_KINDS = frozenset({"runtime", "driver"})
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
    launches = {int(s.attributes.get("correlation_id", 0)): s for s in spans if _is_graph_launch(s)}
    members: dict[int, list[RawSpan]] = defaultdict(list)
    for span in spans:
        cid = int(span.attributes.get("correlation_id", 0))
        if span.kind in GPU_ASYNC_KINDS and (cid in launches or "graph_id" in span.attributes):
            members[cid].append(span)
    out: list[RawSpan] = []
    for cid, work in sorted(members.items(), key=lambda kv: min(s.start_ns for s in kv[1])):
        launch = launches.get(cid)
        graph_ids = sorted({int(s.attributes.get("graph_id", 0)) for s in work})
        for span in work:
            span.attributes["launched_by_graph"] = True
        kernels = [s for s in work if s.kind == "kernel"]
        attrs: dict[str, Any] = {
            "op_type": GRAPH_KIND,
            "launched_by_graph": True,
            "graph_id": graph_ids[0] if len(graph_ids) == 1 else graph_ids,
            "graph_launch_correlation_id": cid,
            "kernel_count": len(kernels),
            "kernel_ns": sum(s.duration_ns for s in kernels),
            "activity_count": len(work),
            "time_base": "gpu_kernels",
            "leaf": True,
            "depth": 1,
            "graph_node_layers": GRAPH_NODES_NOT_OBSERVED,
        }
        if launch is not None:
            attrs.update(host_start_ns=launch.start_ns, host_end_ns=launch.end_ns)
        name = f"cuda_graph[{attrs['graph_id']}]"
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
        int(s.attributes["graph_launch_correlation_id"]): s
        for s in spans
        if s.level is Level.LAYER and "graph_launch_correlation_id" in s.attributes
    }
    out: list[RawSpan] = []
    for cid, replay in replays.items():
        kernels = [
            s
            for s in spans
            if s.kind in GPU_ASYNC_KINDS
            and s.attributes.get("launched_by_graph")
            and int(s.attributes.get("correlation_id", 0)) == cid
        ]
        groups: dict[str, list[RawSpan]] = defaultdict(list)
        types: dict[str, str] = {}
        for k in kernels:
            node = k.attributes.get("graph_node_id")
            entry = table.get(int(node)) if node is not None else None
            if entry is None:
                continue
            name, type_ = (entry, "graph node") if isinstance(entry, str) else entry
            groups[name].append(k)
            types[name] = type_
        mapped = sum(len(g) for g in groups.values())
        replay.attributes["graph_node_layers"] = (
            f"mapped: {mapped} of {len(kernels)} GPU activities by graph node id ({source})"
            if mapped
            else GRAPH_NODES_NOT_OBSERVED
        )
        if not mapped:
            continue
        replay.attributes["leaf"] = False
        first = sorted(groups.items(), key=lambda kv: min(s.start_ns for s in kv[1]))
        for (layer, work), key in zip(first, keyed([n for n, _ in first]), strict=True):
            for k in work:
                k.attributes["graph_node_layer"] = key
            attrs: dict[str, Any] = {
                "op_type": types[layer],
                "module": layer,
                "launched_by_graph": True,
                "graph_node_source": source,
                "graph_node_ids": sorted(int(k.attributes["graph_node_id"]) for k in work),
                "kernel_count": sum(k.kind == "kernel" for k in work),
                "time_base": "gpu_kernels",
                "leaf": True,
                "depth": 2,
                "parent_layer": replay.name,
            }
            out.append(
                RawSpan(
                    Level.LAYER,
                    key,
                    attrs["op_type"],
                    min(k.start_ns for k in work),
                    max(k.end_ns for k in work),
                    key=key,
                    attributes=attrs,
                )
            )
    return out


def graph_parent(
    span: Span, replays: dict[int, Span], by_name: Mapping[str, Span] | None = None
) -> Span | None:
    """The layer a graph-launched GPU span belongs to: its mapped graph node's layer where
    there is one, else the replay (by the launch correlation id)."""
    if not span.attributes.get("launched_by_graph"):
        return None
    mapped = span.attributes.get("graph_node_layer")
    if mapped is not None and by_name is not None and mapped in by_name:
        return by_name[mapped]
    return replays.get(int(span.attributes.get("correlation_id", 0)))


def innermost_host_layer(start_ns: int, end_ns: int, layers: Sequence[RawSpan]) -> RawSpan | None:
    """The innermost layer whose host interval contains [start_ns, end_ns] (None if none,
    or if two unnested layers both contain it)."""
    hits = [ly for ly in layers if _host(ly)[0] <= start_ns and end_ns <= _host(ly)[1]]
    if not hits:
        return None
    hits.sort(key=lambda ly: (_host(ly)[1] - _host(ly)[0], -int(ly.attributes.get("depth", 0))))
    inner = hits[0]
    for other in hits[1:]:
        if not (_host(other)[0] <= _host(inner)[0] and _host(inner)[1] <= _host(other)[1]):
            return None
    return inner


def _host(span: RawSpan) -> tuple[int, int]:
    a = span.attributes
    return int(a.get("host_start_ns", span.start_ns)), int(a.get("host_end_ns", span.end_ns))


def attribute_raw(spans: Sequence[RawSpan]) -> dict[int, RawSpan | None]:
    """For one iteration's raw spans: id(GPU span) -> its layer (None: not attributed)."""
    layers = [s for s in spans if s.level is Level.LAYER]
    replays = {
        int(s.attributes["graph_launch_correlation_id"]): s
        for s in layers
        if "graph_launch_correlation_id" in s.attributes
    }
    host_layers = [
        s for s in layers if s.kind != GRAPH_KIND and "graph_node_source" not in s.attributes
    ]
    by_name = {s.name: s for s in layers if "graph_node_source" in s.attributes}
    launches: dict[int, RawSpan] = {}
    for s in spans:
        if s.kind in API_KINDS:
            cid = int(s.attributes.get("correlation_id", 0))
            prev = launches.get(cid)
            if prev is None or s.duration_ns > prev.duration_ns:
                launches[cid] = s
    out: dict[int, RawSpan | None] = {}
    for s in spans:
        if s.kind not in GPU_ASYNC_KINDS:
            continue
        cid = int(s.attributes.get("correlation_id", 0))
        if s.attributes.get("launched_by_graph") and cid in replays:
            mapped = by_name.get(str(s.attributes.get("graph_node_layer")))
            out[id(s)] = mapped if mapped is not None else replays[cid]
            continue
        launch = launches.get(cid)
        out[id(s)] = (
            innermost_host_layer(launch.start_ns, launch.end_ns, host_layers) if launch else None
        )
    return out


def subtree_envelopes(
    spans: Sequence[RawSpan], owner: dict[int, RawSpan | None]
) -> dict[str, tuple[int, int]]:
    """Layer name -> [first start, last end] of the GPU work of the layer and its
    descendants (`parent_layer` chain)."""
    by_name = {s.name: s for s in spans if s.level is Level.LAYER}
    env: dict[str, tuple[int, int]] = {}
    for s in spans:
        layer = owner.get(id(s))
        seen: set[str] = set()
        while layer is not None and layer.name not in seen:
            seen.add(layer.name)
            s0, s1 = env.get(layer.name, (s.start_ns, s.end_ns))
            env[layer.name] = (min(s0, s.start_ns), max(s1, s.end_ns))
            parent = layer.attributes.get("parent_layer")
            layer = by_name.get(parent) if parent else None
    return env


def retime_layers(spans: Sequence[Span]) -> None:
    """Put layer spans that carry a host interval onto the GPU timeline, in place: from the
    first to the last GPU activity of the layer and its descendants (kernels already have
    their parents). Layers without GPU work keep their host interval."""
    layers = {s.span_id: s for s in spans if s.level is Level.LAYER}
    by_name = {s.name: s for s in layers.values()}
    env: dict[str, tuple[int, int]] = {}
    for s in spans:
        if s.level is not Level.KERNEL or s.kind not in GPU_ASYNC_KINDS:
            continue
        layer = layers.get(s.parent_id or "")
        seen: set[str] = set()
        while layer is not None and layer.span_id not in seen:
            seen.add(layer.span_id)
            s0, s1 = env.get(layer.span_id, (s.start_ns, s.end_ns))
            env[layer.span_id] = (min(s0, s.start_ns), max(s1, s.end_ns))
            parent = layer.attributes.get("parent_layer")
            layer = by_name.get(parent) if parent else None
    for span_id, (start, end) in env.items():
        layer = layers[span_id]
        if "host_start_ns" not in layer.attributes or layer.kind == GRAPH_KIND:
            continue
        layer.start_ns, layer.end_ns = start, end
        layer.attributes["time_base"] = "gpu_kernels"  # where it sits on the timeline
