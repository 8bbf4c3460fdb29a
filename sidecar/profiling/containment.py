"""Parent assignment by interval containment (XSP correlation).

A span's parent is the span exactly one replay level up (K -> L -> M) whose interval contains
it on the trace's single clock. When the candidates nest (module `layer1` contains
`layer1.0` contains `layer1.0.conv1`), the innermost one is the parent. When candidates that
do not nest contain a span (parallel layers) the span is flagged `parent_ambiguous` with its
`parent_candidates` and left without a parent rather than guessed; a span no candidate
contains is flagged `parent_missing`.
Asynchronous GPU activity (kernels, memcpys, memsets) is placed by its launch instead, see
`cupti_tracer.attach_gpu_activity`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sidecar.trace.spans import Level, Span

GPU_ASYNC_KINDS = frozenset({"kernel", "memcpy", "memset"})


def is_gpu_async(span: Span) -> bool:
    """True for GPU-side activity that runs after its launch (placed by correlation id)."""
    return span.level is Level.KERNEL and span.kind in GPU_ASYNC_KINDS


def assign_parents(spans: Sequence[Span]) -> None:
    """Set `parent_id` of every replay span below M from interval containment, in place."""
    by_depth: dict[int, list[Span]] = {}
    for span in spans:
        if span.level.depth >= 0:
            by_depth.setdefault(span.level.depth, []).append(span)
    for depth in sorted(by_depth):
        if depth == 0:
            continue
        parents = by_depth.get(depth - 1, [])
        starts = np.array([p.start_ns for p in parents], dtype=np.int64)
        ends = np.array([p.end_ns for p in parents], dtype=np.int64)
        for child in by_depth[depth]:
            if is_gpu_async(child):
                continue
            hits = np.nonzero((starts <= child.start_ns) & (ends >= child.end_ns))[0]
            _place(child, [parents[i] for i in hits])


def _place(child: Span, candidates: list[Span]) -> None:
    child.attributes.pop("parent_ambiguous", None)
    child.attributes.pop("parent_candidates", None)
    child.attributes.pop("parent_missing", None)
    inner = _innermost(candidates)
    if inner is not None:
        child.parent_id = inner.span_id
        return
    child.parent_id = None
    if candidates:
        child.attributes["parent_ambiguous"] = True
        child.attributes["parent_candidates"] = [c.span_id for c in candidates]
    else:
        child.attributes["parent_missing"] = True


def _innermost(candidates: list[Span]) -> Span | None:
    """The one candidate inside all others (nested layers), or None."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    ordered = sorted(
        candidates, key=lambda c: (c.end_ns - c.start_ns, -int(c.attributes.get("depth", 0)))
    )
    inner = ordered[0]
    for outer in ordered[1:]:
        if not (outer.start_ns <= inner.start_ns and inner.end_ns <= outer.end_ns):
            return None
    return inner


def place_by_interval(child: Span, start_ns: int, end_ns: int, parents: Sequence[Span]) -> None:
    """Give `child` the one parent in `parents` containing [start_ns, end_ns] (or flag it)."""
    _place(child, [p for p in parents if p.start_ns <= start_ns and end_ns <= p.end_ns])


def number_siblings(spans: Sequence[Span]) -> None:
    """Set `index` to the execution order among siblings (same parent and level), in place."""
    groups: dict[tuple[str | None, Level], list[Span]] = {}
    for span in spans:
        groups.setdefault((span.parent_id, span.level), []).append(span)
    for group in groups.values():
        for i, span in enumerate(sorted(group, key=_execution_order)):
            span.index = i


def _execution_order(span: Span) -> tuple[int, int, int]:
    """Start time; for nested layers starting together (`layer1`, `layer1.0`,
    `layer1.0.conv1` share their first kernel) the enclosing call first."""
    return (span.start_ns, int(span.attributes.get("depth", 0)), span.end_ns)
